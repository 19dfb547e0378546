"""DLRM / DCN-v2 over sharded embedding tables as a :class:`jaxflow.system.System`.

Embeddings: :class:`jaxflow.embeddings.ShardedEmbeddings` (placement chosen per table by
vocabulary size, :func:`placement_for`; sparse row-wise Adagrad by default); dense model: flax
nnx (:mod:`jaxflow.recsys.models`), replicated, optax Adam, gradients psum-ed. One
``shard_map`` step does both (:func:`jaxflow.embeddings.step.make_train_step`, whose state is
``{"emb": embedding state, "dense": TrainState}``). Data: :class:`jaxflow.recsys.source.DataSource`.
Evaluation: AUC and log loss on held-out batches.

``config`` is the ``dlrm_train`` experiment's (``configs/dlrm_train.py``: ``seed``, ``data``,
``model``, ``placement``, ``train``); ``meshes["mesh"]`` a mesh with a "data" axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program
from jaxflow.distributed import to_host
from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer
from jaxflow.embeddings.step import abstract_state, make_train_step
from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import build_model, dense_model_flops, functional
from jaxflow.recsys.source import DataSource, feature_layout, place_batch
from jaxflow.system import static_field, system_state
from jaxflow.train.state import TrainState


def placement_for(vocab: int, config) -> str:
    """Small tables replicated, middle ones table-wise, large ones row-wise (``config``: the
    ``placement`` section, ``replicate_below`` / ``table_wise_below`` rows)."""
    if vocab <= config.replicate_below:
        return "replicated"
    if vocab <= config.table_wise_below:
        return "table_wise"
    return "row_wise"


def make_embeddings(config, mesh, vocab: dict[str, int]) -> ShardedEmbeddings:
    """The tables of ``vocab`` placed on ``mesh``'s "data" axis (``placement_for`` each), the
    sparse optimizer, the dedup capacity (``train.capacity`` or the no-overflow bound: local
    batch x ids per bag x tables) and the pooling backend.

    Raises ValueError when ``train.batch_size`` does not split over the axis."""
    tc, mc = config.train, config.model
    specs = [TableSpec(n, v, mc.embed_dim, placement_for(v, config.placement), "sum",
                       id_policy="hash_modulo") for n, v in vocab.items()]
    n_dev = mesh.shape["data"]
    if tc.batch_size % n_dev:
        raise ValueError(f"train.batch_size={tc.batch_size} is not divisible by {n_dev} devices")
    # distinct keys per device per group are at most (local batch) x (ids per sample in the group)
    capacity = tc.capacity or (tc.batch_size // n_dev) * config.data.multi_hot * len(specs)
    return ShardedEmbeddings(specs, mesh, make_sparse_optimizer(tc.sparse_optimizer, tc.sparse_lr),
                             capacity=capacity, pooling_backend=mc.pooling_backend)


def make_model(config, num_dense: int, num_tables: int, *, abstract: bool = False):
    """(params, apply) of the dense model (``recsys.models.functional``); ``abstract``: the
    params as ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``, nothing allocated)."""
    mc = config.model

    def make():
        return build_model(mc.arch, num_dense, num_tables, mc.embed_dim, seed=config.seed,
                           bottom=mc.bottom, top=mc.top, cross_layers=mc.cross_layers,
                           deep=mc.deep)

    return functional(nnx.eval_shape(make) if abstract else make())


def make_step_and_predict(emb: ShardedEmbeddings, apply):
    """(train step, predict) for the tables of ``emb`` and the dense model ``apply``.

    step: ``embeddings.step.make_train_step`` (state ``{"emb", "dense"}`` donated) with the
    mean sigmoid cross-entropy; predict: jitted ``(tables, dense params, ids {table: int32[B,
    L]}, {"dense": f32[B, F], ...}) -> logits f32[B]``, split over "data"."""
    mesh, names = emb.mesh, tuple(s.name for s in emb.plan.specs)

    def loss_fn(params, outputs, batch):
        sparse = jnp.stack([outputs[n] for n in names], axis=1)
        logits = apply(params, batch["dense"], sparse)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["label"])), {}

    step = make_train_step(emb, loss_fn)

    def local_predict(tables, params, ids, batch):
        embs, ctxs = emb.local_forward(tables, ids)
        out = emb.local_pool(embs, ctxs, ids)
        return apply(params, batch["dense"], jnp.stack([out[n] for n in names], axis=1))

    predict = jax.jit(jax.shard_map(
        local_predict, mesh=mesh,
        in_specs=(emb.state_specs()["tables"], P(), P("data"), P("data")),
        out_specs=P("data"), check_vma=False))
    return step, predict


def placement_words(emb: ShardedEmbeddings) -> str:
    """The placement in words, e.g. "26 tables on data=64: 26 row-wise (1,032,000,000 rows)"."""
    counts: dict[str, tuple[int, int]] = {}
    for s in emb.plan.specs:
        n, rows = counts.get(s.placement, (0, 0))
        counts[s.placement] = (n + 1, rows + s.vocab_size)
    parts = [f"{n} {p.replace('_', '-')} ({rows:,} rows)" for p, (n, rows) in counts.items()]
    return f"{len(emb.plan.specs)} tables on data={emb.plan.num_shards}: " + ", ".join(parts)


def placement_counts(emb: ShardedEmbeddings) -> str:
    """One log line: tables per placement, rows and the dedup capacity, e.g. "26 tables on 8
    devices: 7 row-wise, 8 table-wise, 11 replicated; 543,343 rows; capacity 13312"."""
    placements = [s.placement for s in emb.plan.specs]
    return (f"{len(placements)} tables on {emb.mesh.shape['data']} devices: "
            f"{placements.count('row_wise')} row-wise, {placements.count('table_wise')} table-wise, "
            f"{placements.count('replicated')} replicated; "
            f"{sum(s.vocab_size for s in emb.plan.specs):,} rows; capacity {emb.capacity}")


def train_row(window: Sequence[Mapping[str, Any]], capacity: int) -> dict:
    """A ``run_steps`` row of the steps since the last: mean ``train_loss`` and the last step's
    ``max_unique_per_device``; raises (``embeddings.check_stats``) if the last step overflowed
    ``capacity``."""
    check_stats(window[-1], capacity)
    return {"train_loss": float(np.mean(jax.device_get([m["loss"] for m in window]))),
            "max_unique_per_device": int(window[-1]["max_unique"])}


@system_state
class DLRMState:
    """The DLRM system's state.

    Attributes:
      emb: the embedding state (``ShardedEmbeddings.init``: tables / optimizer rows / step,
        placed on the mesh).
      dense: the dense model's :class:`TrainState` (replicated).
      config: the experiment config (static).
      data: the batches (:class:`DataSource`, static).
      embeddings: the tables' :class:`ShardedEmbeddings` (static).
      train_step: jitted ``({"emb", "dense"}, ids, rest) -> (state, metrics)`` (static; its
        state argument is donated).
      predict: jitted ``(tables, dense params, ids, rest) -> logits f32[B]`` (static).
    """

    emb: dict
    dense: TrainState
    config: Any = static_field()
    data: DataSource = static_field()
    embeddings: ShardedEmbeddings = static_field()
    train_step: Any = static_field()
    predict: Any = static_field()


class DLRMSystem:
    """DLRM / DCN-v2 over sharded embeddings (:class:`jaxflow.system.System`); holds nothing."""

    def init(self, config, meshes: Mapping[str, Any], key: jax.Array | None = None) -> DLRMState:
        """The fresh state on ``meshes["mesh"]``: data, tables (``emb.init(config.seed)``), the
        dense model (seeded by ``config.seed``) with Adam at ``train.dense_lr``. ``key`` is not
        used: every initialisation is seeded by ``config.seed``, as the runs always were."""
        mesh = meshes["mesh"]
        data = DataSource(config, config.seed)
        emb = make_embeddings(config, mesh, data.vocab)
        params, apply = make_model(config, data.num_dense, len(data.vocab))
        replicated = NamedSharding(mesh, P())
        dense = TrainState.create(optax.adam(config.train.dense_lr), params,
                                  jax.tree.map(lambda _: replicated, params))
        step, predict = make_step_and_predict(emb, apply)
        return DLRMState(emb.init(config.seed), dense, config, data, emb, step, predict)

    def step(self, state: DLRMState, batch: dict, *,
             key: jax.Array | None = None) -> tuple[DLRMState, dict]:
        """One training step on a host batch (``DataSource.train``: sparse ids, dense features,
        labels); ``state``'s arrays are donated. Metrics: ``loss`` and the lookup's overflow /
        bad-id counts (``max_unique``, ...) as device scalars. ``key`` is not used."""
        ids, rest = place_batch(state.embeddings.mesh, batch)
        new, metrics = state.train_step({"emb": state.emb, "dense": state.dense}, ids, rest)
        return dataclasses.replace(state, emb=new["emb"], dense=new["dense"]), metrics

    def evaluate(self, state: DLRMState) -> dict:
        """AUC, log loss and click rate on ``train.eval_batches`` held-out batches (and the
        planted model's own ``oracle_auc`` / ``oracle_logloss`` on synthetic data)."""
        tc, mesh = state.config.train, state.embeddings.mesh
        labels, probs, oracle = [], [], []
        for i in range(tc.eval_batches):
            b = state.data.eval(i, tc.batch_size)
            if "true_logit" in b:
                oracle.append(b["true_logit"])
            ids, rest = place_batch(mesh, b)
            logits = state.predict(state.emb["tables"], state.dense.params, ids, rest)
            probs.append(to_host(jax.nn.sigmoid(logits)))  # every process: the global batch
            labels.append(b["label"])
        y, p = np.concatenate(labels), np.concatenate(probs)
        out = {"auc": roc_auc(y, p), "logloss": log_loss(y, p), "eval_ctr": float(y.mean())}
        if oracle:  # the planted model's own scores: the best AUC / logloss reachable
            z = np.concatenate(oracle)
            out["oracle_auc"] = roc_auc(y, z)
            out["oracle_logloss"] = log_loss(y, 1 / (1 + np.exp(-z)))
        return out

    def programs(self, config, meshes: Mapping[str, Any]) -> list[Program]:
        """The run's two jitted programs with abstract arguments on ``meshes["mesh"]``:
        ``train/step`` (lookup, dense forward / backward, sparse + dense update; state donated)
        and ``eval/predict`` (lookup + forward), built by :func:`make_step_and_predict` as
        :meth:`init` builds them. The embedding state is ``embeddings.step.abstract_state``
        (as ``emb.init`` places it), the dense ``TrainState`` replicated, ids / dense features /
        labels ``[train.batch_size, ...]`` split over "data". Nothing is allocated."""
        mesh, tc, mc = meshes["mesh"], config.train, config.model
        vocab, num_dense, bag = feature_layout(config)
        emb = make_embeddings(config, mesh, vocab)
        params, apply = make_model(config, num_dense, len(vocab), abstract=True)
        replicated, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        dense = TrainState.abstract(optax.adam(tc.dense_lr), params,
                                    jax.tree.map(lambda _: replicated, params))
        state = abstract_state(emb, dense)
        step, predict = make_step_and_predict(emb, apply)
        S, b = jax.ShapeDtypeStruct, tc.batch_size
        ids = {n: S((b, bag), jnp.int32, sharding=row) for n in vocab}
        rest = {"dense": S((b, num_dense), jnp.float32, sharding=row),
                "label": S((b,), jnp.float32, sharding=row)}
        note = (f"{placement_words(emb)}; batch {b} split over data; {mc.arch} dense model "
                f"replicated, gradients psum-ed; pooling {mc.pooling_backend}")
        flops = functools.partial(dense_model_flops, mc.arch, params, b, len(vocab), mc.embed_dim)
        return [Program("train/step", step, (state, ids, rest), mesh, kind="train",
                        model_flops=flops(train=True), tokens=b, note=note),
                Program("eval/predict", predict, (state["emb"]["tables"], dense.params, ids, rest),
                        mesh, kind="forward", model_flops=flops(train=False), tokens=b, note=note)]
