"""The device side of NestPipe on a mesh: key routing, row exchange and compute via All2All.

Data-parallel DLRM on a 1-D mesh of P devices; the host-resident tables are split row-wise over
the same P shards (``embeddings.spec.plan_tables``: one group per embedding dim, owner of id i of
table a is ``i // ceil(V_a / P)``). Per step, inside ``jax.shard_map``:

  route     (stage 3)  each device dedups its batch shard's keys and buckets them by owner
                       (``embeddings.routing.route_ids``), All2All of the keys
                       (``embeddings.lookup.exchange_ids``); each owner dedups what it received
                       again (``routing.dedup``) -> the distinct local rows it must retrieve.
  retrieve  (stage 4)  host: one thread per shard reads those rows (+ optimizer state) from the
                       host tables into that shard's fixed-capacity *owner buffer* (``host_io``).
  exchange  (stage 5a) owners gather the requested rows from their buffer and All2All them back
                       (``exchange_rows``) -> each device's unique rows.
  compute   (stage 5b) pool, DLRM forward/backward on the device's samples, dense grads psum'd
                       (AllReduce), row grads All2All'd to the owners (``exchange_grads``), summed
                       per owner-buffer slot, sparse optimizer on the owner buffer, dense Adam.

The frozen window (``micro_batches = N > 1``, the paper's FWP: ``per_micro_batch``) routes every
micro-batch separately (per micro-batch dedup, which key-centric clustering makes smaller) and
fuses exchange and compute into one program: the owner buffer and dense params are frozen for
the window, so micro-batch i+1's row All2All is issued before micro-batch i's dense compute and
depends on nothing it produces; i's gradient All2All likewise feeds only the final update. XLA's
async collectives (GPU/TPU) can overlap them; the CPU backend runs collectives synchronously, so
there the schedule runs but nothing overlaps. ``window`` is NOT frozen-window pipelining: the
window is routed and exchanged once as a whole, the same collectives as sync, and only the
backward is split into N micro-batches (sync plus gradient accumulation; the ``sync_accum``
pipeline).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxflow.embeddings.lookup import (GroupContext, check_stats, exchange_grads, exchange_ids,
                                       exchange_rows, gather_rows, grads_to_send, group_pool,
                                       unique_rows)
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.embeddings.routing import SENTINEL, Routing, dedup, route_ids
from jaxflow.embeddings.spec import EmbeddingPlan, Placement, TableSpec, plan_tables

AXIS = "data"
#: the frozen window's All2All schedule: ``per_micro_batch`` (the paper's frozen-window
#: pipelining: every micro-batch routed and deduped alone, micro-batch i+1's rows issued before
#: i's compute, so async collectives can overlap it; the ``fwp`` pipelines), ``batched`` (the
#: same per-micro-batch routing, one All2All for the window's rows and one for its gradients:
#: the same values, bit for bit, with 2 instead of 2N rendezvous and nothing to overlap; a
#: diagnostic), ``window`` (the window routed and deduped once, as a whole: one key All2All, one
#: row exchange, the N micro-batches' gradients summed per unique row, one gradient All2All --
#: the collectives of sync, nothing to overlap, clustering has no effect: sync plus gradient
#: accumulation, the ``sync_accum`` pipeline, not FWP)
FROZEN_EXCHANGES = ("per_micro_batch", "batched", "window")


def check_frozen_exchange(frozen_exchange: str) -> str:
    """``frozen_exchange`` if it names a schedule of ``FROZEN_EXCHANGES``, else ValueError."""
    if frozen_exchange not in FROZEN_EXCHANGES:
        raise ValueError(f"frozen_exchange={frozen_exchange!r}; valid: "
                         f"{', '.join(FROZEN_EXCHANGES)}")
    return frozen_exchange


class Routed(NamedTuple):
    """Stage 3's result. Device arrays carry a leading shard dim ([P, ...], split over the mesh);
    ``owner_ids`` / ``owner_counts`` are the host copy the retrieval threads read."""

    routing: Routing  # per device (frozen window: an extra leading [N] micro-batch dim)
    owner_inverse: jax.Array  # int32[P, N*P*Cb] owner-buffer slot of every received request
    owner_ids: np.ndarray  # int32[P, Co] each owner's distinct local rows, sorted (SENTINEL pad)
    owner_counts: np.ndarray  # int[P] distinct rows each owner retrieves (0 = an idle shard)
    stats: dict  # overflow / bad_ids / max_unique, summed over devices


class OwnerBuffer(NamedTuple):
    """Stage 4's result: each shard's retrieved rows, [P*Co, D] split over the mesh."""

    rows: jax.Array
    opt: dict  # {name: [P*Co, ...]} per-row optimizer state
    owner_ids: np.ndarray  # int32[P, Co] (host) which local rows the slots hold
    owner_counts: np.ndarray  # int[P]


class MeshStages:
    """Compiled stage programs for one plan, mesh and capacity set.

    Capacities (fixed shapes; exceeding one raises CapacityOverflowError, never drops):
      capacity: distinct keys per device per (micro-)batch, all tables of the group (C).
      bucket_capacity: keys one device asks of one owner (Cb).
      owner_capacity: distinct rows one owner retrieves per batch (Co).
    ``frozen_exchange``: the frozen window's All2All schedule (``FROZEN_EXCHANGES``).
    """

    def __init__(self, specs: list[TableSpec], mesh: Mesh, optimizer: SparseOptimizer,
                 apply: Callable, dense_tx: optax.GradientTransformation, *, batch_size: int,
                 multi_hot: int, micro_batches: int = 1, capacity: int = 0,
                 bucket_capacity: int = 0, owner_capacity: int = 0,
                 frozen_exchange: str = "per_micro_batch"):
        self.frozen_exchange = frozen_exchange = check_frozen_exchange(frozen_exchange)
        if tuple(mesh.axis_names) != (AXIS,):
            raise ValueError(f"mesh axes {mesh.axis_names}; NestPipe wants one axis {AXIS!r}")
        self.mesh, self.specs, self.optimizer = mesh, list(specs), optimizer
        self.num_shards = p = mesh.shape[AXIS]
        self.plan: EmbeddingPlan = plan_tables(specs, p, AXIS)
        if len(self.plan.groups) != 1 or self.plan.groups[0].replicated:
            raise ValueError("NestPipe's mesh stages want one sharded group (all tables row_wise, "
                             f"one dim); got groups {[g.name for g in self.plan.groups]}")
        bad = [s.name for s in specs if s.placement != Placement.ROW_WISE.value]
        if bad:
            raise ValueError(f"tables {bad} are not row_wise (host shards are row blocks)")
        self.group = self.plan.groups[0]
        if batch_size % (p * micro_batches):
            raise ValueError(f"batch_size={batch_size} not divisible by {p} devices x "
                             f"{micro_batches} micro-batches")
        self.n = micro_batches
        # routed units per window: N micro-batches, or the whole window at once ("window")
        self.route_units = 1 if frozen_exchange == "window" else micro_batches
        b_mb = batch_size // p // self.route_units
        ids_per_mb = b_mb * multi_hot * len(specs)
        self.capacity = min(capacity or ids_per_mb, ids_per_mb)
        self.bucket_capacity = min(bucket_capacity or self.capacity, self.capacity)
        arrivals = self.route_units * p * self.bucket_capacity
        self.owner_capacity = min(owner_capacity or arrivals, arrivals, self.group.shard_rows)
        self.dim = self.group.dim
        self.global_batch = batch_size
        self._sharded = NamedSharding(mesh, P(AXIS))
        self._build(apply, dense_tx)

    # ---- host <-> device helpers -----------------------------------------------------------
    def shard(self, x):
        return jax.device_put(x, self._sharded)

    def from_shards(self, parts: list[np.ndarray]) -> jax.Array:
        """One array per shard (same shape) -> their concatenation, split over the mesh; each
        part goes straight to its device (no host concat)."""
        devices = list(self.mesh.devices.flat)
        shape = (len(parts) * parts[0].shape[0],) + parts[0].shape[1:]
        arrays = [jax.device_put(x, d) for x, d in zip(parts, devices)]
        return jax.make_array_from_single_device_arrays(shape, self._sharded, arrays)

    # ---- the programs ----------------------------------------------------------------------
    def _build(self, apply, dense_tx):
        plan, g, axis, n = self.plan, self.group.name, AXIS, self.n
        c, cb, co, d = self.capacity, self.bucket_capacity, self.owner_capacity, self.dim
        names = [s.name for s in self.specs]
        optimizer, p_shards, big_b = self.optimizer, self.num_shards, self.global_batch

        def split_mb(x):  # [b, ...] -> [N, b/N, ...]
            return x.reshape((n, x.shape[0] // n) + x.shape[1:])

        units = self.route_units

        def local_route(ids):
            if units == 1:
                routings = [route_ids(plan, g, ids, c, cb)]
            else:
                parts = {k: split_mb(v) for k, v in ids.items()}
                routings = [route_ids(plan, g, {k: v[i] for k, v in parts.items()}, c, cb)
                            for i in range(n)]
            send = jnp.stack([r.send_ids for r in routings], axis=1)  # [P, N, Cb]
            recv = exchange_ids(send, axis)  # recv[q] = what shard q asks of this one
            keys = jnp.where(recv >= 0, recv, SENTINEL).reshape(-1)
            owner_ids, owner_inverse, n_owner = dedup(keys, co)
            stacked = jax.tree.map(lambda *x: jnp.stack(x), *routings)
            if units == 1:
                stacked = jax.tree.map(lambda x: x[0], stacked)
            overflow = jnp.maximum(jnp.max(stacked.overflow), (n_owner > co).astype(jnp.int32))
            stats = {"overflow": jax.lax.psum(overflow, axis),
                     "bad_ids": jax.lax.psum(jnp.sum(stacked.bad_ids), axis),
                     "max_unique": jax.lax.pmax(jnp.maximum(jnp.max(stacked.n_unique), n_owner), axis)}
            add = lambda x: x[None]
            return (jax.tree.map(add, stacked), owner_inverse[None], owner_ids[None],
                    n_owner[None], stats)

        sh, rep = P(axis), P()
        self._route = jax.jit(jax.shard_map(local_route, mesh=self.mesh, in_specs=(sh,),
                                            out_specs=(sh, sh, sh, sh, rep), check_vma=False))

        def requested_rows(owner_rows, owner_inverse):  # -> [P, units, Cb, D]
            return gather_rows(owner_rows, owner_inverse).reshape(p_shards, units, cb, d)

        def local_exchange(owner_rows, owner_inverse, routing):
            req = requested_rows(owner_rows, owner_inverse[0])
            reply = exchange_rows(req[:, 0], axis)
            return unique_rows(reply, jax.tree.map(lambda x: x[0], routing))[None]

        self._exchange = jax.jit(jax.shard_map(local_exchange, mesh=self.mesh,
                                               in_specs=(sh, sh, sh), out_specs=sh,
                                               check_vma=False))

        def sample_loss_sum(params, unique_emb, routing, ids, dense, label):
            # group_pool reads only ctx.routing (and the ids' shapes)
            pooled = group_pool(plan, g, unique_emb, GroupContext(routing, None), ids)
            emb = jnp.stack([pooled[k] for k in names], axis=1)
            loss = optax.sigmoid_binary_cross_entropy(apply(params, dense, emb), label)
            return jnp.sum(loss) / big_b

        grad_fn = jax.value_and_grad(sample_loss_sum, argnums=(0, 1))

        def update(dense_state, owner_rows, owner_opt, owner_inverse, g_params, recv_grads, loss):
            """Owner side: sum the row gradients per buffer slot, sparse optimizer; dense Adam on
            the AllReduced gradient (the same on every device)."""
            step = dense_state["step"] + 1
            ok = owner_inverse >= 0
            g_rows = jnp.zeros((co, d), recv_grads.dtype).at[jnp.where(ok, owner_inverse, co)].add(
                recv_grads.reshape(-1, d), mode="drop")
            new_rows, new_opt = optimizer.apply(owner_rows, g_rows, owner_opt, step)
            g_params = jax.lax.psum(g_params, axis)
            params = dense_state["params"]
            updates, dopt = dense_tx.update(g_params, dense_state["opt"], params)
            dense_state = {"params": optax.apply_updates(params, updates), "opt": dopt, "step": step}
            return dense_state, new_rows, new_opt, jax.lax.psum(loss, axis)

        def local_compute(dense_state, owner_rows, owner_opt, owner_inverse, routing, unique_emb,
                          ids, dense, label):
            r = jax.tree.map(lambda x: x[0], routing)
            loss, (g_params, g_emb) = grad_fn(dense_state["params"], unique_emb[0], r, ids, dense,
                                              label)
            recv_grads = exchange_grads(g_emb, r, axis)  # [P, Cb, D] aligned with owner requests
            return update(dense_state, owner_rows, owner_opt, owner_inverse[0], g_params,
                          recv_grads, loss)

        def micro_batch_routing(r, ids, i):
            """Micro-batch i's view of the window's routing ``r``: the same unique keys and
            slots, ``inverse`` cut to the micro-batch's samples (group_pool reads only it)."""
            parts, start = [], 0
            for layout in plan.group_tables(g):
                shape = ids[layout.spec.name].shape
                size = int(np.prod(shape))
                inv = r.inverse[start:start + size].reshape(shape)
                parts.append(split_mb(inv)[i].reshape(-1))
                start += size
            return r._replace(inverse=jnp.concatenate(parts))

        def local_window(dense_state, owner_rows, owner_opt, owner_inverse, routing, unique_emb,
                         ids, dense, label):
            """The window routed as a whole: the N micro-batches read the same frozen unique
            rows and dense params, their gradients are summed (in micro-batch order) per unique
            row and dense leaf, one gradient All2All, one update."""
            r, params, emb = jax.tree.map(lambda x: x[0], routing), dense_state["params"], unique_emb[0]
            mb_ids = {k: split_mb(v) for k, v in ids.items()}
            mb_dense, mb_label = split_mb(dense), split_mb(label)
            loss, g_params, g_emb = 0.0, None, None
            for i in range(n):
                l_i, (gp_i, ge_i) = grad_fn(params, emb, micro_batch_routing(r, ids, i),
                                            {k: v[i] for k, v in mb_ids.items()}, mb_dense[i],
                                            mb_label[i])
                loss = loss + l_i
                g_params = gp_i if g_params is None else jax.tree.map(jnp.add, g_params, gp_i)
                g_emb = ge_i if g_emb is None else g_emb + ge_i
            recv_grads = exchange_grads(g_emb, r, axis)
            return update(dense_state, owner_rows, owner_opt, owner_inverse[0], g_params,
                          recv_grads, loss)

        batched = self.frozen_exchange == "batched"

        def local_frozen(dense_state, owner_rows, owner_opt, owner_inverse, routing, ids, dense,
                         label):
            params = dense_state["params"]
            req = requested_rows(owner_rows, owner_inverse[0])  # [P, N, Cb, D], frozen window
            rs = [jax.tree.map(lambda x, i=i: x[0, i], routing) for i in range(n)]
            mb_ids = {k: split_mb(v) for k, v in ids.items()}
            mb_dense, mb_label = split_mb(dense), split_mb(label)
            if batched:  # one All2All for the window's rows: the same values, fewer rendezvous
                everything = exchange_rows(req, axis)
                replies = {i: everything[:, i] for i in range(n)}
            else:
                replies = {0: exchange_rows(req[:, 0], axis)}
            loss, g_params, sends = 0.0, None, []
            for i in range(n):
                if i + 1 < n and not batched:  # issued before micro-batch i's compute
                    replies[i + 1] = exchange_rows(req[:, i + 1], axis)
                emb = unique_rows(replies.pop(i), rs[i])
                l_i, (gp_i, ge_i) = grad_fn(params, emb, rs[i], {k: v[i] for k, v in mb_ids.items()},
                                            mb_dense[i], mb_label[i])
                loss = loss + l_i
                g_params = gp_i if g_params is None else jax.tree.map(jnp.add, g_params, gp_i)
                send = grads_to_send(ge_i, rs[i])  # [P, Cb, D]; feeds only the update
                sends.append(send if batched else jax.lax.all_to_all(send, axis, 0, 0, tiled=True))
            recv_grads = jnp.stack(sends, axis=1)  # [P, N, Cb, D], owner_inverse's layout
            if batched:
                recv_grads = jax.lax.all_to_all(recv_grads, axis, 0, 0, tiled=True)
            return update(dense_state, owner_rows, owner_opt, owner_inverse[0], g_params,
                          recv_grads, loss)

        out = (rep, sh, sh, rep)
        if n == 1 or units == 1:  # one routed unit: the exchange is a program of its own
            self._compute = jax.jit(jax.shard_map(local_compute if n == 1 else local_window,
                                                  mesh=self.mesh,
                                                  in_specs=(rep, sh, sh, sh, sh, sh, sh, sh, sh),
                                                  out_specs=out, check_vma=False))
            self._frozen = None
        else:
            self._compute = None
            self._frozen = jax.jit(jax.shard_map(local_frozen, mesh=self.mesh,
                                                 in_specs=(rep, sh, sh, sh, sh, sh, sh, sh),
                                                 out_specs=out, check_vma=False))

        def local_patch(prefetch_rows, prefetch_opt, active_rows, active_opt, src, dst):
            src, dst = src[0], dst[0]
            rows = prefetch_rows.at[dst].set(active_rows[src], mode="drop")
            opt = {k: v.at[dst].set(active_opt[k][src], mode="drop") for k, v in prefetch_opt.items()}
            return rows, opt

        self._patch = jax.jit(jax.shard_map(local_patch, mesh=self.mesh,
                                            in_specs=(sh, sh, sh, sh, sh, sh), out_specs=(sh, sh),
                                            check_vma=False))

    # ---- stage calls -----------------------------------------------------------------------
    def route(self, ids: dict[str, jax.Array]) -> Routed:
        """Stage 3 (device, All2All of keys); fetches each owner's distinct rows to the host and
        raises on overflow or bad ids."""
        routing, owner_inverse, owner_ids, counts, stats = self._route(ids)
        owner_ids, counts, stats = jax.device_get((owner_ids, counts, stats))
        check_stats(stats, max(self.capacity, self.owner_capacity))
        return Routed(routing, owner_inverse, np.asarray(owner_ids), np.asarray(counts), stats)

    @property
    def separate_exchange(self) -> bool:
        """True when the row exchange is a program of its own (``exchange`` before
        ``compute``): one routed unit per step (no window, or the ``window`` schedule)."""
        return self.route_units == 1

    def exchange(self, buf: OwnerBuffer, routed: Routed) -> jax.Array:
        """Stage 5a (device, All2All of rows back): unique rows per device, [P, C, D]."""
        return self._exchange(buf.rows, routed.owner_inverse, routed.routing)

    def compute(self, dense_state, buf: OwnerBuffer, routed: Routed, unique_emb, ids, dense, label):
        """Stage 5b: ``(dense_state, owner rows, owner opt, loss)``."""
        if self.separate_exchange:
            return self._compute(dense_state, buf.rows, buf.opt, routed.owner_inverse,
                                 routed.routing, unique_emb, ids, dense, label)
        return self._frozen(dense_state, buf.rows, buf.opt, routed.owner_inverse, routed.routing,
                            ids, dense, label)

    def patch(self, prefetch: OwnerBuffer, rows, opt, src: np.ndarray, dst: np.ndarray):
        return self._patch(prefetch.rows, prefetch.opt, rows, opt, self.shard(src), self.shard(dst))
