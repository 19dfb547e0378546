"""The pipelines: one schedule each over the same stage functions, on a mesh of P devices.

  ``sync``       load -> h2d -> route (All2All keys) -> retrieve (host threads) -> exchange
                 (All2All rows) -> compute -> write back, one after another.
  ``dbp``        a host thread runs stages 1-4 of batch t+1 into the Prefetch owner buffers while
                 batch t exchanges and computes on the Active ones; each owner's rows shared by
                 both batches are then patched from its updated Active buffer (``buffers.py``)
                 and the buffers swap. Same operations in the same order as ``sync``:
                 bit-identical.
  ``semi_sync``  the same overlap without the patch: batch t+1 trains on rows read before batch
                 t's update (one step stale, and t's update of shared rows is overwritten).
  ``sparse_dist`` TorchRec's ``TrainPipelineSparseDist`` schedule: a host thread runs stages
                 1-3 of batch t+1 (load, h2d, key routing: TorchRec's input_dist) while batch t
                 computes; the rows of t+1 are read only after t's write back, so nothing is
                 stale and the result is bit-identical to ``sync``. The baseline an
                 experienced TorchRec user would run.
  ``fwp`` / ``dbp+fwp``  ``sync`` / ``dbp`` with the paper's frozen-window pipelining (FWP):
                 N micro-batches against the same frozen rows and dense params, one update;
                 every micro-batch routed and deduped alone (key-centric clustering of samples
                 first), micro-batch i+1's row All2All issued before i's dense compute and i's
                 gradient All2All after it (``MeshStages.frozen_exchange = per_micro_batch``),
                 so async collectives (GPU/TPU) can overlap them. The same on every platform;
                 the CPU backend's collectives are synchronous, so there nothing overlaps.
  ``sync_accum`` ``sync`` with the window routed, deduped and exchanged once as a whole and only
                 the backward split into N micro-batches (``frozen_exchange = window``): the
                 collectives of sync plus gradient accumulation, no clustering; NOT FWP (nothing
                 is left to overlap), measured beside it as what the window alone costs.

Across processes (a mesh over several processes' devices, ``MeshStages.multiprocess``): the
collectives of the programs one process launches are matched with the other processes' in
launch order (gloo on CPU), so the key routing that a host thread launches for batch t+1
(stage 3: an All2All) must come at the same point of every process's sequence. There a
``LaunchOrder`` holds it until the main thread has launched batch t's compute (per step:
exchange t, compute t, route t+1), costing the overlap of route t+1 (and, for dbp /
semi_sync, of retrieval t+1) with compute t; stages 1-2 of t+1 still overlap it. In one
process the thread launches at once, as before. Each process reads and writes back its own
devices' owner buffers only; ``HostShards.merge`` makes every copy of the tables whole after
the run (outside the timed wall).

``run_pipeline`` returns the dense state (tables are updated in place on the host) and per-stage
timings. A stop signal (``jaxflow.signals``) ends it between two steps, never inside one: an
abandoned step would leave its compilation running on XLA's threads. On the CPU backend
collectives are synchronous and the 2 cores are shared by all "devices", so the only real
overlap is host work (numpy, threads) against XLA compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jaxflow import signals
from jaxflow.embeddings.host import HostTable
from jaxflow.embeddings.spec import TableSpec
from jaxflow.nestpipe.buffers import patch_intersection_rows
from jaxflow.nestpipe.host_io import HostShards
from jaxflow.nestpipe.sharded import MeshStages, OwnerBuffer, Routed
from jaxflow.nestpipe.stages import DeviceBatch, cluster_order, load_batch, reorder_batch, to_device
from jaxflow.train.state import TrainState

#: pipeline name -> (schedule, window): window None (one batch, one update), "frozen" (the
#: paper's frozen window, ``per_micro_batch`` unless the config picks the ``batched``
#: diagnostic) or "whole" (the whole-window ``window`` schedule: sync plus gradient accumulation)
PIPELINES = {"sync": ("sync", None), "dbp": ("dbp", None), "semi_sync": ("semi_sync", None),
             "sparse_dist": ("sparse_dist", None), "fwp": ("sync", "frozen"),
             "dbp+fwp": ("dbp", "frozen"), "sync_accum": ("sync", "whole")}
HOST_STAGES = ("data", "h2d", "route", "retrieve")
#: timed stages; ``exchange`` (the row All2All) is fused into ``compute`` in the frozen window
#: (``per_micro_batch`` / ``batched``), a program of its own otherwise
STAGES = HOST_STAGES + ("compute", "write_back", "exchange")


@dataclasses.dataclass
class Parts:
    """What a pipeline runs: data source, host tables, the mesh's stage programs."""

    gen: Any  # .batch(step, batch_size) -> host dict
    specs: list[TableSpec]
    tables: dict[str, HostTable]
    stages: MeshStages
    batch_size: int
    cluster: bool = False  # key-centric reordering of samples into micro-batches
    cluster_method: str = "vote"  # clustering.CLUSTER_METHODS

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (the stages' ``n``)."""
        return self.stages.n


class Prefetched:
    """Stages 1-4 of one batch: the owner buffer, its routing and the batch on the mesh."""

    def __init__(self, buf: OwnerBuffer, routed: Routed, dev: DeviceBatch):
        self.buf, self.routed, self.dev = buf, routed, dev


class LaunchOrder:
    """The host thread's route launch at a fixed point of the main thread's sequence.

    ``enabled`` (several processes): :meth:`wait_turn` (the thread, before it launches stage 3)
    blocks until the main thread calls :meth:`allow` (after it launched batch t's compute);
    one allowance per launch. Disabled (one process): nothing waits. :meth:`close` releases a
    waiting thread with an error (the run is ending; launching then could mismatch the other
    processes' collectives).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._turns = threading.Semaphore(0)
        self._closed = False

    def allow(self) -> None:
        if self.enabled:
            self._turns.release()

    def wait_turn(self) -> None:
        if self.enabled:
            self._turns.acquire()
            if self._closed:
                raise RuntimeError("pipeline ended before this prefetch's route launch")

    def close(self) -> None:
        if self.enabled:
            self._closed = True
            self._turns.release()


def _block(tree):
    return jax.block_until_ready(tree)


def _add(times: dict, key: str, dt: float):
    times[key] = times.get(key, 0.0) + dt


def prefetch_input(parts: Parts, step: int, times: dict,
                   order: LaunchOrder | None = None) -> tuple[Routed, DeviceBatch]:
    """Stages 1-3 for batch ``step`` (load, h2d, key routing), each timed into ``times``;
    ``order``: the route waits for its turn (a host thread, several processes)."""
    st = parts.stages
    t0 = time.perf_counter()
    host = load_batch(parts.gen, step, parts.batch_size)
    if parts.cluster:
        host = reorder_batch(host, cluster_order(host["sparse"], st.num_shards, st.n,
                                                 parts.cluster_method))
    t1 = time.perf_counter()
    dev = _block(to_device(host, st.shard))
    if order is not None:
        order.wait_turn()  # not timed: the wait is the schedule's, not stage 3's
    t2 = time.perf_counter()
    routed = st.route(dev.ids)  # fetches owner ids to the host: synchronous
    t3 = time.perf_counter()
    for k, dt in zip(HOST_STAGES[:3], (t1 - t0, t2 - t1, t3 - t2)):
        _add(times, k, dt)
    return routed, dev


def _retrieve(shards: HostShards, routed: Routed, times: dict) -> OwnerBuffer:
    t0 = time.perf_counter()
    buf = _block(shards.retrieve(routed))
    _add(times, "retrieve", time.perf_counter() - t0)
    return buf


def prefetch(parts: Parts, shards: HostShards, step: int, times: dict,
             order: LaunchOrder | None = None) -> Prefetched:
    """Stages 1-4 for batch ``step``, each timed (seconds added into ``times``)."""
    routed, dev = prefetch_input(parts, step, times, order)
    return Prefetched(_retrieve(shards, routed, times), routed, dev)


def _compute(parts: Parts, dense_state, pf: Prefetched, times: dict,
             launched: LaunchOrder | None = None):
    st = parts.stages
    if st.separate_exchange:
        t0 = time.perf_counter()
        emb = _block(st.exchange(pf.buf, pf.routed))
        _add(times, "exchange", time.perf_counter() - t0)
    else:
        emb = None  # the frozen window exchanges inside its compute program
    t0 = time.perf_counter()
    out = st.compute(dense_state, pf.buf, pf.routed, emb, pf.dev.ids, pf.dev.dense, pf.dev.label)
    if launched is not None:
        launched.allow()  # the thread's route of the next batch may launch now
    out = _block(out)
    _add(times, "compute", time.perf_counter() - t0)
    return out


def _write_back(shards: HostShards, pf: Prefetched, rows, opt, times):
    t0 = time.perf_counter()
    shards.write_back(pf.buf, rows, opt)
    _add(times, "write_back", time.perf_counter() - t0)


def run_pipeline(schedule: str, parts: Parts, dense_state: TrainState, steps: int,
                 start: int = 0) -> tuple[TrainState, dict]:
    """Trains batches ``start .. start+steps-1``. ``schedule``: sync | dbp | semi_sync |
    sparse_dist.

    ``dense_state``: the dense model's ``TrainState`` (replicated); the host tables in
    ``parts`` are updated in place.

    Returns (dense_state, stats) with stats = {"losses": [...], "stage_seconds": {stage: mean
    per step}, "exposed_seconds": mean per step the main thread waited for stages 1-4,
    "step_seconds": wall per step, "patched_rows": mean per step, "owner_rows": mean distinct
    rows per owner per step}.
    """
    if schedule not in ("sync", "dbp", "semi_sync", "sparse_dist"):
        raise ValueError(f"schedule={schedule!r}; valid: sync, dbp, semi_sync, sparse_dist")
    times, losses, exposed, patched, owner_rows = {}, [], 0.0, 0, 0
    shards = HostShards(parts.stages, parts.tables)
    order = LaunchOrder(parts.stages.multiprocess)
    wall0 = time.perf_counter()
    try:
        if schedule == "sync":
            for t in range(start, start + steps):
                signals.abandon_if_requested()
                pf = prefetch(parts, shards, t, times)
                dense_state, rows, opt, loss = _compute(parts, dense_state, pf, times)
                _write_back(shards, pf, rows, opt, times)
                losses.append(loss)
                owner_rows = owner_rows + pf.buf.owner_counts
            exposed = sum(times.get(k, 0.0) for k in HOST_STAGES)
        elif schedule == "sparse_dist":
            with (ThreadPoolExecutor(max_workers=1, thread_name_prefix="nestpipe-input") as pool,
                  contextlib.closing(order)):
                thread_times: dict = {}
                nxt = pool.submit(prefetch_input, parts, start, thread_times, order)
                order.allow()  # nothing of this run launched yet
                for t in range(start, start + steps):
                    signals.abandon_if_requested()
                    w0 = time.perf_counter()
                    routed, dev = nxt.result()
                    nxt = (pool.submit(prefetch_input, parts, t + 1, thread_times, order)
                           if t + 1 < start + steps else None)
                    # rows read after t-1's write back: never stale
                    pf = Prefetched(_retrieve(shards, routed, times), routed, dev)
                    exposed += time.perf_counter() - w0
                    dense_state, rows, opt, loss = _compute(parts, dense_state, pf, times, order)
                    _write_back(shards, pf, rows, opt, times)
                    losses.append(loss)
                    owner_rows = owner_rows + pf.buf.owner_counts
                for k, v in thread_times.items():
                    _add(times, k, v)
        else:
            with (ThreadPoolExecutor(max_workers=1, thread_name_prefix="nestpipe-prefetch") as pool,
                  contextlib.closing(order)):
                thread_times: dict = {}
                pf = prefetch(parts, shards, start, times)
                exposed += sum(times.values())
                for t in range(start, start + steps):
                    signals.abandon_if_requested()
                    nxt = (pool.submit(prefetch, parts, shards, t + 1, thread_times, order)
                           if t + 1 < start + steps else None)
                    dense_state, rows, opt, loss = _compute(parts, dense_state, pf, times, order)
                    losses.append(loss)
                    owner_rows = owner_rows + pf.buf.owner_counts
                    if nxt is None:
                        _write_back(shards, pf, rows, opt, times)
                        break
                    w0 = time.perf_counter()
                    nxt_pf = nxt.result()
                    exposed += time.perf_counter() - w0
                    if schedule == "dbp":
                        p0 = time.perf_counter()
                        nxt_pf.buf, n = patch_intersection_rows(parts.stages, nxt_pf.buf, pf.buf,
                                                                rows, opt)
                        _block(nxt_pf.buf.rows)
                        _add(times, "patch", time.perf_counter() - p0)
                        patched += n
                    # semi_sync: the prefetch finished before this write, t+1 keeps stale rows.
                    # dbp: the thread for t+2 starts after this write, so it reads t's update.
                    _write_back(shards, pf, rows, opt, times)
                    pf = nxt_pf
                for k, v in thread_times.items():
                    _add(times, k, v)
    finally:
        shards.close()
    wall = time.perf_counter() - wall0
    shards.merge()  # several processes: every copy of the tables whole again (not timed)
    stats = {"losses": [float(x) for x in jax.device_get(losses)],
             "stage_seconds": {k: v / steps for k, v in times.items()},
             "exposed_seconds": exposed / steps, "step_seconds": wall / steps,
             "patched_rows": patched / max(steps - 1, 1),
             "owner_rows": [float(x) / steps for x in owner_rows]}
    return dense_state, stats
