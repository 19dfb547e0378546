"""Two real processes (jax.distributed on 127.0.0.1, gloo) load one checkpoint onto a mesh
whose "fsdp" axis spans the processes: each reads only its own slices (bytes asserted), the
sharded model's logits equal a single-process load, and save_pretrained from the two
processes writes the original tensors back."""
import json
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

from jaxflow.models import TransformerConfig, from_pretrained
from jaxflow.models.hf_checkpoint import write_random_checkpoint
from tests._cli import ROOT, cli_env, free_port

LLAMA = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                          d_ff=64, max_seq_len=32, architecture="llama")


def test_each_process_reads_only_its_slices(tmp_path):
    path = str(tmp_path / "llama")
    write_random_checkpoint(LLAMA, path, seed=3, std=0.2)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    total = sum(t.nbytes for t in tensors.values())
    # every tensor but the norm scales has a d_model (= "embed") axis, split over the two
    # processes by "fsdp"; norm scales are replicated, so both processes read them whole
    norms = sum(t.nbytes for n, t in tensors.items() if n.endswith("norm.weight"))
    expected = (total - norms) // 2 + norms

    env = cli_env(JAX_PLATFORMS="cpu")
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests._hf_load_worker", path, f"127.0.0.1:{port}", str(i),
         str(tmp_path / "saved")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    reports = [json.loads(so.strip().splitlines()[-1]) for so, _ in outs]
    assert sorted(r["process"] for r in reports) == [0, 1]
    for r in reports:
        assert r["bytes_read"] == expected < total, (r["bytes_read"], expected, total)

    single = from_pretrained(path)
    import jax.numpy as jnp

    tokens = jnp.asarray(np.arange(16).reshape(2, 8) % LLAMA.vocab_size, jnp.int32)
    want = np.asarray(single(tokens))
    for r in reports:
        np.testing.assert_allclose(np.asarray(r["logits"]), want, atol=1e-5)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(saved) == sorted(tensors)
    for name, t in tensors.items():
        np.testing.assert_array_equal(saved[name], t, err_msg=name)
