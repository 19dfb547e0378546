"""Sharded lookup and sparse update, as separately callable per-device stages.

Inside ``shard_map`` over the plan's mesh axis, for each group of tables:

  1. ``route_ids``       (routing.py) policy, dedup to C keys, bucket by owner -> send_ids [P, Cb]
  2. ``exchange_ids``    All2All of the requested local rows
  3. ``gather_rows``     owner-side gather from the local shard -> [P, Cb, D]
  4. ``exchange_rows``   All2All of the rows back to the requesters
  5. ``unique_rows``     one row per distinct key -> unique_emb [C, D]
  6. ``pool_bags``       (pooling.py) per table: [b, D] pooled or [b, L, D] unpooled
  7. ``exchange_grads`` + ``apply_owner_update``: row gradients All2All to the owners, which
     sum duplicates and apply the sparse optimizer to the touched rows only.

Replicated groups skip 2-4 (local gather) and update by all-gathering (keys, row grads) so
every replica applies the same update. ``group_forward`` / ``group_update`` chain the stages;
``ShardedEmbeddings`` holds a plan, mesh and optimizer, builds and converts state, and jits
``lookup``. NestPipe (``jaxflow.nestpipe``) times and overlaps the stages individually.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings.optimizers import SparseOptimizer, sparse_apply, sum_duplicate_rows
from jaxflow.embeddings.pooling import PoolingBackend, pool_bags
from jaxflow.embeddings.routing import SENTINEL, Routing, check_ids_host, route_ids
from jaxflow.embeddings.spec import EmbeddingPlan, IdPolicy, TableSpec, plan_tables


class GroupContext(NamedTuple):
    """What the update needs from the forward of one group on one device."""

    routing: Routing
    recv_ids: jax.Array  # int32[P, Cb] rows other devices asked of this shard (-1 = none)


# ---- id validation: integer dtypes only, wide ids policed before any cast ----------------------

def check_id_dtype(name: str, ids) -> None:
    """TypeError unless ``ids`` has an integer dtype (bool and floats would read wrong rows)."""
    dtype = np.dtype(ids.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"table {name!r}: ids have dtype {dtype}; valid: an integer dtype "
                        "(int32, int64, uint32, ...; -1 is padding)")


def _is_wide(dtype) -> bool:
    """Integer dtypes whose values may not fit int32 (int64, uint32, uint64)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize > 4 or (dtype.itemsize == 4 and dtype.kind == "u")


def narrow_ids_host(name: str, ids, vocab_size: int, policy: str) -> np.ndarray:
    """Host ids of any integer dtype -> int32[...] with the id policy applied in the ids' own
    dtype first (so 2**32 + 5 is never row 5): "hash_modulo" maps ids >= 0 to ``id % vocab``
    (the same value the device path computes), "error" raises ValueError naming the first id
    outside [0, vocab); ids < -1 raise under either policy. -1 stays padding."""
    x = np.asarray(ids)
    check_id_dtype(name, x)
    if x.dtype.kind == "u":
        if policy == IdPolicy.ERROR.value and x.size and int(x.max()) >= vocab_size:
            bad = x[x >= vocab_size]
            raise ValueError(f"table {name!r}: id {int(bad.flat[0])} outside [0, {vocab_size}) "
                             f"({bad.size} bad ids) under id_policy={policy!r}; -1 is padding, "
                             "or use hash_modulo")
        return (x % np.uint64(vocab_size)).astype(np.int32)
    check_ids_host(name, x, vocab_size, policy)
    if policy == IdPolicy.HASH_MODULO.value:
        x = np.where(x >= 0, x % vocab_size, -1)
    return x.astype(np.int32)


def narrow_ids(ids: jax.Array, vocab_size: int, policy: str) -> jax.Array:
    """Traced twin of :func:`narrow_ids_host` for wide (64-bit, uint32) device ids: the policy
    in the wide dtype, then int32; ids that break it become -2, which the routing counts as bad
    (the lookup raises). int32 and narrower ids pass unchanged."""
    if not _is_wide(ids.dtype):
        return ids
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        if policy == IdPolicy.HASH_MODULO.value:
            return (ids % vocab_size).astype(jnp.int32)
        ok = ids < vocab_size
        return jnp.where(ok, jnp.where(ok, ids, 0).astype(jnp.int32), -2)
    pad = jnp.where(ids == -1, -1, -2)
    if policy == IdPolicy.HASH_MODULO.value:
        return jnp.where(ids >= 0, ids % vocab_size, pad).astype(jnp.int32)
    return jnp.where((ids >= 0) & (ids < vocab_size), ids, pad).astype(jnp.int32)


# ---- stages (per device, inside shard_map) ----------------------------------------------------

def exchange_ids(send_ids: jax.Array, axis: str) -> jax.Array:
    """All2All: send_ids[p] goes to shard p; returns recv[p] = what shard p asks of this one."""
    return jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)


def gather_rows(shard: jax.Array, recv_ids: jax.Array) -> jax.Array:
    """Owner-side retrieval: shard [S, D], recv int32[P, Cb] -> rows [P, Cb, D] (zeros for -1)."""
    valid = recv_ids >= 0
    rows = jnp.take(shard, jnp.where(valid, recv_ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, 0).astype(shard.dtype)


def exchange_rows(rows: jax.Array, axis: str) -> jax.Array:
    """All2All back: rows[p] (asked by shard p) return to p; [P, Cb, D] -> [P, Cb, D]."""
    return jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)


def unique_rows(reply: jax.Array, routing: Routing) -> jax.Array:
    """reply [P, Cb, D] -> unique_emb [C, D] in ``routing.unique_keys`` order (zeros unused)."""
    flat = reply.reshape(-1, reply.shape[-1])
    ok = routing.slot >= 0
    return jnp.where(ok[:, None], flat[jnp.where(ok, routing.slot, 0)], 0).astype(reply.dtype)


def grads_to_send(grad_unique: jax.Array, routing: Routing) -> jax.Array:
    """Row gradients [C, D] laid out along the ids' route: [P, Cb, D], slot ``[p, j]`` holds
    the gradient of the j-th key asked of owner p (zeros where empty); ``exchange_grads``
    without the All2All."""
    num_shards, cb = routing.send_ids.shape
    ok = routing.slot >= 0
    send = jnp.zeros((num_shards * cb, grad_unique.shape[-1]), grad_unique.dtype)
    send = send.at[jnp.where(ok, routing.slot, num_shards * cb)].set(grad_unique, mode="drop")
    return send.reshape(num_shards, cb, -1)


def exchange_grads(grad_unique: jax.Array, routing: Routing, axis: str) -> jax.Array:
    """Row gradients [C, D] to their owners along the ids' route: -> [P, Cb, D] aligned with
    the owner's ``recv_ids``."""
    return jax.lax.all_to_all(grads_to_send(grad_unique, routing), axis, 0, 0, tiled=True)


def apply_owner_update(optimizer: SparseOptimizer, shard: jax.Array, opt_shard: dict,
                       recv_ids: jax.Array, recv_grads: jax.Array, step: jax.Array):
    """Owner side: sum gradients of equal rows (from any requester), update those rows only."""
    rows, grads = sum_duplicate_rows(recv_ids.reshape(-1), recv_grads.reshape(-1, recv_grads.shape[-1]),
                                     shard.shape[0])
    return sparse_apply(optimizer, shard, opt_shard, rows, grads, step)


def replicated_update(optimizer: SparseOptimizer, table: jax.Array, opt_state: dict,
                      routing: Routing, grad_unique: jax.Array, axis: str, step: jax.Array):
    """Replicated group: all-gather (keys, row grads), sum duplicates, same update everywhere."""
    keys = jax.lax.all_gather(routing.unique_keys, axis, tiled=True)
    grads = jax.lax.all_gather(grad_unique, axis, tiled=True)
    keys = jnp.where(keys == SENTINEL, -1, keys)
    rows, summed = sum_duplicate_rows(keys, grads, table.shape[0])
    return sparse_apply(optimizer, table, opt_state, rows, summed, step)


def group_forward(plan: EmbeddingPlan, group: str, table: jax.Array, ids: dict[str, jax.Array],
                  capacity: int, bucket_capacity: int | None = None):
    """Stages 1-5 for one group on one device: (unique_emb [C, D], GroupContext).

    Raises TypeError (at trace time) for ids without an integer dtype."""
    narrowed = dict(ids)
    for layout in plan.group_tables(group):
        name = layout.spec.name
        check_id_dtype(name, ids[name])
        narrowed[name] = narrow_ids(ids[name], layout.spec.vocab_size, layout.spec.id_policy)
    routing = route_ids(plan, group, narrowed, capacity, bucket_capacity)
    if plan.group(group).replicated:
        ok = routing.unique_keys != SENTINEL
        emb = jnp.where(ok[:, None], table[jnp.where(ok, routing.unique_keys, 0)], 0)
        return emb.astype(table.dtype), GroupContext(routing, routing.send_ids)
    recv = exchange_ids(routing.send_ids, plan.axis)
    reply = exchange_rows(gather_rows(table, recv), plan.axis)
    return unique_rows(reply, routing), GroupContext(routing, recv)


def group_pool(plan: EmbeddingPlan, group: str, unique_emb: jax.Array, ctx: GroupContext,
               ids: dict[str, jax.Array], backend: str = PoolingBackend.XLA.value) -> dict:
    """Stage 6: ``{table: pooled [b, D] or unpooled [b, L, D]}`` for one group's tables."""
    out, start = {}, 0
    for layout in plan.group_tables(group):
        shape = ids[layout.spec.name].shape
        n = int(np.prod(shape))
        inv = ctx.routing.inverse[start:start + n].reshape(shape)
        out[layout.spec.name] = pool_bags(unique_emb, inv, layout.spec.pooling, backend)
        start += n
    return out


def group_update(plan: EmbeddingPlan, group: str, optimizer: SparseOptimizer, table: jax.Array,
                 opt_state: dict, ctx: GroupContext, grad_unique: jax.Array, step: jax.Array,
                 owner_update=apply_owner_update):
    """Stage 7 for one group on one device: (new table shard, new optimizer state shard);
    ``owner_update``: the owner side of a sharded group (:func:`apply_owner_update`'s signature;
    ``fused_step.owner_update_kernel`` on CPU)."""
    if plan.group(group).replicated:
        return replicated_update(optimizer, table, opt_state, ctx.routing, grad_unique, plan.axis, step)
    recv_grads = exchange_grads(grad_unique, ctx.routing, plan.axis)
    return owner_update(optimizer, table, opt_state, ctx.recv_ids, recv_grads, step)


def error_stats(ctxs: dict[str, GroupContext], axis: str) -> dict[str, jax.Array]:
    """Overflow and bad-id counts summed over devices (per device: call inside shard_map)."""
    overflow = sum(c.routing.overflow for c in ctxs.values())
    bad = sum(c.routing.bad_ids for c in ctxs.values())
    n_unique = sum(c.routing.n_unique for c in ctxs.values())
    return {"overflow": jax.lax.psum(overflow, axis), "bad_ids": jax.lax.psum(bad, axis),
            "max_unique": jax.lax.pmax(n_unique, axis)}


class CapacityOverflowError(RuntimeError):
    """More distinct ids in a step than the dedup (or bucket) capacity."""


def check_stats(stats: dict[str, Any], capacity: int | None = None) -> None:
    """Raises on overflow (CapacityOverflowError) or ids that break an "error" policy (ValueError)."""
    if int(stats["overflow"]) > 0:
        raise CapacityOverflowError(
            f"dedup capacity exceeded: up to {int(stats['max_unique'])} distinct ids on one device "
            f"(all groups) vs capacity {capacity}; raise `capacity` (ids are never dropped silently)")
    if int(stats["bad_ids"]) > 0:
        raise ValueError(f"{int(stats['bad_ids'])} ids outside their table's vocabulary under "
                         "id_policy='error' (-1 is padding; or set id_policy='hash_modulo')")


# ---- orchestration ----------------------------------------------------------------------------

class ShardedEmbeddings:
    """Tables placed on ``mesh`` axis ``axis`` with a sparse optimizer.

    State: ``{"tables": {group: [rows, D]}, "opt": {group: {...}}, "step": int32}``; sharded
    groups are split over ``axis``, replicated ones are on every device. ``capacity`` is the
    number of distinct keys one device may look up per group per step.
    """

    def __init__(self, specs: list[TableSpec], mesh: Mesh, optimizer: SparseOptimizer, *,
                 axis: str = "data", capacity: int = 1024, bucket_capacity: int | None = None,
                 pooling_backend: str = PoolingBackend.XLA.value, param_dtype=jnp.float32):
        if axis not in mesh.shape:
            raise ValueError(f"mesh has no axis {axis!r}; axes: {tuple(mesh.shape)}")
        self.mesh, self.axis, self.optimizer = mesh, axis, optimizer
        self.plan = plan_tables(specs, mesh.shape[axis], axis)
        self.capacity, self.bucket_capacity = int(capacity), bucket_capacity
        self.pooling_backend, self.param_dtype = pooling_backend, param_dtype
        self._lookup = None

    # -- state --
    def group_spec(self, group: str) -> P:
        """The PartitionSpec of a group's packed table: replicated, or rows split over ``axis``."""
        return P() if self.plan.group(group).replicated else P(self.axis)

    def state_specs(self) -> dict:
        """PartitionSpecs of the state ``init`` builds: ``{"tables", "opt", "step"}``."""
        opt = self.optimizer.init(1, 1)
        return {"tables": {g.name: self.group_spec(g.name) for g in self.plan.groups},
                "opt": {g.name: {k: self.group_spec(g.name) for k in opt} for g in self.plan.groups},
                "step": P()}

    def state_shardings(self) -> dict:
        """NamedShardings on ``mesh`` of the state ``init`` builds."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def init_dense(self, seed: int) -> dict[str, np.ndarray]:
        """Per-table initial values (uniform in +-1/sqrt(V), TorchRec's default), host numpy.

        Drawn on the host (numpy, seeded by ``(seed, table index)``): the packed state is built
        on the host and placed once, and no per-shape compile is needed.
        """
        out = {}
        for i, s in enumerate(self.plan.specs):
            bound = 1.0 / np.sqrt(s.vocab_size)
            rng = np.random.default_rng([seed, i])
            out[s.name] = rng.uniform(-bound, bound, (s.vocab_size, s.dim)).astype(np.float32)
        return out

    def init(self, seed: int) -> dict:
        """The initial sharded state ``{"tables", "opt", "step"}`` (``init_dense`` values, placed once)."""
        return self.from_dense(self.init_dense(seed))

    def from_dense(self, tables: dict[str, np.ndarray], opt: dict[str, dict] | None = None,
                   step: int = 0) -> dict:
        """Packs per-table arrays (and per-table optimizer state) into the sharded state."""
        shardings = self.state_shardings()
        state = {"tables": {}, "opt": {}, "step": jax.device_put(jnp.int32(step), shardings["step"])}
        for g in self.plan.groups:
            shape = g.global_shape(self.plan.num_shards)
            table = np.zeros(shape, np.float32)
            group_opt = {k: np.array(v) for k, v in self.optimizer.init(shape[0], g.dim).items()}
            for name in g.tables:
                rows = self.plan.global_rows(name)
                table[rows] = np.asarray(tables[name], np.float32)
                for k in group_opt:
                    if opt is not None:
                        group_opt[k][rows] = np.asarray(opt[name][k])
            state["tables"][g.name] = jax.device_put(table.astype(self.param_dtype),
                                                     shardings["tables"][g.name])
            state["opt"][g.name] = {k: jax.device_put(v, shardings["opt"][g.name][k])
                                    for k, v in group_opt.items()}
        return state

    def to_dense(self, state: dict) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        """(per-table arrays, per-table optimizer state) as host numpy: the placement undone."""
        tables, opt = {}, {}
        for g in self.plan.groups:
            arr = np.asarray(jax.device_get(state["tables"][g.name]))
            group_opt = {k: np.asarray(jax.device_get(v)) for k, v in state["opt"][g.name].items()}
            for name in g.tables:
                rows = self.plan.global_rows(name)
                tables[name] = arr[rows]
                opt[name] = {k: v[rows] for k, v in group_opt.items()}
        return tables, opt

    # -- per device (call inside shard_map over self.axis) --
    def local_forward(self, tables: dict, ids: dict[str, jax.Array]):
        """(unique_emb per group, GroupContext per group) for this device's ids."""
        embs, ctxs = {}, {}
        for g in self.plan.groups:
            group_ids = {n: ids[n] for n in g.tables}
            embs[g.name], ctxs[g.name] = group_forward(self.plan, g.name, tables[g.name], group_ids,
                                                       self.capacity, self.bucket_capacity)
        return embs, ctxs

    def local_pool(self, embs: dict, ctxs: dict, ids: dict[str, jax.Array]) -> dict:
        """Pooled embeddings ``{table: [B_local, D]}`` (``[B_local, L, D]`` unpooled) of this device's ids, from
        ``local_forward``'s outputs; call inside shard_map."""
        out = {}
        for g in self.plan.groups:
            out.update(group_pool(self.plan, g.name, embs[g.name], ctxs[g.name],
                                  {n: ids[n] for n in g.tables}, self.pooling_backend))
        return out

    def local_update(self, state: dict, ctxs: dict, grads: dict, owner_update=apply_owner_update) -> dict:
        """Applies row gradients (d loss / d unique_emb per group) with the sparse optimizer
        (``owner_update`` as in :func:`group_update`)."""
        step = state["step"] + 1
        tables, opt = {}, {}
        for g in self.plan.groups:
            tables[g.name], opt[g.name] = group_update(self.plan, g.name, self.optimizer,
                                                       state["tables"][g.name], state["opt"][g.name],
                                                       ctxs[g.name], grads[g.name], step, owner_update)
        return {"tables": tables, "opt": opt, "step": step}

    # -- global (jitted) --
    def ids_spec(self) -> P:
        """The PartitionSpec of the id batches: the batch split over ``axis``."""
        return P(self.axis)

    def lookup_fn(self):
        """Jitted ``(tables, ids) -> (outputs, stats)``; ids ``{name: int32[B, L]}`` split over
        the batch; outputs ``{name: [B, D] or [B, L, D]}`` split the same way."""

        def local(tables, ids):
            embs, ctxs = self.local_forward(tables, ids)
            return self.local_pool(embs, ctxs, ids), error_stats(ctxs, self.axis)

        specs = self.state_specs()["tables"]
        return jax.jit(jax.shard_map(local, mesh=self.mesh, in_specs=(specs, self.ids_spec()),
                                     out_specs=(self.ids_spec(), P()), check_vma=False))

    def prepare_ids(self, ids: dict) -> dict:
        """Checks every table's ids: an integer dtype (TypeError), and host (numpy) ids of a
        wide dtype narrowed to int32 by :func:`narrow_ids_host` (ValueError naming a bad id
        under "error"); device arrays are narrowed inside the lookup."""
        out = {}
        for spec in self.plan.specs:
            x = ids[spec.name]
            check_id_dtype(spec.name, x)
            if not isinstance(x, jax.Array) and _is_wide(x.dtype):
                x = narrow_ids_host(spec.name, x, spec.vocab_size, spec.id_policy)
            out[spec.name] = x
        return out

    def lookup(self, state: dict, ids: dict[str, jax.Array]) -> dict:
        """Pooled / unpooled embeddings; raises on overflow or bad ids (a host sync), TypeError
        for ids without an integer dtype."""
        if self._lookup is None:
            self._lookup = self.lookup_fn()
        ids = {n: (v if hasattr(v, "dtype") else np.asarray(v)) for n, v in ids.items()}
        out, stats = self._lookup(state["tables"], self.prepare_ids(ids))
        check_stats(stats, self.capacity)
        return out
