"""The ``sparse_sync`` experiment: SparseRL-Sync on real GRPO runs (see configs/sparse_sync.py).

Per sync interval ``every``: a GRPO run from the addition warm start (the RL trainer's task
and model; the sampler runs bf16, ``mismatch="bf16"``), ``steps`` rollouts of one optimizer
step each. The trainer syncs itself (``GRPOTrainer(sync=config.sync with every)``): every
``every`` rollouts it publishes its f32 params through its own :class:`WeightSync` of codec
``sync.codec``, whose bf16 replica on the rollout sub-mesh serves the rollouts after the
per-rollout version check (see jaxflow.rl.grpo). Beside it, one measuring WeightSync per other
codec publishes the same params at the same versions (same trajectory, same snapshots). At
every sync:
changed fraction, bytes per codec, ratio vs dense, bytes / entropy bound, encode and delivery
time, and bit-exactness: every replica's hash == hash of the trainer's bf16 cast, and every
rollout since the previous sync sampled params whose hash is that cast too (``served_exact``;
``bit_exact`` is both). At
``every == tcp_every`` ``tcp_replicas`` replica processes (``python -m
jaxflow.sync.transport.tcp``, 127.0.0.1) receive the same payloads over TCP.

The GRPO runs, the sync rows and the TCP replicas are ``jaxflow.bench.sparse_sync``.
"""

from __future__ import annotations

import pathlib
import shutil
import signal
import tempfile

import jax
import numpy as np

from jaxflow.bench.sparse_sync import by_interval, median_finite, run_interval, start_tcp_replicas, tcp_links
from jaxflow.experiment import RunContext
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.rl.warm_start import load_pretrained_params
from jaxflow.sync import to_bf16
from jaxflow.train.lm_state import lm_functions

__all__ = ["main"]


def main(config, run: RunContext) -> dict:
    """Every interval of the sweep (``run_interval``), the TCP replicas' check, the summary."""
    meshes, roles = trainer_rollout_meshes(config.roles)
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sparse_sync_tcp-"))
    procs = []
    try:
        if config.tcp_replicas and run.is_primary:
            from flax import nnx
            template = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                                    nnx.to_pure_dict(fns.abstract_state))
            # started before the warm start loads so their start-up overlaps it
            procs = start_tcp_replicas(config.tcp_replicas, to_bf16(template), tmp)
        warm_params, pre = load_pretrained_params(config.pretrain, config.cache_root, fns,
                                                  log=run.info)
        links = tcp_links(procs) if procs else []
        rows, tcp = [], None
        for i, every in enumerate(config.sweep):
            use_tcp = links if every == config.tcp_every else []
            rows += run_interval(every, config, run, meshes=meshes, warm_params=warm_params,
                                 tcp_links=use_tcp, step_offset=i * config.steps)
            if use_tcp:
                served = [r for r in rows if r["every"] == every
                          and r["codec"] == config.sync.codec]
                statuses = [link.status() for link in use_tcp]
                tcp = {"processes": len(use_tcp), "every": every, "codec": config.sync.codec,
                       "syncs": len(served), "bit_exact_all": all(r["bit_exact"] for r in served),
                       "final_versions": [v for v, _ in statuses],
                       "payload_bytes_total": int(sum(r["payload_bytes"] for r in served))}
                run.info(f"TCP: {tcp}")
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    intervals = by_interval(rows)
    if run.is_primary:
        run.write_json("syncs.json", rows)
    first = config.sweep[0]
    at_first = [r for r in intervals if r["every"] == first]
    for r in intervals:
        run.info(f"every={r['every']:>3} {r['codec']:>8}: changed {r['changed_fraction_median']:.5f}"
                 f" ratio {r['ratio_vs_dense']:.1f}x bytes/bound "
                 f"{r['bytes_over_bound_median'] or float('nan'):.2f} exact {r['bit_exact_all']}")
    return {
        "roles": roles,
        "warm_start_accuracy": pre.get("heldout_accuracy"),
        "bit_exact_all": all(r["bit_exact"] for r in rows) and (tcp is None or tcp["bit_exact_all"]),
        "changed_fraction_median": median_finite(r["changed_fraction"] for r in rows
                                           if r["every"] == first),
        "ratio_vs_dense": {r["codec"]: r["ratio_vs_dense"] for r in at_first},
        "ratio_interval": first,
        "by_interval": intervals,
        "tcp": tcp,
        "syncs": len(rows),
    }

