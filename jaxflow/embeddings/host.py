"""Host-resident tables: rows live in host DRAM (numpy) or on disk (tensorstore zarr).

Tables larger than device memory stay on the host; a step moves only the rows it needs:

  ``retrieve``  (host) policy + dedup the batch's ids per table, read those rows and their
                optimizer state, pad to a fixed capacity, place them on the device;
  ``make_host_train_step``  (device) pool from the retrieved rows, loss, gradients w.r.t. the
                rows (duplicates already summed by the gather's transpose), sparse optimizer;
  ``write_back`` (host) store the updated rows and optimizer state.

This is NestPipe's retrieval stage (``jaxflow.nestpipe`` overlaps it with compute). The update is the same
``SparseOptimizer.apply`` as the device-resident path, so host == device up to sum order.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.embeddings.lookup import CapacityOverflowError, narrow_ids_host
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.embeddings.pooling import pool_bags
from jaxflow.embeddings.spec import TableSpec
from jaxflow.embeddings.step import dense_params
from jaxflow.train.state import TrainState


def _open_zarr(path: pathlib.Path, shape, create: bool):
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    if create:
        chunk = [max(1, min(shape[0], 4096))] + list(shape[1:])
        return ts.open(spec, create=True, delete_existing=True, dtype=ts.float32, shape=list(shape),
                       chunk_layout=ts.ChunkLayout(chunk_shape=chunk)).result()
    return ts.open(spec).result()


class HostTable:
    """One table and its sparse-optimizer state off the device.

    ``storage="memory"``: numpy arrays in host DRAM. ``storage="tensorstore"``: zarr arrays under
    ``path`` (one per array), read and written row-wise, so the table may exceed host memory.
    """

    def __init__(self, spec: TableSpec, optimizer: SparseOptimizer, values: np.ndarray, *,
                 storage: str = "memory", path: str | pathlib.Path | None = None):
        if values.shape != (spec.vocab_size, spec.dim):
            raise ValueError(f"table {spec.name!r}: values {values.shape} != "
                             f"{(spec.vocab_size, spec.dim)}")
        if storage not in ("memory", "tensorstore"):
            raise ValueError(f"storage={storage!r}; valid: memory, tensorstore")
        if storage == "tensorstore" and path is None:
            raise ValueError("storage='tensorstore' needs a path")
        self.spec, self.optimizer, self.storage = spec, optimizer, storage
        init = {k: np.asarray(v) for k, v in optimizer.init(spec.vocab_size, spec.dim).items()}
        arrays = {"table": np.asarray(values, np.float32), **{f"opt.{k}": v for k, v in init.items()}}
        if storage == "memory":
            self._arrays = {k: v.copy() for k, v in arrays.items()}
        else:
            self.path = pathlib.Path(path)
            self._arrays = {}
            for k, v in arrays.items():
                store = _open_zarr(self.path / k, v.shape, create=True)
                store.write(v).result()
                self._arrays[k] = store

    def _read(self, key: str, rows: np.ndarray) -> np.ndarray:
        arr = self._arrays[key]
        if self.storage == "memory":
            return arr[rows]
        return np.asarray(arr.oindex[rows].read().result())

    def _write(self, key: str, rows: np.ndarray, values: np.ndarray) -> None:
        arr = self._arrays[key]
        if self.storage == "memory":
            arr[rows] = values
        else:
            arr.oindex[rows].write(np.asarray(values, np.float32)).result()

    @property
    def opt_keys(self) -> list[str]:
        return [k[4:] for k in self._arrays if k.startswith("opt.")]

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self._read("table", rows), {k: self._read(f"opt.{k}", rows) for k in self.opt_keys}

    def write_rows(self, rows: np.ndarray, values: np.ndarray, opt: dict[str, np.ndarray]) -> None:
        self._write("table", rows, values)
        for k in self.opt_keys:
            self._write(f"opt.{k}", rows, opt[k])

    def to_numpy(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.read_rows(np.arange(self.spec.vocab_size))

    def load(self, values: np.ndarray, opt: dict[str, np.ndarray]) -> None:
        """Overwrites the whole table and optimizer state (restore)."""
        self.write_rows(np.arange(self.spec.vocab_size), values, opt)


class HostBatch(NamedTuple):
    """Rows retrieved for one batch: device arrays plus host-side bookkeeping."""

    rows: dict[str, jax.Array]  # [C, D] per table (zeros past n)
    opt: dict[str, dict[str, jax.Array]]  # per-row optimizer state, [C, ...]
    inverse: dict[str, jax.Array]  # int32[B, L] slot per id (-1 = padding)
    unique_ids: dict[str, np.ndarray]  # the n distinct table rows (host)


def retrieve(tables: dict[str, HostTable], ids: dict[str, np.ndarray], capacity: int,
             device: Any = None) -> HostBatch:
    """Host stage: dedup each table's ids, read just those rows, put them on ``device``.

    Raises CapacityOverflowError (more than ``capacity`` distinct ids in a table), ValueError
    (an id breaking an "error" policy) and TypeError (ids without an integer dtype); nothing is
    dropped. Ids of any integer width hash exactly as on the device path.
    """
    rows, opt, inverse, uniques = {}, {}, {}, {}
    for name, table in tables.items():
        spec = table.spec
        x = narrow_ids_host(name, np.asarray(ids[name]), spec.vocab_size, spec.id_policy)
        valid = x >= 0
        uniq, inv = np.unique(x[valid], return_inverse=True)
        if uniq.size > capacity:
            raise CapacityOverflowError(f"table {name!r}: {uniq.size} distinct ids > capacity {capacity}")
        full_inv = np.full(x.shape, -1, np.int32)
        full_inv[valid] = inv
        values, state = table.read_rows(uniq)

        def pad(a):
            return np.concatenate([a, np.zeros((capacity - a.shape[0],) + a.shape[1:], a.dtype)])

        rows[name] = jax.device_put(pad(values), device)
        opt[name] = {k: jax.device_put(pad(v), device) for k, v in state.items()}
        inverse[name] = jax.device_put(full_inv, device)
        uniques[name] = uniq
    return HostBatch(rows, opt, inverse, uniques)


def write_back(tables: dict[str, HostTable], batch: HostBatch, rows: dict, opt: dict) -> None:
    """Host stage: store the updated rows (only the n real ones) and their optimizer state."""
    for name, table in tables.items():
        n = batch.unique_ids[name].size
        table.write_rows(batch.unique_ids[name], np.asarray(rows[name])[:n],
                         {k: np.asarray(v)[:n] for k, v in opt[name].items()})


def make_host_train_step(specs: list[TableSpec], optimizer: SparseOptimizer, loss_fn):
    """Jitted device step ``(dense, rows, opt, inverse, step, batch) -> (dense, rows, opt, metrics)``.

    ``dense``: a ``jaxflow.train.state.TrainState`` of the dense model (updated with its
    ``tx``), or ``{}`` for an embedding-only loss; ``rows`` ``{table: [C, D]}``, ``opt`` their
    per-row optimizer state, ``inverse`` ``{table: int32[B, L]}`` (``HostBatch``);
    ``loss_fn(params, embeddings, batch) -> (loss, aux)`` as in ``step.make_train_step``;
    ``step`` is the sparse update count (from 1), as in the device-resident state;
    ``metrics``: ``{"loss": ..., **aux}``.
    """
    pooling = {s.name: s.pooling for s in specs}

    def step_fn(dense, rows, opt, inverse, step, batch):
        def objective(params, rows):
            emb = {n: pool_bags(rows[n], inverse[n], pooling[n]) for n in rows}
            return loss_fn(params, emb, batch)

        (loss, aux), (g_dense, g_rows) = jax.value_and_grad(objective, argnums=(0, 1),
                                                            has_aux=True)(dense_params(dense), rows)
        new_rows, new_opt = {}, {}
        for n in rows:
            new_rows[n], new_opt[n] = optimizer.apply(rows[n], g_rows[n].astype(jnp.float32), opt[n], step)
        if isinstance(dense, TrainState):
            dense = dense.apply_gradients(g_dense)
        return dense, new_rows, new_opt, {"loss": loss, **aux}

    return jax.jit(step_fn)
