"""The device side of NestPipe on a mesh: key routing, row exchange and compute via All2All.

``MeshStages`` jits one ``shard_map`` program per stage; each composes the pure per-device
functions of ``device_stages`` (where the math is, and is tested stage by stage).

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
                       per owner-buffer slot, sparse optimizer on the owner buffer, dense Adam
                       (``TrainState.apply_gradients``).

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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings.fused_step import kernel_unsupported
from jaxflow.embeddings.lookup import check_stats
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.embeddings.routing import Routing
from jaxflow.embeddings.spec import EmbeddingPlan, Placement, TableSpec, plan_tables
from jaxflow.nestpipe.device_stages import (
    AXIS,
    ApplyFn,
    MeshLayout,
    compute_local,
    exchange_local,
    frozen_local,
    patch_local,
    route_local,
)
from jaxflow.train.state import TrainState

__all__ = ["AXIS", "FROZEN_EXCHANGES", "MeshStages", "OwnerBuffer", "Routed", "UPDATE_BACKENDS",
           "check_frozen_exchange", "owner_update_backend"]

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


#: the owner update's implementations (``MeshStages(update_backend=...)``): ``auto`` the fused
#: host kernel where :func:`owner_update_backend` finds it runs (a CPU program; SGD / row-wise
#: Adagrad), else XLA; ``xla`` always the XLA update (the accelerator path, and the reference);
#: ``host_kernel`` the kernel or a ValueError saying why not
UPDATE_BACKENDS = ("auto", "xla", "host_kernel")


def owner_update_backend(mesh: Mesh, optimizer: SparseOptimizer, backend: str = "auto") -> str:
    """The owner update ``MeshStages(update_backend=backend)`` builds: "host_kernel" (the
    fused host kernel, ``embeddings.fused_step.owner_update_kernel``: each owner's received row
    gradients summed per buffer slot and SGD / row-wise Adagrad applied in place) or "xla".
    ValueError (one line) for an unknown backend, or "host_kernel" where it cannot run."""
    if backend not in UPDATE_BACKENDS:
        raise ValueError(f"update_backend={backend!r}; valid: {', '.join(UPDATE_BACKENDS)}")
    if backend == "xla":
        return "xla"
    reason = kernel_unsupported(mesh, "float32", optimizer)  # owner buffers are float32
    if reason is None:
        return "host_kernel"
    if backend == "host_kernel":
        raise ValueError(f"update_backend='host_kernel' unavailable: {reason}; valid: 'xla' or 'auto'")
    return "xla"


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
    ``apply``: the dense model, ``apply(params, dense f32[b, F], emb f32[b, T, D]) -> logits
    f32[b]``; its optimizer is the dense state's (``TrainState.tx``, passed to ``compute``).
    ``layout`` (a ``device_stages.MeshLayout``) holds the sizes every stage program reads.
    ``pooling_backend``: the bag pooling of the compute programs (an
    ``embeddings.pooling.PoolingBackend`` value; "auto" = the Pallas kernel on GPU / TPU).
    ``update_backend``: the owner update (``UPDATE_BACKENDS``; :attr:`update_backend` is
    the one built: "host_kernel" or "xla"; with "host_kernel" a program traced for GPU / TPU
    still updates in XLA).
    ``multiprocess``: None = whether the mesh spans several processes; True in one process
    runs the multi-process path there (per-shard placement, replicated routing outputs, the
    launch order, ordered sums on CPU): the same values, for tests.
    """

    def __init__(self, specs: list[TableSpec], mesh: Mesh, optimizer: SparseOptimizer,
                 apply: ApplyFn, *, batch_size: int,
                 multi_hot: int, micro_batches: int = 1, capacity: int = 0,
                 bucket_capacity: int = 0, owner_capacity: int = 0,
                 frozen_exchange: str = "per_micro_batch", pooling_backend: str = "xla",
                 update_backend: str = "auto", multiprocess: bool | None = None):
        self.frozen_exchange = frozen_exchange = check_frozen_exchange(frozen_exchange)
        if tuple(mesh.axis_names) != (AXIS,):
            raise ValueError(f"mesh axes {mesh.axis_names}; NestPipe wants one axis {AXIS!r}")
        self.mesh, self.specs, self.optimizer = mesh, list(specs), optimizer
        self.update_backend = owner_update_backend(mesh, optimizer, update_backend)
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
        me, local = jax.process_index(), list(range(p))
        if jax.process_count() > 1:  # (compile-only meshes of abstract chips: one process)
            local = [q for q, dev in enumerate(mesh.devices.flat) if dev.process_index == me]
        self._local = local
        #: the mesh spans several processes (multi-controller): see ``pipelines.LaunchOrder``
        self.multiprocess = len(local) < p if multiprocess is None else bool(multiprocess)
        self.layout = MeshLayout(self.plan, self.group.name, tuple(s.name for s in self.specs),
                                 p, micro_batches, self.route_units, self.capacity,
                                 self.bucket_capacity, self.owner_capacity, self.dim, batch_size,
                                 pooling_backend=pooling_backend,
                                 ordered_sums=self._on_cpu(mesh),
                                 update_kernel=self.update_backend == "host_kernel")
        self._build(apply)

    @staticmethod
    def _on_cpu(mesh: Mesh) -> bool:
        return next(iter(mesh.devices.flat)).platform == "cpu"

    # ---- host <-> device helpers -----------------------------------------------------------
    def shard(self, x):
        """``x`` (a pytree of arrays, the same on every process) split over the mesh's axis.
        Across processes each process places only its own devices' slices (no collective:
        ``jax.device_put`` of host data onto devices of several processes all-gathers it to
        check that every process passed the same value)."""
        if not self.multiprocess:
            return jax.device_put(x, self._sharded)
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            np.shape(a), self._sharded, lambda idx, a=np.asarray(a): a[idx]), x)

    @property
    def local_shards(self) -> list[int]:
        """The shard positions (0..P-1) whose devices belong to this process: all of them in one
        process; with several processes each one reads, places and writes back only these."""
        return self._local

    def from_shards(self, parts: dict[int, np.ndarray]) -> jax.Array:
        """``{shard position: array}`` for every shard of :attr:`local_shards` (same shapes) ->
        the global concatenation over all P shards, split over the mesh; each part goes
        straight to its device (no host concat)."""
        devices = list(self.mesh.devices.flat)
        first = next(iter(parts.values()))
        shape = (self.num_shards * first.shape[0],) + first.shape[1:]
        arrays = [jax.device_put(parts[p], devices[p]) for p in self._local]
        return jax.make_array_from_single_device_arrays(shape, self._sharded, arrays)

    def local_blocks(self, x: jax.Array) -> dict[int, np.ndarray]:
        """A global array split over the mesh (leading dim P*k) -> ``{shard position: its k
        rows}`` for this process's shards (host copies; no collective)."""
        k = x.shape[0] // self.num_shards
        return {s.index[0].start // k if s.index[0].start is not None else 0: np.asarray(s.data)
                for s in x.addressable_shards}

    def gather_blocks(self, blocks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Across processes: ``{name: host array [P*k, ...]}`` whose row block p (k rows) is
        authoritative on the process owning shard p -> the same arrays on every process with
        every block from its owner (one all-gather program; call it at the same point of the
        launch sequence on every process)."""
        glob = {k: jax.make_array_from_callback(v.shape, self._sharded, lambda idx, v=v: v[idx])
                for k, v in blocks.items()}
        return {k: np.asarray(v) for k, v in self._replicate(glob).items()}

    # ---- the programs ----------------------------------------------------------------------
    def _build(self, apply):
        """Jits the ``shard_map`` programs: each composes the pure stages of ``device_stages``."""
        lay, sh, rep = self.layout, P(AXIS), P()

        def program(fn, in_specs, out_specs, **jit_kw):
            return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False), **jit_kw)

        # across processes every process needs every owner's distinct rows and counts (the
        # dual-buffer patch and the per-owner figures): the route program returns them
        # replicated (an all-gather inside it, no second program); one process fetches them
        split, replicated = self._sharded, NamedSharding(self.mesh, P())
        route_kw = ({"out_shardings": (split, split, replicated, replicated, replicated)}
                    if self.multiprocess else {})
        self._route = program(functools.partial(route_local, lay), (sh,), (sh, sh, sh, sh, rep),
                              **route_kw)
        self._replicate = jax.jit(lambda x: x, out_shardings=replicated)
        self._exchange = program(functools.partial(exchange_local, lay), (sh, sh, sh), sh)
        out = (rep, sh, sh, rep)  # dense state, owner rows, owner opt, loss
        if self.separate_exchange:  # one routed unit: the exchange is a program of its own
            self._compute = program(functools.partial(compute_local, lay, apply, self.optimizer),
                                    (rep,) + (sh,) * 8, out)
            self._frozen = None
        else:
            self._compute = None
            batched = self.frozen_exchange == "batched"
            self._frozen = program(functools.partial(frozen_local, lay, apply, self.optimizer,
                                                     batched), (rep,) + (sh,) * 7, out)
        self._patch = program(patch_local, (sh,) * 6, (sh, sh))

    def abstract_calls(self, dense_state: TrainState, *, multi_hot: int,
                       num_dense: int) -> dict[str, tuple]:
        """Every stage program with abstract arguments (``jax.ShapeDtypeStruct`` with the
        shardings the run gives them; nothing allocated), for compile-only: ``{"route": (fn,
        args), "exchange" and "compute" (one routed unit) or "frozen" (the frozen window),
        "patch"}``. ``dense_state``: an abstract replicated ``TrainState``
        (``TrainState.abstract``); the batch is ``ids {table: int32[B, multi_hot]}``, ``dense``
        f32[B, num_dense], ``label`` f32[B], split over the mesh, the owner buffers [P*Co, D]
        (and the optimizer state of Co rows per shard) split the same way."""
        S, p, co, d, b = (jax.ShapeDtypeStruct, self.num_shards, self.owner_capacity, self.dim,
                          self.global_batch)

        def split(x):
            return S(x.shape, x.dtype, sharding=self._sharded)

        ids = {s.name: S((b, multi_hot), jnp.int32, sharding=self._sharded)
               for s in self.specs}
        dense = S((b, num_dense), jnp.float32, sharding=self._sharded)
        label = S((b,), jnp.float32, sharding=self._sharded)
        routing, owner_inverse = jax.tree.map(split, jax.eval_shape(self._route, ids)[:2])
        rows = S((p * co, d), jnp.float32, sharding=self._sharded)
        opt = {k: S((p * co,) + v.shape[1:], v.dtype, sharding=self._sharded)
               for k, v in jax.eval_shape(lambda: self.optimizer.init(co, d)).items()}
        calls = {"route": (self._route, (ids,))}
        if self.separate_exchange:
            calls["exchange"] = (self._exchange, (rows, owner_inverse, routing))
            unique = split(jax.eval_shape(self._exchange, rows, owner_inverse, routing))
            calls["compute"] = (self._compute, (dense_state, rows, opt, owner_inverse, routing,
                                                unique, ids, dense, label))
        else:
            calls["frozen"] = (self._frozen, (dense_state, rows, opt, owner_inverse, routing,
                                              ids, dense, label))
        slots = S((p, co), jnp.int32, sharding=self._sharded)
        calls["patch"] = (self._patch, (rows, opt, rows, opt, slots, slots))
        return calls

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

    def compute(self, dense_state: TrainState, buf: OwnerBuffer, routed: Routed, unique_emb, ids,
                dense, label):
        """Stage 5b (and 5a in the frozen window): ``(dense_state, owner rows, owner opt,
        loss)``; ``dense_state`` the dense model's ``TrainState`` (replicated), ``unique_emb``
        [P, C, D] from :meth:`exchange` (None in the frozen window), ``ids`` ``{table:
        int32[B, L]}``, ``dense`` f32[B, F], ``label`` f32[B] split over the mesh."""
        if self.separate_exchange:
            return self._compute(dense_state, buf.rows, buf.opt, routed.owner_inverse,
                                 routed.routing, unique_emb, ids, dense, label)
        return self._frozen(dense_state, buf.rows, buf.opt, routed.owner_inverse, routed.routing,
                            ids, dense, label)

    def patch(self, prefetch: OwnerBuffer, rows, opt, src: np.ndarray, dst: np.ndarray):
        """The dual-buffer patch (``device_stages.patch_local`` on every shard): rows and opt
        of ``prefetch`` at ``dst`` [P, Co] from the updated Active ``rows`` / ``opt`` at ``src``."""
        return self._patch(prefetch.rows, prefetch.opt, rows, opt, self.shard(src), self.shard(dst))
