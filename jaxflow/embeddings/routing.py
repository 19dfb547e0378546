"""Key routing: id policy, fixed-capacity dedup, bucketing of unique keys by owning shard.

All functions are per-device (call them inside ``shard_map`` or on one device). Ids are
``int32[b, L]`` bags with ``-1`` padding. Nothing here drops an id silently: ids outside the
vocabulary under the "error" policy and more unique keys than the capacity are *counted* in
``Routing.bad_ids`` / ``Routing.overflow``; the orchestration (``lookup.check_stats``) raises on
them, as a traced function cannot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.embeddings.spec import EmbeddingPlan, IdPolicy, Placement, TableLayout

#: Sort key of padding / invalid ids: after every real key.
SENTINEL = jnp.iinfo(jnp.int32).max


class Routing(NamedTuple):
    """Dedup and routing of one group's ids on one device.

    unique_keys: int32[C] sorted group keys, SENTINEL-filled.
    inverse:     int32[N] slot of each id in ``unique_keys`` (-1 = padding), N = sum of b*L.
    send_ids:    int32[P, Cb] local rows asked of each owner (-1 = empty); replicated: [1, 0].
    slot:        int32[C] where each unique key's row comes back in the flattened [P*Cb] reply.
    n_unique:    int32 number of distinct valid keys (may exceed C: overflow).
    overflow:    int32 1 when keys were dropped by the dedup or bucket capacity, else 0.
    bad_ids:     int32 ids that break an "error" id policy.
    """

    unique_keys: jax.Array
    inverse: jax.Array
    send_ids: jax.Array
    slot: jax.Array
    n_unique: jax.Array
    overflow: jax.Array
    bad_ids: jax.Array


def apply_id_policy(ids: jax.Array, vocab_size: int, policy: str) -> tuple[jax.Array, jax.Array]:
    """(ids with -1 for padding/invalid, count of ids that break an "error" policy).

    "hash_modulo" maps every id >= 0 to ``id % vocab_size``; "error" keeps [0, vocab) and counts
    the rest (they become padding, never a wrong row, and the caller raises). Ids < -1 are
    bad under either policy.
    """
    ids = ids.astype(jnp.int32)
    if policy == IdPolicy.HASH_MODULO.value:
        bad = ids < -1
        out = jnp.where(ids >= 0, ids % vocab_size, -1)
    else:
        bad = (ids >= vocab_size) | (ids < -1)
        out = jnp.where((ids >= 0) & ~bad, ids, -1)
    return out, jnp.sum(bad).astype(jnp.int32)


def check_ids_host(name: str, ids: np.ndarray, vocab_size: int, policy: str) -> None:
    """Host-side check of the "error" policy with a message naming the bad id (ValueError)."""
    ids = np.asarray(ids)
    bad = (ids < -1) | ((ids >= vocab_size) & (policy == IdPolicy.ERROR.value))
    if bad.any():
        first = int(ids[bad].flat[0])
        raise ValueError(f"table {name!r}: id {first} outside [0, {vocab_size}) ({int(bad.sum())} "
                         f"bad ids) under id_policy={policy!r}; -1 is padding, or use hash_modulo")


def table_keys(layout: TableLayout, ids: jax.Array, shard_rows: int, num_shards: int):
    """Group keys of a table's (policy-applied) ids; SENTINEL for padding. Returns (keys, bad)."""
    spec = layout.spec
    ids, bad = apply_id_policy(ids, spec.vocab_size, spec.id_policy)
    if spec.placement == Placement.ROW_WISE.value:
        keys = (ids // layout.rows_per_shard) * shard_rows + layout.offset + ids % layout.rows_per_shard
    elif spec.placement == Placement.TABLE_WISE.value:
        keys = layout.owner * shard_rows + layout.offset + ids
    else:
        keys = layout.offset + ids
    return jnp.where(ids >= 0, keys, SENTINEL).astype(jnp.int32), bad


def dedup(keys: jax.Array, capacity: int):
    """Fixed-capacity unique of int32 keys (SENTINEL = padding), with one sort.

    Returns (unique_keys[C] sorted SENTINEL-filled, inverse[N] (-1 for padding), n_unique).
    When ``n_unique > capacity`` keys past the capacity get no slot (inverse -1): callers must
    treat that as an error, never use the result.
    """
    order = jnp.argsort(keys)
    srt = keys[order]
    real = srt != SENTINEL
    is_new = real & jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
    rank = jnp.cumsum(is_new.astype(jnp.int32)) - 1
    n_unique = jnp.sum(is_new).astype(jnp.int32)
    uniq = jnp.full((capacity,), SENTINEL, jnp.int32)
    uniq = uniq.at[jnp.where(is_new, rank, capacity)].set(srt, mode="drop")
    inv_sorted = jnp.where(real & (rank < capacity), rank, -1)
    inverse = jnp.zeros_like(inv_sorted).at[order].set(inv_sorted)
    return uniq, inverse, n_unique


def bucket_by_owner(unique_keys: jax.Array, shard_rows: int, num_shards: int, bucket_capacity: int):
    """Places sorted unique keys into per-owner send buckets.

    Returns (send_ids[P, Cb] local rows or -1, slot[C] = owner*Cb + position, bucket overflow).
    Keys are sorted, hence grouped by owner: a key's position is its rank after its owner's first.
    """
    valid = unique_keys != SENTINEL
    owner = jnp.where(valid, unique_keys // shard_rows, num_shards)
    local = unique_keys % shard_rows
    first = jnp.searchsorted(unique_keys, jnp.arange(num_shards, dtype=jnp.int32) * shard_rows)
    pos = jnp.arange(unique_keys.shape[0], dtype=jnp.int32) - first[jnp.minimum(owner, num_shards - 1)]
    fits = valid & (pos < bucket_capacity)
    send = jnp.full((num_shards, bucket_capacity), -1, jnp.int32)
    send = send.at[jnp.where(fits, owner, num_shards), pos].set(local, mode="drop")
    slot = jnp.where(fits, owner * bucket_capacity + pos, -1).astype(jnp.int32)
    return send, slot, jnp.sum(valid & ~fits).astype(jnp.int32)


def route_ids(plan: EmbeddingPlan, group: str, ids: dict[str, jax.Array], capacity: int,
              bucket_capacity: int | None = None) -> Routing:
    """Stage "key routing" of one group: policy, dedup, bucket by owner (per device).

    Args:
      ids: the group's tables' ids, ``{name: int32[b, L]}``.
      capacity: distinct keys per device per step (C); more is an overflow.
      bucket_capacity: keys sent to one owner (Cb, default C: cannot overflow).
    """
    g = plan.group(group)
    keys, bad = [], jnp.int32(0)
    for layout in plan.group_tables(group):
        k, b = table_keys(layout, ids[layout.spec.name], g.shard_rows, plan.num_shards)
        keys.append(k.reshape(-1))
        bad = bad + b
    keys = jnp.concatenate(keys)
    uniq, inverse, n_unique = dedup(keys, capacity)
    overflow = (n_unique > capacity).astype(jnp.int32)
    if g.replicated:
        send = jnp.zeros((1, 0), jnp.int32)
        slot = jnp.where(uniq != SENTINEL, jnp.arange(capacity, dtype=jnp.int32), -1)
    else:
        cb = capacity if bucket_capacity is None else bucket_capacity
        send, slot, dropped = bucket_by_owner(uniq, g.shard_rows, plan.num_shards, cb)
        overflow = jnp.maximum(overflow, (dropped > 0).astype(jnp.int32))
    return Routing(uniq, inverse, send, slot, n_unique, overflow, bad)
