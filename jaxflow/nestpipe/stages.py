"""NestPipe's five stages over host-resident tables and a data-parallel DLRM on a mesh.

  1. ``load_batch``      data prefetch: the synthetic generator writes one batch in host memory
                         (``cluster_order`` permutes samples within each device's shard);
  2. ``to_device``       host-to-device copy of dense features, labels and ids, split over the
                         mesh's batch axis;
  3. route               (``sharded.MeshStages.route``) dedup, bucket by owner, All2All of keys,
                         owner-side dedup;
  4. retrieve            (``host_io.HostShards.retrieve``) one host thread per shard reads its
                         rows and optimizer state into that shard's owner buffer;
  5. exchange + compute  (``MeshStages.exchange`` / ``.compute``) All2All of rows back, forward /
                         backward, AllReduce of dense grads, All2All of row grads to owners,
                         sparse + dense update; then ``HostShards.write_back``.

Every pipeline in ``pipelines.py`` calls exactly these functions; they differ only in when.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from jaxflow.embeddings.host import HostTable
from jaxflow.nestpipe.clustering import cluster_groups

__all__ = ["DeviceBatch", "load_batch", "reorder_batch", "cluster_order", "to_device",
           "clone_tables"]


class DeviceBatch(NamedTuple):
    """One batch on the mesh, every leaf split over the batch axis."""

    ids: dict[str, jax.Array]  # int32[B, L] per table (-1 = padding)
    dense: jax.Array  # f32[B, F]
    label: jax.Array  # f32[B]


def load_batch(gen, step: int, batch_size: int) -> dict:
    """Stage 1: batch ``step`` in host memory."""
    return gen.batch(step, batch_size)


def reorder_batch(batch: dict, order: np.ndarray) -> dict:
    """The batch with its samples permuted by ``order`` (key-centric clustering)."""
    return {"dense": batch["dense"][order], "label": batch["label"][order],
            "sparse": {k: v[order] for k, v in batch["sparse"].items()}}


def cluster_order(sparse: dict[str, np.ndarray], num_shards: int, micro_batches: int,
                  method: str = "vote") -> np.ndarray:
    """Key-centric clustering inside each device's shard of the batch (samples never change
    device, so data parallelism is untouched): int[B] permutation, all shards in one pass."""
    return cluster_groups(sparse, num_shards, micro_batches, method)


def to_device(batch: dict, put) -> DeviceBatch:
    """Stage 2: host-to-device copy; ``put`` places an array split over the batch axis."""
    ids = {k: np.asarray(v, np.int32) for k, v in batch["sparse"].items()}
    return DeviceBatch(put(ids), put(batch["dense"]), put(batch["label"]))


def clone_tables(tables: dict[str, HostTable]) -> dict[str, HostTable]:
    """In-memory copies (values and optimizer state) so pipelines start from the same tables."""
    out = {}
    for name, t in tables.items():
        values, state = t.to_numpy()
        c = HostTable(t.spec, t.optimizer, values)
        c.load(values, state)
        out[name] = c
    return out
