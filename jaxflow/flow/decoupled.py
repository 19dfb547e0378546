"""Decoupled training: encoder and backbone on disjoint sub-meshes, joined by the pool.

Producer thread (encoder sub-mesh): for each step's samples, packs their images, runs the
encoder forward (keeping its vjp), and puts each sample's image-token embeddings into the
``EmbeddingPool`` keyed by sample id (blocking when full: backpressure).
Consumer (backbone sub-mesh, caller's thread): takes the step's samples from the pool, packs
them into balanced rows, runs the backbone forward/backward and its optimizer step, and hands
d loss / d embeddings back; the encoder applies its vjp with those cotangents and its own
optimizer step.

Strict (``run_ahead=0``, default): the producer encodes step k only after the encoder update
of step k-1, so each update equals the monolithic one for the same samples. ``run_ahead=d``
lets the encoder run up to d steps ahead; the gradients it then receives were computed from
embeddings of parameters ``staleness`` updates old (reported per step).

Across processes (multi-controller JAX, both sub-meshes spanning every process, see
``jaxflow.flow.meshes.split_meshes``) every process must start the same programs in the
same order, and the CPU / GPU runtimes start one collective program at a time in launch order:
two threads launching in a timing-dependent order could deadlock. So there producer and
consumer run on the caller's thread in one fixed order, fwd 0..d, then per block step k:
backbone k, encoder update k, fwd k + d + 1 (staleness exactly min(k, d); JAX's asynchronous
dispatch still overlaps the two sides' programs). The hand-offs are gathers on each side's own
devices (``jaxflow.distributed.to_host``).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.config import ConfigError
from jaxflow.distributed import put, to_host
from jaxflow.flow.batching import (
    PackingConfig,
    encoder_patches,
    layout_rows,
    loss_tokens,
    pooled_image_base,
    zeros_like_arrays,
)
from jaxflow.flow.packing import CostModel
from jaxflow.flow.pool import EmbeddingPool, PoolClosed
from jaxflow.flow.steps import Sides, make_backbone_step, make_encoder_fns
from jaxflow.flow.vlm import bucket
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


def row_sharding(mesh, axis: str = "data") -> NamedSharding:
    """Leading (row) dimension over ``axis`` when the mesh has it, else replicated."""
    return NamedSharding(mesh, PartitionSpec(axis if axis in mesh.shape else None))


def put_rows(arrays: dict, mesh, axis: str = "data") -> dict:
    """Host arrays -> device arrays sharded over their leading (row) dimension."""
    sharding = row_sharding(mesh, axis)
    return {k: put(v, sharding) for k, v in arrays.items()}


def put_replicated(x, mesh):
    return put(x, NamedSharding(mesh, PartitionSpec()))


def abstract_rows(arrays: dict, mesh, axis: str = "data") -> dict:
    """What :func:`put_rows` would place, as ``jax.ShapeDtypeStruct`` (compile-only)."""
    sharding = row_sharding(mesh, axis)
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=sharding)
            for k, v in arrays.items()}


def abstract_replicated(shape: tuple[int, ...], dtype, mesh) -> jax.ShapeDtypeStruct:
    """What :func:`put_replicated` would place for a ``shape`` / ``dtype`` host array."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def pool_entries(samples: Sequence, patches, flat: np.ndarray) -> list[np.ndarray]:
    """Each sample's image-token embeddings [n_i, d] cut from the encoder's flat output."""
    out, first = [], 0
    for s in samples:
        slots = patches.image_slots[first:first + len(s.images)]
        first += len(s.images)
        out.append(np.concatenate([flat[a:a + n] for a, n in zip(slots, s.image_tokens)])
                   if s.images else np.zeros((0, flat.shape[1]), flat.dtype))
    return out


def embedding_buffer(embs: Sequence[np.ndarray], d: int, granularity: int) -> np.ndarray:
    """Pool entries concatenated in sample order, zero-padded to a bucketed row count."""
    buffer = np.concatenate(embs) if embs else np.zeros((0, d), np.float32)
    n = buffer.shape[0]
    return np.pad(buffer, ((0, bucket(max(n, 1), granularity) - n), (0, 0)))


def scatter_cotangent(samples: Sequence, patches, d_buffer: np.ndarray,
                      flat_shape: tuple[int, int]) -> np.ndarray:
    """d loss / d buffer (sample order) -> d loss / d encoder flat output (patch-row order)."""
    _, offsets = pooled_image_base(samples)
    cot = np.zeros(flat_shape, np.float32)
    first = 0
    for j, s in enumerate(samples):
        within = offsets[j]
        for slot, n in zip(patches.image_slots[first:first + len(s.images)], s.image_tokens):
            cot[slot:slot + n] = d_buffer[within:within + n]
            within += n
        first += len(s.images)
    return cot


#: Rows of the backbone's image-embedding buffer are bucketed to multiples of this (few shapes).
BUFFER_GRANULARITY = 256


class DecoupledTrainer:
    """``run(steps)`` trains on ``[(step, samples), ...]`` and returns per-step metrics."""

    def __init__(self, sides: Sides, enc_state: TrainState, bb_state: TrainState, *,
                 packing: PackingConfig, cost: CostModel, run_ahead: int = 0,
                 pool_capacity: int = 256, buffer_granularity: int = BUFFER_GRANULARITY):
        if run_ahead < 0:
            raise ValueError(f"flow.run_ahead={run_ahead}; must be >= 0")
        self.sides, self.enc_state, self.bb_state = sides, enc_state, bb_state
        self.packing, self.cost, self.run_ahead = packing, cost, run_ahead
        self.pool = EmbeddingPool(pool_capacity)
        self.buffer_granularity = buffer_granularity
        self.enc_mesh, self.bb_mesh = sides.enc.mesh, sides.bb.mesh
        self.enc_rows = self.enc_mesh.shape.get("data", 1)
        self.bb_rows = self.bb_mesh.shape.get("data", 1)
        self._encode, self._enc_update = make_encoder_fns(sides)
        self._bb_step = make_backbone_step(sides)
        self._cond = threading.Condition()
        self.version = 0  # encoder updates applied
        self._inflight: dict[int, tuple] = {}
        self._error: BaseException | None = None
        self.timers = {"encoder_fwd_s": 0.0, "backbone_s": 0.0, "encoder_bwd_s": 0.0}

    def _layout(self, samples):
        base, _ = pooled_image_base(samples)
        return layout_rows(samples, "packed", base, packing=self.packing, cost=self.cost,
                           row_multiple=self.bb_rows)

    def warm(self, steps: Sequence[tuple[int, list]]) -> int:
        """Compiles encoder forward/update and backbone step for every shape these steps
        will use (zeros, throwaway state copies). Returns the number of shapes."""
        seen = set()
        for _, samples in steps:
            patches = encoder_patches(samples, self.sides.vit, self.enc_rows)
            layout = self._layout(samples)
            n_img = sum(s.n_image_tokens for s in samples)
            buf_rows = bucket(max(n_img, 1), self.buffer_granularity)
            sig = (patches.patches.shape, layout.rows["tokens"].shape, buf_rows)
            if sig in seen:
                continue
            seen.add(sig)
            enc, bb = self.sides.place(self.enc_state, self.bb_state)
            flat, vjp_fn = self._encode(
                enc.params, put_rows(zeros_like_arrays(patches.arrays()), self.enc_mesh))
            flat = np.zeros(flat.shape, np.float32)
            jax.block_until_ready(self._enc_update(enc, vjp_fn,
                                                   put_replicated(flat, self.enc_mesh)))
            buf = np.zeros((buf_rows, self.sides.lm.d_model), np.float32)
            jax.block_until_ready(self._bb_step(
                bb, put_replicated(buf, self.bb_mesh),
                put_rows(zeros_like_arrays(layout.rows), self.bb_mesh),
                put_replicated(np.float32(1.0), self.bb_mesh)))
        return len(seen)

    # -- producer ----------------------------------------------------------------------

    def _encode_step(self, step: int, samples: list, params, version: int) -> None:
        """Encoder forward of one step's samples; their embeddings go into the pool."""
        t0 = time.perf_counter()
        patches = encoder_patches(samples, self.sides.vit, self.enc_rows)
        flat, vjp_fn = self._encode(params, put_rows(patches.arrays(), self.enc_mesh))
        flat = to_host(flat)  # a gather on the encoder's devices, on every process
        self.timers["encoder_fwd_s"] += time.perf_counter() - t0
        with self._cond:
            self._inflight[step] = (vjp_fn, patches, version, flat.shape)
        for s, emb in zip(samples, pool_entries(samples, patches, flat)):
            self.pool.put(s.uid, (emb, version))

    def _produce(self, steps: Sequence[tuple[int, list]], first_index: int) -> None:
        try:
            for k, (step, samples) in enumerate(steps):
                with self._cond:
                    self._cond.wait_for(
                        lambda: self.version >= first_index + k - self.run_ahead
                        or self._error is not None)
                    if self._error is not None:
                        return
                    params, version = self.enc_state.params, self.version
                self._encode_step(step, samples, params, version)
        except PoolClosed:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            with self._cond:
                self._error = e
                self._cond.notify_all()
            self.pool.close()

    # -- consumer ----------------------------------------------------------------------

    def _consume(self, bb_state: TrainState, step: int, samples: list) -> tuple[TrainState, dict]:
        """One training step of the backbone (its state passed along) and of the encoder (its
        state ``self.enc_state``, shared with the producer under ``self._cond``)."""
        got = self.pool.take_many([s.uid for s in samples])
        t0 = time.perf_counter()
        embs = [got[s.uid][0] for s in samples]
        versions = {got[s.uid][1] for s in samples}
        buffer = embedding_buffer(embs, self.sides.lm.d_model, self.buffer_granularity)
        layout = self._layout(samples)
        denom = loss_tokens(samples)
        bb_state, d_buffer, metrics = self._bb_step(
            bb_state, put_replicated(buffer, self.bb_mesh),
            put_rows(layout.rows, self.bb_mesh), put_replicated(denom, self.bb_mesh))
        d_buffer = to_host(d_buffer)
        t1 = time.perf_counter()
        self.timers["backbone_s"] += t1 - t0

        with self._cond:
            vjp_fn, patches, version, flat_shape = self._inflight.pop(step)
        cot = scatter_cotangent(samples, patches, d_buffer, flat_shape)
        enc_state, enc_norm = self._enc_update(self.enc_state, vjp_fn,
                                               put_replicated(cot, self.enc_mesh))
        jax.block_until_ready(enc_state.step)
        self.timers["encoder_bwd_s"] += time.perf_counter() - t1
        with self._cond:
            staleness = self.version - version
            self.enc_state = enc_state
            self.version += 1
            self._cond.notify_all()
        metrics = dict(metrics, enc_grad_norm=enc_norm)
        return bb_state, {"metrics": metrics, "layout": layout, "staleness": staleness,
                          "mixed_versions": len(versions) > 1, "rows": layout.rows}

    def run(self, steps: Sequence[tuple[int, list]]) -> list[dict]:
        """Trains on every (step, samples); the producer thread lives for this call only.

        The consumer is :func:`jaxflow.train.loop.run_steps` over the backbone state; each
        row is one step's result (metrics, layout, staleness)."""
        steps = list(steps)
        if jax.process_count() > 1:
            return self._run_inline(steps)
        producer = threading.Thread(target=self._produce, args=(steps, self.version),
                                    name="flow-encoder", daemon=True)
        producer.start()

        def step_fn(bb_state, k):
            try:
                return self._consume(bb_state, *steps[k])
            except PoolClosed:
                raise RuntimeError("the encoder producer failed") from self._error

        finished = False
        try:
            result = run_steps(step_fn, self.bb_state, steps=len(steps),
                               summarize=last_row)
            self.bb_state, finished = result.state, True
        finally:
            if not finished:  # the consumer failed: release the producer
                with self._cond:
                    self._error = self._error or RuntimeError("consumer stopped")
                    self._cond.notify_all()
                self.pool.close()
            producer.join()
        if self._error is not None:
            raise RuntimeError("the encoder producer failed") from self._error
        return result.rows

    def _run_inline(self, steps: list[tuple[int, list]]) -> list[dict]:
        """:meth:`run` on the caller's thread in the fixed cross-process order (module doc).

        Raises:
          ConfigError: the pool cannot hold ``run_ahead + 1`` steps' samples (one thread cannot
            wait for a consumer)."""
        need = (self.run_ahead + 1) * max((len(s) for _, s in steps), default=0)
        if self.pool.capacity < need:
            raise ConfigError(f"flow.pool_capacity={self.pool.capacity} across processes with "
                             f"run_ahead={self.run_ahead}: the pool must hold {self.run_ahead + 1} "
                             f"steps' samples; valid: >= {need}")

        def encode(j: int) -> None:
            self._encode_step(*steps[j], self.enc_state.params, self.version)

        for j in range(min(self.run_ahead + 1, len(steps))):
            encode(j)

        def step_fn(bb_state, k):
            out = self._consume(bb_state, *steps[k])
            if k + self.run_ahead + 1 < len(steps):
                encode(k + self.run_ahead + 1)
            return out

        result = run_steps(step_fn, self.bb_state, steps=len(steps), summarize=last_row)
        self.bb_state = result.state
        return result.rows
