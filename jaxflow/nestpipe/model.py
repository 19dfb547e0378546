"""What a NestPipe run is made of, from its config: the mesh, the host tables' specs and sparse
optimizer, the DLRM and its Adam, the routing capacities, and the ``MeshStages`` (stage programs)
each pipeline runs.

Every function takes the experiment's config (``configs/nestpipe.py``'s ``Config``: ``seed``,
``vocab_sizes``, ``embed_dim``, ``multi_hot``, ``batch_size``, ``micro_batches``, the capacities,
``frozen_exchange``, ``pooling_backend``, ``update_backend``, ...). :class:`jaxflow.nestpipe.system.NestPipeSystem`
builds its state and programs from them.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxflow.embeddings import TableSpec, make_sparse_optimizer
from jaxflow.embeddings.host import HostTable
from jaxflow.embeddings.optimizers import SparseOptimizer
from jaxflow.mesh import experiment_devices, require_divisible
from jaxflow.nestpipe.pipelines import PIPELINES
from jaxflow.nestpipe.sharded import AXIS, MeshStages
from jaxflow.recsys.models import build_model, functional
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo

__all__ = ["CAPACITY_NAMES", "capacities", "dense_model", "dense_optimizer", "generator", "host_tables",
           "make_stages", "pipeline_order", "resolve_meshes", "sparse_optimizer", "stage_key",
           "table_specs"]

#: the config's routing capacities (0 = worst-case size, cannot overflow)
CAPACITY_NAMES = ("capacity", "bucket_capacity", "micro_bucket_capacity", "owner_capacity")


def resolve_meshes(config, devices=None) -> dict[str, Mesh]:
    """``{"data": mesh}``: a 1-D mesh (axis ``"data"``) over every device present, or the first
    ``config.devices``; the batch must split into ``micro_batches`` per device.

    Raises:
      MeshError: too few devices, or ``batch_size`` not divisible by devices x micro_batches.
    """
    have = experiment_devices(config.devices, devices)
    require_divisible("batch_size", config.batch_size, len(have), config.micro_batches,
                      "micro_batches")
    return {"data": Mesh(np.array(have), (AXIS,))}


def pipeline_order(config) -> tuple[str, ...]:
    """``config.pipelines`` with ``sync`` first (the baseline every other one is compared to)."""
    return ("sync",) + tuple(p for p in config.pipelines if p != "sync")


def capacities(config, n_devices: int) -> dict[str, int]:
    """The routing capacities for ``n_devices``: the config's when they were measured on that
    count (``capacity_devices``), else 0 each (worst-case sizes; cannot overflow)."""
    if n_devices == config.capacity_devices:
        return {k: getattr(config, k) for k in CAPACITY_NAMES}
    return dict.fromkeys(CAPACITY_NAMES, 0)


@functools.cache
def dense_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The dense model's Adam, one object per rate: a ``TrainState`` keeps its ``tx`` as static
    pytree metadata, so the dense states of two builds with the same rate (e.g. the 8-device
    and the 1-device mesh) have one tree structure (one state can be put into the other's
    shardings)."""
    return optax.adam(learning_rate)


def table_specs(config) -> list[TableSpec]:
    """The host tables' specs: ``c0 ..`` (the generator's feature names), ``vocab_sizes`` rows
    of ``embed_dim``, row-wise, sum-pooled."""
    return [TableSpec(f"c{i}", v, config.embed_dim, "row_wise", "sum")
            for i, v in enumerate(config.vocab_sizes)]


def sparse_optimizer(config) -> SparseOptimizer:
    """The tables' row-wise Adagrad at ``sparse_lr``."""
    return make_sparse_optimizer("rowwise_adagrad", config.sparse_lr)


def generator(config) -> SyntheticCriteo:
    """The synthetic Criteo-like stream (Zipf keys, drifting): ``batch(step, batch_size)`` and
    ``eval_batch(i, batch_size)``, a function of ``config.seed`` and the step."""
    return SyntheticCriteo(SyntheticConfig(vocab_sizes=tuple(config.vocab_sizes),
                                           multi_hot=config.multi_hot, zipf_a=config.zipf_a,
                                           drift_period=config.drift_period), seed=config.seed)


def host_tables(config, specs: list[TableSpec], optimizer: SparseOptimizer) -> dict[str, HostTable]:
    """The initial host-resident tables: per spec f32[vocab_size, dim] ~ 0.05 N(0, 1) from the
    numpy stream ``[config.seed, 11]`` (drawn in spec order), the optimizer's fresh state."""
    rng = np.random.default_rng([config.seed, 11])
    return {s.name: HostTable(s, optimizer, (0.05 * rng.standard_normal((s.vocab_size, s.dim)))
                              .astype(np.float32)) for s in specs}


def dense_model(config, num_dense: int, *, abstract: bool = False) -> tuple[Any, Any]:
    """(params, apply) of the DLRM (``recsys.models.functional``): ``apply(params, dense
    f32[b, num_dense], emb f32[b, T, D]) -> logits f32[b]``; ``abstract``: the params as
    ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``, nothing allocated)."""
    def make():
        return build_model("dlrm", num_dense, len(config.vocab_sizes), config.embed_dim,
                           seed=config.seed, bottom=config.bottom, top=config.top)

    return functional(nnx.eval_shape(make) if abstract else make())


def stage_key(config, pipeline: str) -> tuple[int, str]:
    """(micro-batches, frozen_exchange) of the stage programs ``pipeline`` runs: 1 and the
    config's schedule without a window, N and ``window`` for the whole window (sync_accum),
    N and the config's schedule for the frozen window (fwp / dbp+fwp)."""
    _, window = PIPELINES[pipeline]
    # "whole" (sync_accum) routes the window at once: the batch-level capacities, and
    # clustering (which only shrinks per-micro-batch dedup) would change nothing
    return (config.micro_batches if window else 1,
            "window" if window == "whole" else config.frozen_exchange)


def make_stages(config, specs: list[TableSpec], mesh: Mesh, optimizer: SparseOptimizer, apply,
                pipeline: str) -> MeshStages:
    """The ``MeshStages`` of ``pipeline`` (:func:`stage_key`) on ``mesh``, with the capacities
    of :func:`capacities` (per micro-batch buckets for the frozen window)."""
    n, exchange = stage_key(config, pipeline)
    per_micro_batch = PIPELINES[pipeline][1] == "frozen"
    caps = capacities(config, mesh.devices.size)
    return MeshStages(specs, mesh, optimizer, apply, batch_size=config.batch_size,
                      multi_hot=config.multi_hot, micro_batches=n, capacity=caps["capacity"],
                      bucket_capacity=(caps["micro_bucket_capacity"] if per_micro_batch
                                       else caps["bucket_capacity"]),
                      owner_capacity=caps["owner_capacity"], frozen_exchange=exchange,
                      pooling_backend=config.pooling_backend,
                      update_backend=getattr(config, "update_backend", "auto"))
