"""NestPipe's device stages as pure per-device functions (call them inside ``jax.shard_map``).

``sharded.MeshStages`` jits and ``shard_map``s compositions of these; each one is also callable
alone (``tests/test_nestpipe_stages.py`` tests them one by one). Shapes, per device, with the
sizes of :class:`MeshLayout`: P shards, N micro-batches, U routed units per step (N when every
micro-batch is routed alone, 1 when the step or the whole window is routed at once), C distinct
keys per routed unit, Cb keys asked of one owner, Co rows one owner retrieves, D the embedding
dim, b this device's samples, B the global batch, L ids per bag.

  route         :func:`route_local`       dedup, bucket by owner, All2All of keys, owner dedup
  exchange      :func:`exchange_local`    owners gather the asked rows, All2All them back
  forward       :func:`sample_loss_sum`   pool, DLRM, binary cross-entropy summed / B
  fwd-backward  :func:`loss_and_grads`    its value and gradients (dense params, unique rows)
  accumulation  :func:`accumulate_grads`  micro-batch gradients summed in micro-batch order
  window        :func:`window_grads`      N micro-batches against one set of unique rows
                :func:`frozen_window_grads`  N micro-batches, each routed alone, their row
                                          All2Alls interleaved with compute (FWP)
  update        :func:`apply_update`      row gradients summed per owner slot, sparse optimizer
                                          (on CPU: the fused host kernel, in place), dense
                                          ``TrainState.apply_gradients`` on the AllReduce
  patch         :func:`patch_local`       the dual buffer's intersection copy

:func:`compute_local` and :func:`frozen_local` are the two compute programs (one routed unit /
the per-micro-batch frozen window): forward-backward, gradient All2All, update.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from jaxflow.embeddings.fused_step import owner_update_kernel
from jaxflow.embeddings.lookup import (
    GroupContext,
    exchange_grads,
    exchange_ids,
    exchange_rows,
    gather_rows,
    grads_to_send,
    group_pool,
    unique_rows,
)
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.embeddings.routing import SENTINEL, Routing, dedup, route_ids
from jaxflow.embeddings.spec import EmbeddingPlan
from jaxflow.train.state import TrainState
from pallas_kernels import dispatch

AXIS = "data"
#: apply(dense params, dense features f32[b, F], embeddings f32[b, T, D]) -> logits f32[b]
ApplyFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """The static sizes every device stage reads (``MeshStages.layout``)."""

    plan: EmbeddingPlan
    group: str  # the one sharded group
    tables: tuple[str, ...]  # the T tables, in the dense model's feature order
    num_shards: int  # P
    micro_batches: int  # N
    route_units: int  # U: N (every micro-batch routed alone) or 1
    capacity: int  # C
    bucket_capacity: int  # Cb
    owner_capacity: int  # Co
    dim: int  # D
    global_batch: int  # B
    axis: str = AXIS
    pooling_backend: str = "xla"  # embeddings.pooling.PoolingBackend value of the bag pooling
    # the cross-device sums (dense gradients, loss) as all-gather + a left-to-right sum in
    # device order instead of psum (``all_reduce_sum``; MeshStages sets it on the CPU)
    ordered_sums: bool = False
    # the owner update (row gradients summed per slot + sparse optimizer) by the fused host
    # kernel (``embeddings.fused_step.owner_update_kernel``) when the program is built for CPU
    # (``MeshStages`` sets it from its ``update_backend``)
    update_kernel: bool = False


def split_micro_batches(x: jax.Array, n: int) -> jax.Array:
    """[b, ...] -> [n, b/n, ...]: micro-batch i is samples ``i*b/n .. (i+1)*b/n - 1``."""
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def first(tree: Any) -> Any:
    """Every leaf's leading index 0 (this shard's slice of a [1, ...] block)."""
    return jax.tree.map(lambda x: x[0], tree)


# ---- stage 3: route ---------------------------------------------------------------------------

def route_local(lay: MeshLayout, ids: dict[str, jax.Array]):
    """Stage 3 on one device: its ids ``{table: int32[b, L]}`` -> (routing, owner_inverse,
    owner_ids, n_owner, stats).

    Each routed unit (U of them) is deduped to C keys and bucketed by owner (``route_ids``);
    the keys go to their owners by one All2All of int32[P, U, Cb]; each owner dedups the
    U*P*Cb keys it received to its Co distinct local rows. Returns, with a leading [1] (this
    shard's slice of the global [P, ...]): ``routing`` (a ``Routing``, with a [U] dim when
    U > 1), ``owner_inverse`` int32[1, U*P*Cb] (the owner slot of every received request, -1
    none), ``owner_ids`` int32[1, Co] (sorted, SENTINEL pad), ``n_owner`` int32[1]; ``stats``
    (overflow, bad_ids, max_unique) is reduced over the axis.
    """
    if lay.route_units == 1:
        routings = [route_ids(lay.plan, lay.group, ids, lay.capacity, lay.bucket_capacity)]
    else:
        parts = {k: split_micro_batches(v, lay.micro_batches) for k, v in ids.items()}
        routings = [route_ids(lay.plan, lay.group, {k: v[i] for k, v in parts.items()},
                              lay.capacity, lay.bucket_capacity)
                    for i in range(lay.micro_batches)]
    send = jnp.stack([r.send_ids for r in routings], axis=1)  # [P, U, Cb]
    recv = exchange_ids(send, lay.axis)  # recv[q] = what shard q asks of this one
    keys = jnp.where(recv >= 0, recv, SENTINEL).reshape(-1)
    owner_ids, owner_inverse, n_owner = dedup(keys, lay.owner_capacity)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *routings)
    if lay.route_units == 1:
        stacked = first(stacked)
    overflow = jnp.maximum(jnp.max(stacked.overflow),
                           (n_owner > lay.owner_capacity).astype(jnp.int32))
    stats = {"overflow": jax.lax.psum(overflow, lay.axis),
             "bad_ids": jax.lax.psum(jnp.sum(stacked.bad_ids), lay.axis),
             "max_unique": jax.lax.pmax(jnp.maximum(jnp.max(stacked.n_unique), n_owner), lay.axis)}
    return (jax.tree.map(lambda x: x[None], stacked), owner_inverse[None], owner_ids[None],
            n_owner[None], stats)


# ---- stage 5a: exchange -----------------------------------------------------------------------

def requested_rows(lay: MeshLayout, owner_rows: jax.Array, owner_inverse: jax.Array) -> jax.Array:
    """Owner side: the rows each requester asked for, from this owner's buffer.

    ``owner_rows`` [Co, D], ``owner_inverse`` int32[U*P*Cb] -> [P, U, Cb, D] (zeros where
    nothing was asked)."""
    return gather_rows(owner_rows, owner_inverse).reshape(
        lay.num_shards, lay.route_units, lay.bucket_capacity, lay.dim)


def exchange_local(lay: MeshLayout, owner_rows: jax.Array, owner_inverse: jax.Array,
                   routing: Routing) -> jax.Array:
    """Stage 5a for one routed unit (U = 1): owner buffer [Co, D], ``owner_inverse``
    int32[1, P*Cb] and this device's ``routing`` ([1, ...]) -> unique rows [1, C, D] (All2All
    of [P, Cb, D] back to the requesters)."""
    req = requested_rows(lay, owner_rows, owner_inverse[0])
    reply = exchange_rows(req[:, 0], lay.axis)
    return unique_rows(reply, first(routing))[None]


# ---- stage 5b: forward, backward, accumulation ------------------------------------------------

def sample_loss_sum(lay: MeshLayout, apply: ApplyFn, params: Any, unique_emb: jax.Array,
                    routing: Routing, ids: dict[str, jax.Array], dense: jax.Array,
                    label: jax.Array) -> jax.Array:
    """Forward: unique rows [C, D] pooled per table by ``routing`` (sum bags of
    ``ids {table: int32[b, L]}``, by ``lay.pooling_backend``), the DLRM on ``dense`` f32[b, F],
    binary cross-entropy with ``label`` f32[b], summed over the b samples / B (so the
    per-device values sum to the global-batch mean). Reads only ``routing.inverse`` and the ids' shapes."""
    pooled = group_pool(lay.plan, lay.group, unique_emb, GroupContext(routing, None), ids,
                        lay.pooling_backend)
    emb = jnp.stack([pooled[k] for k in lay.tables], axis=1)
    loss = optax.sigmoid_binary_cross_entropy(apply(params, dense, emb), label)
    return jnp.sum(loss) / lay.global_batch


def loss_and_grads(lay: MeshLayout, apply: ApplyFn, params: Any, unique_emb: jax.Array,
                   routing: Routing, ids: dict[str, jax.Array], dense: jax.Array,
                   label: jax.Array):
    """Forward-backward of :func:`sample_loss_sum`: ``(loss, (g_params, g_emb [C, D]))``."""

    def objective(params, unique_emb):
        return sample_loss_sum(lay, apply, params, unique_emb, routing, ids, dense, label)

    return jax.value_and_grad(objective, argnums=(0, 1))(params, unique_emb)


def accumulate_grads(micro: Sequence[Any]) -> Any:
    """Per-micro-batch pytrees (e.g. ``(loss, g_params, g_emb)``) summed leaf by leaf in
    micro-batch order, ``((m0 + m1) + m2) + ...``: the one accumulation of every window
    schedule (the order fixes the f32 result)."""
    total = micro[0]
    for m in micro[1:]:
        total = jax.tree.map(jnp.add, total, m)
    return total


def micro_batch_routing(lay: MeshLayout, routing: Routing, ids: dict[str, jax.Array],
                        i: int) -> Routing:
    """Micro-batch i's view of a window's routing: the same unique keys and slots,
    ``inverse`` cut to the micro-batch's samples (int32[sum over tables of b/N * L]).
    ``ids``: the window's ``{table: int32[b, L]}`` (only their shapes are read)."""
    parts, start = [], 0
    for layout in lay.plan.group_tables(lay.group):
        shape = ids[layout.spec.name].shape
        size = int(np.prod(shape))
        inv = routing.inverse[start:start + size].reshape(shape)
        parts.append(split_micro_batches(inv, lay.micro_batches)[i].reshape(-1))
        start += size
    return routing._replace(inverse=jnp.concatenate(parts))


def window_grads(lay: MeshLayout, apply: ApplyFn, params: Any, unique_emb: jax.Array,
                 routing: Routing, ids: dict[str, jax.Array], dense: jax.Array,
                 label: jax.Array):
    """One routed unit's ``(loss, g_params, g_emb [C, D])``: with N = 1 the plain
    forward-backward; with N > 1 (the whole-window schedule) the N micro-batches read the same
    unique rows and params and their gradients are accumulated (:func:`accumulate_grads`).
    Shapes as :func:`sample_loss_sum` (b = the whole window's samples on this device)."""
    n = lay.micro_batches
    if n == 1:
        loss, (g_params, g_emb) = loss_and_grads(lay, apply, params, unique_emb, routing, ids,
                                                 dense, label)
        return loss, g_params, g_emb
    mb_ids = {k: split_micro_batches(v, n) for k, v in ids.items()}
    mb_dense, mb_label = split_micro_batches(dense, n), split_micro_batches(label, n)
    micro = []
    for i in range(n):
        l_i, (gp_i, ge_i) = loss_and_grads(lay, apply, params, unique_emb,
                                           micro_batch_routing(lay, routing, ids, i),
                                           {k: v[i] for k, v in mb_ids.items()}, mb_dense[i],
                                           mb_label[i])
        micro.append((l_i, gp_i, ge_i))
    return accumulate_grads(micro)


def frozen_window_grads(lay: MeshLayout, apply: ApplyFn, params: Any, requested: jax.Array,
                        routings: Sequence[Routing], ids: dict[str, jax.Array], dense: jax.Array,
                        label: jax.Array, *, batched: bool = False):
    """The frozen window (FWP), every micro-batch routed alone: ``(loss, g_params,
    recv_grads [P, N, Cb, D])``, the gradients in the owner's ``owner_inverse`` layout.

    ``requested`` [P, N, Cb, D]: this owner's rows asked per micro-batch
    (:func:`requested_rows`); ``routings``: the N micro-batches' routings. Micro-batch i+1's row
    All2All is issued before micro-batch i's forward-backward, and i's gradient All2All right
    after it, so async collectives can overlap compute. ``batched``: one All2All for all rows
    and one for all gradients instead (the same values, bit for bit).
    """
    n, axis = lay.micro_batches, lay.axis
    mb_ids = {k: split_micro_batches(v, n) for k, v in ids.items()}
    mb_dense, mb_label = split_micro_batches(dense, n), split_micro_batches(label, n)
    if batched:
        everything = exchange_rows(requested, axis)
        replies = {i: everything[:, i] for i in range(n)}
    else:
        replies = {0: exchange_rows(requested[:, 0], axis)}
    micro, sends = [], []
    for i in range(n):
        if i + 1 < n and not batched:  # issued before micro-batch i's compute
            replies[i + 1] = exchange_rows(requested[:, i + 1], axis)
        emb = unique_rows(replies.pop(i), routings[i])
        l_i, (gp_i, ge_i) = loss_and_grads(lay, apply, params, emb, routings[i],
                                           {k: v[i] for k, v in mb_ids.items()}, mb_dense[i],
                                           mb_label[i])
        micro.append((l_i, gp_i))
        send = grads_to_send(ge_i, routings[i])  # [P, Cb, D]; feeds only the update
        sends.append(send if batched else jax.lax.all_to_all(send, axis, 0, 0, tiled=True))
    loss, g_params = accumulate_grads(micro)
    recv_grads = jnp.stack(sends, axis=1)  # [P, N, Cb, D]
    if batched:
        recv_grads = jax.lax.all_to_all(recv_grads, axis, 0, 0, tiled=True)
    return loss, g_params, recv_grads


# ---- stage 5b: update -------------------------------------------------------------------------

def owner_slot_grads(lay: MeshLayout, owner_inverse: jax.Array, recv_grads: jax.Array) -> jax.Array:
    """Owner side: the received row gradients (``recv_grads`` [P, U, Cb, D] or [P, Cb, D],
    aligned with ``owner_inverse`` int32[U*P*Cb]) summed per buffer slot -> [Co, D]."""
    co, d = lay.owner_capacity, lay.dim
    ok = owner_inverse >= 0
    return jnp.zeros((co, d), recv_grads.dtype).at[jnp.where(ok, owner_inverse, co)].add(
        recv_grads.reshape(-1, d), mode="drop")


def apply_update(lay: MeshLayout, optimizer: SparseOptimizer, dense_state: TrainState,
                 owner_rows: jax.Array, owner_opt: dict, owner_inverse: jax.Array, g_params: Any,
                 recv_grads: jax.Array, loss: jax.Array):
    """The update: row gradients summed per owner slot (:func:`owner_slot_grads`), the sparse
    optimizer on the owner buffer [Co, D] (and ``owner_opt`` {name: [Co, ...]}) at step
    ``dense_state.step + 1`` (with ``lay.update_kernel`` on a CPU program: both by the fused
    host kernel, in place); the dense gradient AllReduced (:func:`all_reduce_sum`) and
    applied by ``dense_state.apply_gradients`` (the same on every device).

    Returns ``(dense_state, owner_rows, owner_opt, loss summed over the axis)``.
    """
    step = dense_state.step + 1
    if lay.update_kernel and dispatch.backend_platform() == "cpu":
        # every slot's gradients summed in request order, then the row update, in place (within
        # f32 rounding of XLA's: it contracts the update into FMAs); slots no request names are
        # not touched (XLA's update adds a zero gradient to them)
        new_rows, new_opt = owner_update_kernel(optimizer, owner_rows, owner_opt, owner_inverse,
                                                recv_grads, step)
    else:
        g_rows = owner_slot_grads(lay, owner_inverse, recv_grads)
        new_rows, new_opt = optimizer.apply(owner_rows, g_rows, owner_opt, step)
    g_params, loss = all_reduce_sum(lay, (g_params, loss))
    dense_state = dense_state.apply_gradients(g_params)
    return dense_state, new_rows, new_opt, loss


def all_reduce_sum(lay: MeshLayout, tree: Any) -> Any:
    """Every leaf summed over the mesh axis (the same on every device): ``psum``, or with
    ``lay.ordered_sums`` one all-gather of all leaves (raveled together) and
    ``x_0 + x_1 + ... + x_{P-1}`` in device order.

    ``psum`` on the CPU adds in an order that depends on how the devices are spread over
    processes (in one process XLA's in-process AllReduce, across processes gloo's ring), so
    1 x 8 and 2 x 4 devices differ in the last bits. The ordered form is the same arithmetic
    however the devices are spread (the all-gather only moves data): a 2-process CPU run equals
    the 1-process one bit for bit. It moves P times the gradient bytes: meant for the small
    dense models of CPU runs (``MeshStages`` sets it on the CPU only).
    """
    if not lay.ordered_sums:
        return jax.lax.psum(tree, lay.axis)
    flat, unravel = ravel_pytree(tree)
    parts = jax.lax.all_gather(flat, lay.axis)  # [P, n]: one collective for every leaf
    out = parts[0]
    for i in range(1, lay.num_shards):
        out = out + parts[i]
    return unravel(out)


# ---- the compute programs ---------------------------------------------------------------------

def compute_local(lay: MeshLayout, apply: ApplyFn, optimizer: SparseOptimizer,
                  dense_state: TrainState, owner_rows, owner_opt, owner_inverse, routing,
                  unique_emb, ids, dense, label):
    """Stage 5b for one routed unit (sync, or the whole window with N > 1): forward-backward
    (:func:`window_grads`) on the exchanged ``unique_emb`` [1, C, D], row gradients All2All'd
    to their owners, :func:`apply_update`. Inputs as :meth:`sharded.MeshStages.compute` on
    one device (``owner_inverse``, ``routing`` with their leading [1])."""
    r = first(routing)
    loss, g_params, g_emb = window_grads(lay, apply, dense_state.params, unique_emb[0], r, ids,
                                         dense, label)
    recv_grads = exchange_grads(g_emb, r, lay.axis)  # [P, Cb, D] aligned with owner requests
    return apply_update(lay, optimizer, dense_state, owner_rows, owner_opt, owner_inverse[0],
                        g_params, recv_grads, loss)


def frozen_local(lay: MeshLayout, apply: ApplyFn, optimizer: SparseOptimizer, batched: bool,
                 dense_state: TrainState, owner_rows, owner_opt, owner_inverse, routing, ids,
                 dense, label):
    """Stage 5a + 5b of the frozen window (N routed units): the owner buffer and dense params
    stay frozen for the window; :func:`frozen_window_grads` then :func:`apply_update`."""
    req = requested_rows(lay, owner_rows, owner_inverse[0])  # [P, N, Cb, D]
    routings = [jax.tree.map(lambda x, i=i: x[0, i], routing) for i in range(lay.micro_batches)]
    loss, g_params, recv_grads = frozen_window_grads(lay, apply, dense_state.params, req, routings,
                                                     ids, dense, label, batched=batched)
    return apply_update(lay, optimizer, dense_state, owner_rows, owner_opt, owner_inverse[0],
                        g_params, recv_grads, loss)


def patch_local(prefetch_rows: jax.Array, prefetch_opt: dict, active_rows: jax.Array,
                active_opt: dict, src: jax.Array, dst: jax.Array):
    """Dual-buffer patch on one owner: ``prefetch_rows[dst] = active_rows[src]`` (rows [Co, D]
    and every optimizer-state array), ``src`` / ``dst`` int32[1, Co]; dst = Co is dropped."""
    src, dst = src[0], dst[0]
    rows = prefetch_rows.at[dst].set(active_rows[src], mode="drop")
    opt = {k: v.at[dst].set(active_opt[k][src], mode="drop") for k, v in prefetch_opt.items()}
    return rows, opt
