"""The ``bench_checkpoint`` measurements: Hugging Face checkpoint loading (time, peak memory),
forward throughput vs transformers, and the MoE layer's all-to-all expert parallelism vs the
dense all-experts reference (what each figure means: ``configs/bench_checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import resource
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.experiment import RunContext
from jaxflow.mesh import make_mesh
from jaxflow.models import Transformer, TransformerConfig, from_pretrained, param_count
from jaxflow.models.hf_checkpoint import write_random_checkpoint
from jaxflow.models.moe import moe_dense, moe_expert_parallel, route

__all__ = ["alternate_ratio", "bench_forward", "bench_load", "bench_moe"]


def _rss_bytes() -> int:
    """This process's resident set size in bytes (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _load_worker(path: str, queue) -> None:
    """Runs in a fresh process: RSS before, load, peak RSS (ru_maxrss) after."""
    jax.numpy.zeros(1).block_until_ready()  # backend up before the baseline
    before = _rss_bytes()
    t0 = time.perf_counter()
    model = from_pretrained(path)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put({"seconds": seconds, "rss_before": before, "rss_peak": peak,
               "rss_after": _rss_bytes(),
               "loaded_bytes": int(sum(x.nbytes for x in leaves))})


def bench_load(cfg, scratch: str, run: RunContext) -> dict:
    """Writes a random Llama-style checkpoint of ``cfg``'s shape under ``scratch`` and loads it
    with ``from_pretrained`` in a fresh (spawned) process: load seconds, GB/s and the peak RSS
    growth over the tensor bytes (target <= 1.2)."""
    config = TransformerConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                               n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                               n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, max_seq_len=4096,
                               rope_theta=5e5, dtype=cfg.dtype, param_dtype=cfg.dtype,
                               architecture="llama")
    path = os.path.join(scratch, "load_ckpt")
    t0 = time.perf_counter()
    nbytes = write_random_checkpoint(config, path, max_shard_bytes=cfg.max_shard_bytes)
    params = param_count(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    run.info(f"load: wrote {nbytes / 2**30:.2f} GiB ({params / 1e9:.3f}B params) in "
             f"{time.perf_counter() - t0:.0f}s")
    queue = multiprocessing.get_context("spawn").Queue()
    proc = multiprocessing.get_context("spawn").Process(target=_load_worker, args=(path, queue))
    proc.start()
    out = queue.get(timeout=1800)
    proc.join()
    shutil.rmtree(path, ignore_errors=True)
    growth = out["rss_peak"] - out["rss_before"]
    return {"params": params, "dtype": cfg.dtype, "tensor_bytes": nbytes, "load_seconds": out["seconds"],
            "GB_per_s": nbytes / out["seconds"] / 1e9,
            "peak_rss_growth_bytes": growth, "peak_rss_growth_ratio": growth / nbytes,
            "target_ratio": 1.2, "meets_target": growth / nbytes <= 1.2}


def alternate_ratio(a, b, pairs: int) -> dict:
    """Median of per-pair time ratios b / a (after one warm-up each), alternating order."""
    a(), b()
    ta, tb, ratios = [], [], []
    for i in range(pairs):
        order = (a, b) if i % 2 == 0 else (b, a)
        times = {}
        for f in order:
            t0 = time.perf_counter()
            f()
            times[f] = time.perf_counter() - t0
        ta.append(times[a])
        tb.append(times[b])
        ratios.append(times[b] / times[a])
    return {"a_ms": 1e3 * float(np.median(ta)), "b_ms": 1e3 * float(np.median(tb)),
            "ratio_b_over_a": float(np.median(ratios)), "pairs": pairs}


def bench_forward(cfg, scratch: str, seed: int) -> dict:
    """One small random Qwen3 checkpoint loaded by jaxflow and by transformers (f32, CPU):
    forward tokens/s of tokens [batch, seq_len] in alternated pairs and the max |logit diff|.
    Needs the ``parity`` extra (torch, transformers)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError("bench_checkpoint's forward part compares with transformers: "
                           "pip install 'jaxflow[parity]'") from e
    config = TransformerConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                               n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                               n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff,
                               max_seq_len=cfg.seq_len, qk_norm=True, rope_theta=1e6,
                               architecture="qwen3")
    path = os.path.join(scratch, "forward_ckpt")
    write_random_checkpoint(config, path, seed=seed)
    ours = from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.eval()
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (cfg.batch, cfg.seq_len))
    graphdef, state = nnx.split(ours)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    jt = jnp.asarray(tokens, jnp.int32)
    tt = torch.from_numpy(tokens)

    def jaxflow_fwd():
        return fwd(state, jt).block_until_ready()

    def torch_fwd():
        with torch.no_grad():
            return ref(tt).logits

    max_diff = float(np.abs(np.asarray(jaxflow_fwd()) - torch_fwd().numpy()).max())
    # torch's OpenMP pool degrades badly on a loaded 2-core machine (measured 4-6 s per call
    # with 2 threads vs 0.2-0.3 s with 1): give the reference its faster thread count.
    probe = {}
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        torch_fwd()
        t0 = time.perf_counter()
        for _ in range(3):
            torch_fwd()
        probe[threads] = (time.perf_counter() - t0) / 3
    torch.set_num_threads(min(probe, key=probe.get))
    r = alternate_ratio(jaxflow_fwd, torch_fwd, cfg.pairs)
    n_tok = cfg.batch * cfg.seq_len
    shutil.rmtree(path, ignore_errors=True)
    return {"params": param_count(ours), "batch": cfg.batch, "seq_len": cfg.seq_len,
            "jaxflow_ms": r["a_ms"], "transformers_ms": r["b_ms"],
            "jaxflow_tokens_per_s": n_tok / r["a_ms"] * 1e3,
            "transformers_tokens_per_s": n_tok / r["b_ms"] * 1e3,
            "speedup_jaxflow_over_transformers": r["ratio_b_over_a"], "pairs": r["pairs"],
            "torch_threads": torch.get_num_threads(),
            "torch_thread_probe_ms": {str(k): 1e3 * v for k, v in probe.items()},
            "max_abs_logit_diff": max_diff}


def bench_moe(cfg, seed: int) -> dict:
    """``moe_expert_parallel`` (shard_map all-to-all at ``capacity_factor``) vs ``moe_dense`` on
    tokens [tokens, d_model] sharded over every device: alternated pairs, the dropped-token
    fraction, and the all-to-all at capacity E against the dense result."""
    n_dev = len(jax.devices())
    mesh = make_mesh({"expert": n_dev})
    ks = jax.random.split(jax.random.key(seed), 5)
    d, f, e = cfg.d_model, cfg.d_ff_expert, cfg.n_experts
    tok = NamedSharding(mesh, P("expert"))
    rep = NamedSharding(mesh, P())
    x = jax.device_put(jax.random.normal(ks[0], (cfg.tokens, d)), tok)
    router = jax.device_put(jax.random.normal(ks[1], (d, e)), rep)
    w = [jax.random.normal(k, s) * s[1] ** -0.5
         for k, s in zip(ks[2:], ((e, d, f), (e, d, f), (e, f, d)))]
    w_ep = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in w]
    w_rep = [jax.device_put(a, rep) for a in w]
    ep = jax.jit(lambda x, r, *w: moe_expert_parallel(
        x, r, *w, mesh=mesh, axis="expert", k=cfg.k, norm_topk_prob=True,
        capacity_factor=cfg.capacity_factor))
    dense = jax.jit(lambda x, r, *w: moe_dense(x, route(x, r, k=cfg.k, norm_topk_prob=True),
                                               *w), out_shardings=tok)
    y_ep, stats = ep(x, router, *w_ep)
    y_dense = dense(x, router, *w_rep)
    r = alternate_ratio(lambda: ep(x, router, *w_ep)[0].block_until_ready(),
                   lambda: dense(x, router, *w_rep).block_until_ready(), cfg.pairs)
    big = dataclasses.replace(cfg, capacity_factor=float(e))
    ep_full = jax.jit(lambda x, r, *w: moe_expert_parallel(
        x, r, *w, mesh=mesh, axis="expert", k=big.k, norm_topk_prob=True,
        capacity_factor=big.capacity_factor))
    y_full, stats_full = ep_full(x, router, *w_ep)
    return {"devices": n_dev, "experts": e, "k": cfg.k, "tokens": cfg.tokens, "d_model": d,
            "d_ff_expert": f, "capacity_factor": cfg.capacity_factor,
            "all_to_all_ms": r["a_ms"], "dense_ms": r["b_ms"],
            "speedup_all_to_all_over_dense": r["ratio_b_over_a"], "pairs": r["pairs"],
            "dropped_fraction": float(stats.dropped_fraction),
            "dropped_fraction_capacity_E": float(stats_full.dropped_fraction),
            "max_abs_diff_capacity_E_vs_dense": float(jnp.abs(y_full - y_dense).max())}
