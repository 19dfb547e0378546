"""Fan-out to several replicas: lagging ones catch up by chain or dense resync (whichever is
smaller), failures leave replicas on their version, and a 2-process TCP run with 2 replica
processes syncs a real model bit-exactly."""

import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.sync import FRESH, PayloadError, Replica, SyncSender, VersionMismatch, to_bf16, tree_digest
from jaxflow.sync.transport import InProcessLink, TcpLink
from jaxflow.train.lm_state import init_params, lm_functions
from tests.test_sync_transport import trainer_tree, trajectory

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _replicas(n):
    return [Replica(to_bf16(trainer_tree())) for _ in range(n)]


def test_fan_out_lagging_replica_gets_chain_fresh_gets_dense():
    sender = SyncSender(trainer_tree(), codec="auto", history=8)
    up, lagging = _replicas(2)
    fresh = Replica(jax.tree.map(np.zeros_like, to_bf16(trainer_tree())), version=FRESH)
    links = [InProcessLink(r) for r in (up, lagging, fresh)]
    trees = trajectory(4)
    sender.publish(trees[0])
    report = sender.sync_all(links)
    assert [r["route"] for r in report] == ["chain", "chain", "dense"]
    for tree in trees[1:3]:  # the lagging replica misses versions 2 and 3
        sender.publish(tree)
        sender.sync_all([links[0], links[2]])
    assert lagging.version == 1 and up.version == 3
    sender.publish(trees[3])
    chain = sender.chain_from(1)
    assert len(chain) == 3 and sum(map(len, chain)) < len(sender.dense_payload())
    before = lagging.bytes_received
    report = sender.sync_all(links)
    assert all(r["ok"] and r["version"] == 4 for r in report)
    assert report[1]["route"] == "chain"
    assert lagging.bytes_received - before == sum(map(len, chain))
    assert {r.digest() for r in (up, lagging, fresh)} == {tree_digest(to_bf16(trees[3]))}


def test_dense_resync_when_smaller_than_chain_or_out_of_history():
    sender = SyncSender(trainer_tree(), codec="coo", history=2)
    lagging, old = _replicas(2)
    rng = np.random.default_rng(5)
    for v in range(1, 4):  # every element changes: a 3-payload COO chain > one dense payload
        tree = jax.tree.map(lambda x: x + rng.normal(size=x.shape).astype(x.dtype), trainer_tree())
        sender.publish(tree)
        if v == 1:
            sender.sync(InProcessLink(lagging))
    assert sender.chain_from(1) is not None and sender.chain_from(0) is None  # history = 2
    assert sum(map(len, sender.chain_from(1))) > len(sender.dense_payload())
    sender.sync(InProcessLink(lagging))
    sender.sync(InProcessLink(old))
    assert sender.routes[-2:] == ["dense", "dense"]
    assert lagging.digest() == old.digest() == sender.digest()


def test_rejected_payload_and_version_check():
    sender = SyncSender(trainer_tree(), codec="entropy")
    replica = _replicas(1)[0]
    trees = trajectory(2)
    sender.publish(trees[0])
    sender.publish(trees[1])
    step_2 = sender.chain_from(1)[0]  # applies to version 1 only
    before = replica.digest()
    with pytest.raises(PayloadError, match="applies to version 1, replica is at 0"):
        replica.receive(step_2)
    assert replica.version == 0 and replica.digest() == before
    with pytest.raises(VersionMismatch, match="at version 0, the trainer published 2"):
        replica.check_version(sender.version)
    sender.sync(InProcessLink(replica))
    replica.check_version(2)


def _real_model_versions(n):
    """A real transformer's params, then n Adam steps (lr 1e-4) on random gradients, in numpy
    (f32 master weights; eager jax ops would compile per leaf shape)."""
    model = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                              d_ff=64, max_seq_len=32)
    mesh = role_meshes({"trainer": 1})["trainer"]
    params = jax.device_get(init_params(lm_functions(model, mesh), model, jax.random.key(0)))
    rng = np.random.default_rng(1)
    m = jax.tree.map(np.zeros_like, params)
    v = jax.tree.map(np.zeros_like, params)
    out = [params]
    for t in range(1, n + 1):
        g = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), params)
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        params = jax.tree.map(
            lambda p, m, v: (p - 1e-4 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
                             ).astype(p.dtype), params, m, v)
        out.append(params)
    return out


def _start_replica(tmp_path, i, template):
    path = tmp_path / "template.pkl"
    path.write_bytes(pickle.dumps(template))
    port_file = tmp_path / f"port{i}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "jaxflow.sync.transport.tcp",
                             f"--template={path}", f"--port-file={port_file}",
                             "--timeout-s=10"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, port_file


def _wait_port(proc, port_file, deadline):
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"replica process died: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError("replica process did not start in time")
        time.sleep(0.05)
    return int(port_file.read_text())


def test_two_process_tcp_real_model(tmp_path):
    versions = _real_model_versions(4)
    template = jax.tree.map(np.zeros_like, to_bf16(versions[0]))
    procs = [_start_replica(tmp_path, i, template) for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        links = [TcpLink("127.0.0.1", _wait_port(p, f, deadline), timeout_s=10)
                 for p, f in procs]
        sender = SyncSender(versions[0], codec="auto")
        report = sender.sync_all(links)  # fresh replica processes: dense resync to version 0
        assert [r["route"] for r in report] == ["dense", "dense"]
        for v, params in enumerate(versions[1:], start=1):
            stats = sender.publish(params)
            assert 0 < stats.changed_fraction < 0.5
            if v == 2:  # replica 1 misses version 2
                report = sender.sync_all(links[:1])
            else:
                report = sender.sync_all(links)
            assert all(r["ok"] for r in report), report
            if v == 3:  # caught up from version 1 by the chain 1 -> 2 -> 3
                assert report[1]["route"] == "chain" and sender.chain_from(1) is not None
        digest = tree_digest(to_bf16(versions[-1]))
        assert [link.status() for link in links] == [(4, digest)] * 2
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=10)
