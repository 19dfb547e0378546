"""Stage 4 and the write-back on the host: each shard's owner buffer from / to the host tables.

Shard p owns row block ``[p*R_a, (p+1)*R_a)`` of every row-wise table a (``R_a = ceil(V_a/P)``),
at local rows ``off_a + i % R_a`` of the group. The route stage hands each owner its distinct
local rows, sorted — so each table's rows form one contiguous run of them. One host thread per
shard reads its rows and optimizer state, pads to the owner capacity and puts them on that
shard's device; a shard that received no ids gets an all-padding buffer.

Across processes (a mesh over several processes' devices) every process holds a full copy of
the host tables but reads, places and writes back only the owner buffers of its own devices
(``MeshStages.local_shards``): during a run each process's copy is current in its own shards'
row blocks only, and ``HostShards.merge`` (at the end of a run, on every process at the same
point) gathers every block from the process that owns it, so all copies are equal again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxflow.embeddings.host import HostTable
from jaxflow.nestpipe.sharded import MeshStages, OwnerBuffer, Routed


def _table_runs(stages: MeshStages, local_rows: np.ndarray, shard: int):
    """[(table name, positions slice in local_rows, table rows)] for one owner's sorted rows."""
    out = []
    for layout in stages.plan.group_tables(stages.group.name):
        lo, hi = np.searchsorted(local_rows, [layout.offset, layout.offset + layout.rows_per_shard])
        if hi > lo:
            rows = shard * layout.rows_per_shard + local_rows[lo:hi].astype(np.int64) - layout.offset
            out.append((layout.spec.name, slice(lo, hi), rows))
    return out


def _read_shard(stages: MeshStages, tables: dict[str, HostTable], opt_template: dict,
                owner_ids: np.ndarray, count: int, shard: int):
    co, d = stages.owner_capacity, stages.dim
    rows = np.zeros((co, d), np.float32)
    opt = {k: np.zeros((co,) + v.shape[1:], v.dtype) for k, v in opt_template.items()}
    for name, pos, table_rows in _table_runs(stages, owner_ids[:count], shard):
        values, state = tables[name].read_rows(table_rows)
        rows[pos] = values
        for k, v in state.items():
            opt[k][pos] = v
    return rows, opt


class HostShards:
    """The retrieval threads (one per shard) over a dict of host tables."""

    def __init__(self, stages: MeshStages, tables: dict[str, HostTable]):
        self.stages, self.tables = stages, tables
        # zero-row reads: each optimizer-state array's row shape and dtype, for padding buffers
        self._opt_template = next(iter(tables.values())).read_rows(np.zeros(0, np.int64))[1]
        self._pool = ThreadPoolExecutor(max_workers=stages.num_shards,
                                        thread_name_prefix="nestpipe-retrieve")

    def close(self):
        """Stop the host worker threads (waits for running tasks)."""
        self._pool.shutdown(wait=True)

    def retrieve(self, routed: Routed) -> OwnerBuffer:
        """Stage 4: every owner's rows (+ optimizer state) into its device's buffer (this
        process's owners only when the mesh spans several processes)."""
        st = self.stages
        local = st.local_shards
        parts = dict(zip(local, self._pool.map(
            lambda p: _read_shard(st, self.tables, self._opt_template, routed.owner_ids[p],
                                  int(routed.owner_counts[p]), p),
            local)))
        rows = st.from_shards({p: r for p, (r, _) in parts.items()})
        opt = {k: st.from_shards({p: o[k] for p, (_, o) in parts.items()})
               for k in self._opt_template}
        return OwnerBuffer(rows, opt, routed.owner_ids, routed.owner_counts)

    def write_back(self, buf: OwnerBuffer, rows, opt) -> None:
        """Stores each owner's updated rows (only its real ones) and optimizer state (this
        process's owners only when the mesh spans several processes: no collective)."""
        st = self.stages
        rows = st.local_blocks(rows)
        opt = {k: st.local_blocks(v) for k, v in opt.items()}
        for p in st.local_shards:
            n = int(buf.owner_counts[p])
            for name, pos, table_rows in _table_runs(st, buf.owner_ids[p][:n], p):
                self.tables[name].write_rows(table_rows, rows[p][pos],
                                             {k: v[p][pos] for k, v in opt.items()})

    def merge(self) -> None:
        """Across processes: every table's row blocks from the processes that own them (one
        all-gather per table), so every process's copy equals the single-process tables. Call
        it on every process at the same point (no other collective in flight); a no-op in one
        process."""
        st = self.stages
        if not st.multiprocess:
            return
        for layout in st.plan.group_tables(st.group.name):
            table, r = self.tables[layout.spec.name], layout.rows_per_shard
            values, state = table.to_numpy()
            v = values.shape[0]

            def pad(a):  # [V, ...] -> [P*R, ...]: block p = rows [p*R, (p+1)*R)
                return np.concatenate([a, np.zeros((st.num_shards * r - v,) + a.shape[1:],
                                                   a.dtype)])

            full = st.gather_blocks({"table": pad(values), **{k: pad(a) for k, a in state.items()}})
            table.load(full.pop("table")[:v], {k: a[:v] for k, a in full.items()})
