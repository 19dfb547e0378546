"""SparseRL-Sync measured on real GRPO runs (the ``sparse_sync`` experiment's measurement).

Per sync interval ``every``: a GRPO run from the addition warm start syncing itself through its
own :class:`jaxflow.sync.WeightSync` every ``every`` rollouts, while one measuring WeightSync per
other codec publishes the same params at the same versions (:func:`run_interval`); per sync and
codec a row (:func:`sync_row`: changed fraction, bytes, ratio vs dense, bytes / entropy bound,
encode / delivery time, bit-exactness of the replicas and of every rollout served since the last
sync), summarised per interval (:func:`by_interval`). Optional replica processes over TCP
(:func:`start_tcp_replicas`, :func:`tcp_links`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import subprocess
import sys
import time

import jax
import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.sync import WeightSync, to_bf16, tree_digest
from jaxflow.sync.transport.tcp import TcpLink
from jaxflow.train.loop import run_steps

__all__ = ["IntervalState", "by_interval", "median_finite", "run_interval", "start_tcp_replicas", "sync_row",
           "tcp_links"]

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def median_finite(xs) -> float | None:
    """The median of the finite values of ``xs`` (None and nan skipped); None when none is."""
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    return float(np.median(xs)) if xs else None


def start_tcp_replicas(n: int, template, tmp: pathlib.Path) -> list:
    """Starts ``n`` replica processes (``python -m jaxflow.sync.transport.tcp``, 127.0.0.1) for
    the bf16 tree ``template``; [(process, its port file under ``tmp``)]."""
    (tmp / "template.pkl").write_bytes(pickle.dumps(jax.tree.map(np.zeros_like, template)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
    procs = []
    for i in range(n):
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "jaxflow.sync.transport.tcp", f"--template={tmp}/template.pkl",
             f"--port-file={tmp}/port{i}", "--timeout-s=30"], cwd=_ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), tmp / f"port{i}"))
    return procs


def tcp_links(procs, timeout_s: float = 120.0) -> list[TcpLink]:
    """A :class:`TcpLink` to each process of :func:`start_tcp_replicas` once its port file is
    written; raises when one exits or does not start within ``timeout_s``."""
    deadline, links = time.monotonic() + timeout_s, []
    for proc, port_file in procs:
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"replica process exited: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica process did not start within {timeout_s} s")
            time.sleep(0.05)
        links.append(TcpLink("127.0.0.1", int(port_file.read_text()), timeout_s=30))
    return links


@dataclasses.dataclass(frozen=True)
class IntervalState:
    """The loop state of one interval (``run_interval``).

    Attributes:
      rl: the GRPO trainer's state.
      cast: ``{version: tree_digest}`` of the trainer's bf16 cast at the served version.
      served_exact: every rollout since the last sync sampled exactly that cast.
      rows: the sync rows so far, one per (sync, codec), the serving codec first.
    """

    rl: dict
    cast: dict
    served_exact: bool = True
    rows: tuple = ()


def run_interval(every: int, config, run: RunContext, *, meshes, warm_params, tcp_links=(),
                 step_offset: int = 0) -> list[dict]:
    """One GRPO run syncing every ``every`` rollouts; one row per (sync, codec), the serving
    codec first. Fresh TCP replica processes behind ``tcp_links`` get a dense resync to
    version 0 when the trainer starts, then every sync. The rollouts run in
    ``jaxflow.train.loop.run_steps`` (one metrics row per rollout, with the sync's summary
    when it synced)."""
    # the serving sync also measures the entropy bound (the same for every codec)
    sync_cfg = dataclasses.replace(config.sync, every=every, bound=True)
    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim,
                          AdditionRLTask(max_digits=config.pretrain.data.max_digits),
                          CharTokenizer(), meshes, seed=config.seed, total_rollouts=config.steps,
                          sync=sync_cfg, sync_links=tcp_links)
    state = trainer.init_state(warm_params)
    serving = trainer.weight_sync
    params0 = state["policy"].params
    syncs = {config.sync.codec: serving}
    for c in config.codecs:  # the other codecs, measured on the same trajectory
        if c not in syncs:
            syncs[c] = WeightSync(params0, trainer.worker.param_shardings,
                                  dataclasses.replace(sync_cfg, codec=c, bound=False))

    def step_fn(loop: IntervalState, step: int) -> tuple[IntervalState, dict]:
        served = tree_digest(to_bf16(trainer.rollout_params(loop.rl)))  # after the version check
        served_exact = loop.served_exact and served == loop.cast.get(
            int(loop.rl["published_version"][0]))
        rl, metrics, sent = trainer.step_with_sync(loop.rl)
        row = {"every": every, "critic/rewards/mean": metrics["critic/rewards/mean"],
               "version/sampler": metrics["version/sampler"]}
        if sent is None:
            return dataclasses.replace(loop, rl=rl, served_exact=served_exact), row
        params, version, done = rl["policy"].params, serving.version, step + 1
        records = {codec: sent if ws is serving else ws.publish(params, version=version)
                   for codec, ws in syncs.items()}
        rows = [sync_row(every, done, codec, rec, len(syncs[codec].links), served_exact)
                for codec, rec in records.items()]
        bound = rows[0]["bound_bytes"]
        for r in rows:
            r["bytes_over_bound"] = r["payload_bytes"] / bound if bound > 0 else None
        row.update(sync_step=done, changed_fraction=rows[-1]["changed_fraction"],
                   bit_exact=all(r["bit_exact"] for r in rows))
        # the serving sender's snapshot digest: the hash of the trainer's bf16 cast (computed
        # once by the sync's verification)
        cast = {version: serving.sender.digest()}
        return IntervalState(rl, cast, True, loop.rows + tuple(rows)), row

    start = IntervalState(state, {serving.version: serving.sender.digest()})
    result = run_steps(step_fn, start, steps=config.steps, run=run, summarize=rollout_row,
                       step_offset=step_offset)
    return list(result.state.rows)


def sync_row(every: int, step: int, codec: str, rec, links: int, rollout_exact: bool) -> dict:
    """One (sync, codec) row from the WeightSync's SyncRecord of that publish."""
    s = rec.stats
    return {"every": every, "step": step, "codec": codec,
            "changed_fraction": s.changed_fraction, "payload_bytes": s.payload_bytes,
            "dense_bytes": s.dense_bytes, "ratio_vs_dense": s.ratio_vs_dense,
            "bound_bytes": s.bound_bytes, "encode_s": s.encode_s,
            "path": s.path, "host_bytes": s.host_bytes,
            "deliver_s": rec.deliver_s, "links": links,
            "bit_exact": rec.bit_exact and rollout_exact,
            "served_exact": rollout_exact,
            "routes": [r.get("route") for r in rec.report]}


def by_interval(rows: list[dict]) -> list[dict]:
    """One summary per (interval, codec) of the sync rows: medians of the changed fraction,
    ratio vs dense, bytes, bytes / bound, encode and delivery time; bit-exact over all."""
    out = []
    for every in dict.fromkeys(r["every"] for r in rows):
        for codec in dict.fromkeys(r["codec"] for r in rows):
            sel = [r for r in rows if r["every"] == every and r["codec"] == codec]
            if not sel:
                continue
            out.append({
                "every": every, "codec": codec, "syncs": len(sel),
                "changed_fraction_median": median_finite(r["changed_fraction"] for r in sel),
                "ratio_vs_dense": median_finite(r["ratio_vs_dense"] for r in sel),
                "payload_bytes_median": median_finite(r["payload_bytes"] for r in sel),
                "dense_bytes": sel[0]["dense_bytes"],
                "bytes_over_bound_median": median_finite(r["bytes_over_bound"] for r in sel),
                "encode_s_median": median_finite(r["encode_s"] for r in sel),
                "path": sel[0]["path"],
                "host_bytes_median": median_finite(r["host_bytes"] for r in sel),
                "deliver_s_median": median_finite(r["deliver_s"] for r in sel),
                "bit_exact_all": all(r["bit_exact"] for r in sel),
            })
    return out
