"""Dual buffers: the Prefetch buffer of batch t+1 was read from the host tables before batch
t's update landed, so its rows in K(B_t) ∩ K(B_t+1) are stale. ``patch_intersection_rows``
overwrites exactly those slots (rows and optimizer state) with the freshly updated Active
buffer — a device-to-device copy — which makes the prefetched batch equal to what a
synchronous re-read of the host tables would give, bit for bit.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxflow.embeddings.host import HostBatch


def intersection_slots(active_ids: np.ndarray, prefetch_ids: np.ndarray,
                       capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Slots of the shared keys: (src in Active, dst in Prefetch, count), padded to
    ``capacity`` with dst = capacity (an out-of-range slot the scatter drops)."""
    _, src, dst = np.intersect1d(active_ids, prefetch_ids, assume_unique=True, return_indices=True)
    n = src.size
    pad_src = np.zeros(capacity, np.int32)
    pad_dst = np.full(capacity, capacity, np.int32)
    pad_src[:n], pad_dst[:n] = src, dst
    return pad_src, pad_dst, n


@jax.jit
def _copy_slots(prefetch_rows, prefetch_opt, active_rows, active_opt, src, dst):
    rows = {n: prefetch_rows[n].at[dst[n]].set(active_rows[n][src[n]], mode="drop")
            for n in prefetch_rows}
    opt = {n: {k: v.at[dst[n]].set(active_opt[n][k][src[n]], mode="drop")
               for k, v in prefetch_opt[n].items()} for n in prefetch_opt}
    return rows, opt


def patch_intersection_rows(prefetch: HostBatch, active_ids: dict[str, np.ndarray],
                            active_rows: dict, active_opt: dict) -> tuple[HostBatch, int]:
    """Returns the patched Prefetch buffer and the number of rows copied."""
    src, dst, copied = {}, {}, 0
    for name, ids in prefetch.unique_ids.items():
        capacity = prefetch.rows[name].shape[0]
        src[name], dst[name], n = intersection_slots(active_ids[name], ids, capacity)
        copied += n
    rows, opt = _copy_slots(prefetch.rows, prefetch.opt, active_rows, active_opt, src, dst)
    return prefetch._replace(rows=rows, opt=opt), copied
