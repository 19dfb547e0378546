"""Dual buffers: the Prefetch owner buffers of batch t+1 were read from the host tables before
batch t's update landed, so each owner's rows in K(B_t) ∩ K(B_t+1) are stale.
``patch_intersection_rows`` overwrites exactly those slots (rows and optimizer state), shard by
shard, with the freshly updated Active buffer — a device-local copy inside ``shard_map`` (a key
has one owner, so both buffers of a key live on the same device) — which makes the prefetched
batch equal to what a synchronous re-read of the host tables would give, bit for bit.
"""

from __future__ import annotations

import numpy as np

from jaxflow.nestpipe.sharded import MeshStages, OwnerBuffer


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


def patch_intersection_rows(stages: MeshStages, prefetch: OwnerBuffer, active: OwnerBuffer,
                            active_rows, active_opt) -> tuple[OwnerBuffer, int]:
    """Returns the patched Prefetch buffer and the number of rows copied (all shards).

    ``active_rows`` / ``active_opt`` are the Active buffer after batch t's update.
    """
    co, src, dst, copied = stages.owner_capacity, [], [], 0
    for p in range(stages.num_shards):
        a = active.owner_ids[p][:int(active.owner_counts[p])]
        b = prefetch.owner_ids[p][:int(prefetch.owner_counts[p])]
        s, d, n = intersection_slots(a, b, co)
        src.append(s)
        dst.append(d)
        copied += n
    rows, opt = stages.patch(prefetch, active_rows, active_opt, np.stack(src), np.stack(dst))
    return prefetch._replace(rows=rows, opt=opt), copied
