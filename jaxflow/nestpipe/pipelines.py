"""The pipelines: one schedule each over the same stage functions (``stages.py``).

  ``sync``       load -> h2d -> route -> retrieve -> compute -> write back, one after another.
  ``dbp``        a host thread loads, copies, routes and retrieves batch t+1 into the Prefetch
                 buffer while batch t computes on the Active buffer; the rows both batches share
                 are then patched from the updated Active buffer (``buffers.py``) and the
                 buffers swap. Same operations in the same order as ``sync``: bit-identical.
  ``semi_sync``  the same overlap without the patch: batch t+1 trains on rows read before batch
                 t's update (one step stale, and t's update of shared rows is overwritten).
  ``fwp`` / ``dbp+fwp``  ``sync`` / ``dbp`` with a frozen-window compute (N micro-batches,
                 gradient accumulation) and key-centric clustering of samples.

``run_pipeline`` returns the dense state (tables are updated in place on the host) and per-stage
timings. On one CPU the overlap is between Python/numpy host work in a thread and XLA compute.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax

from jaxflow.embeddings.host import HostBatch, HostTable
from jaxflow.embeddings.spec import TableSpec
from jaxflow.nestpipe.buffers import patch_intersection_rows
from jaxflow.nestpipe.clustering import cluster_samples
from jaxflow.nestpipe.stages import (DeviceBatch, load_batch, reorder_batch, retrieve_rows,
                                     route_keys, to_device, write_back)

#: pipeline name -> (schedule, uses the frozen window)
PIPELINES = {"sync": ("sync", False), "dbp": ("dbp", False), "semi_sync": ("semi_sync", False),
             "fwp": ("sync", True), "dbp+fwp": ("dbp", True)}
HOST_STAGES = ("data", "h2d", "route", "retrieve")
STAGES = HOST_STAGES + ("compute", "write_back")


@dataclasses.dataclass
class Parts:
    """What a pipeline runs: data source, host tables, the jitted compute stage."""

    gen: Any  # .batch(step, batch_size) -> host dict
    specs: list[TableSpec]
    tables: dict[str, HostTable]
    compute: Callable  # stages.make_compute(...)
    batch_size: int
    capacity: int
    cluster: bool = False  # key-centric reordering of samples into micro-batches
    micro_batches: int = 1  # the frozen window's N (what clustering groups samples into)
    cluster_method: str = "vote"  # clustering.CLUSTER_METHODS
    num_shards: int = 8
    device: Any = None


def _block(tree):
    return jax.block_until_ready(tree)


def prefetch(parts: Parts, step: int, times: dict) -> tuple[HostBatch, DeviceBatch]:
    """Stages 1-4 for batch ``step``, each timed (seconds added into ``times``)."""
    t0 = time.perf_counter()
    host = load_batch(parts.gen, step, parts.batch_size)
    if parts.cluster:
        host = reorder_batch(host, cluster_samples(host["sparse"], parts.micro_batches,
                                                   parts.cluster_method))
    t1 = time.perf_counter()
    dev = _block(to_device(host, parts.device))
    t2 = time.perf_counter()
    routed = route_keys(parts.specs, host["sparse"], parts.num_shards)
    t3 = time.perf_counter()
    hb = retrieve_rows(parts.tables, routed, parts.capacity, parts.device)
    _block((hb.rows, hb.opt, hb.inverse))
    t4 = time.perf_counter()
    for k, dt in zip(HOST_STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        times[k] = times.get(k, 0.0) + dt
    return hb, dev


def _compute(parts, dense_state, hb: HostBatch, dev: DeviceBatch, times: dict):
    t0 = time.perf_counter()
    dense_state, rows, opt, loss = _block(parts.compute(dense_state, hb.rows, hb.opt, hb.inverse, dev))
    times["compute"] = times.get("compute", 0.0) + time.perf_counter() - t0
    return dense_state, rows, opt, loss


def _write_back(parts, hb, rows, opt, times):
    t0 = time.perf_counter()
    write_back(parts.tables, hb, rows, opt)
    times["write_back"] = times.get("write_back", 0.0) + time.perf_counter() - t0


def run_pipeline(schedule: str, parts: Parts, dense_state: dict, steps: int,
                 start: int = 0) -> tuple[dict, dict]:
    """Trains batches ``start .. start+steps-1``. ``schedule``: sync | dbp | semi_sync.

    Returns (dense_state, stats) with stats = {"losses": [...], "stage_seconds": {stage: mean
    per step}, "exposed_seconds": mean per step the main thread waited for stages 1-4,
    "step_seconds": wall per step, "patched_rows": mean per step}.
    """
    if schedule not in ("sync", "dbp", "semi_sync"):
        raise ValueError(f"schedule={schedule!r}; valid: sync, dbp, semi_sync")
    times, losses, exposed, patched = {}, [], 0.0, 0
    wall0 = time.perf_counter()
    if schedule == "sync":
        for t in range(start, start + steps):
            hb, dev = prefetch(parts, t, times)
            dense_state, rows, opt, loss = _compute(parts, dense_state, hb, dev, times)
            _write_back(parts, hb, rows, opt, times)
            losses.append(loss)
        exposed = sum(times.get(k, 0.0) for k in HOST_STAGES)
    else:
        with ThreadPoolExecutor(max_workers=1) as pool:
            thread_times: dict = {}
            hb, dev = prefetch(parts, start, times)
            exposed += sum(times.values())
            for t in range(start, start + steps):
                nxt = (pool.submit(prefetch, parts, t + 1, thread_times)
                       if t + 1 < start + steps else None)
                dense_state, rows, opt, loss = _compute(parts, dense_state, hb, dev, times)
                losses.append(loss)
                if nxt is None:
                    _write_back(parts, hb, rows, opt, times)
                    break
                w0 = time.perf_counter()
                next_hb, next_dev = nxt.result()
                exposed += time.perf_counter() - w0
                if schedule == "semi_sync":
                    # prefetch finished before this write: t+1 keeps its stale rows
                    _write_back(parts, hb, rows, opt, times)
                else:
                    p0 = time.perf_counter()
                    next_hb, n = patch_intersection_rows(next_hb, hb.unique_ids, rows, opt)
                    _block(next_hb.rows)
                    times["patch"] = times.get("patch", 0.0) + time.perf_counter() - p0
                    patched += n
                    # the thread for t+2 starts after this write, so it reads t's update
                    _write_back(parts, hb, rows, opt, times)
                hb, dev = next_hb, next_dev
            for k, v in thread_times.items():
                times[k] = times.get(k, 0.0) + v
    wall = time.perf_counter() - wall0
    stats = {"losses": [float(x) for x in jax.device_get(losses)],
             "stage_seconds": {k: v / steps for k, v in times.items()},
             "exposed_seconds": exposed / steps, "step_seconds": wall / steps,
             "patched_rows": patched / max(steps - 1, 1)}
    return dense_state, stats
