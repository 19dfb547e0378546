"""The ``dlrm_train`` experiment: DLRM (or DCN-v2) over sharded embedding tables.

Embeddings: ``ShardedEmbeddings`` (placement chosen per table by vocabulary size, sparse
row-wise Adagrad by default); dense model: flax nnx, replicated, optax Adam, gradients psum-ed.
One ``shard_map`` step does both (``jaxflow.embeddings.step``; the dense part is a
``jaxflow.train.state.TrainState``), driven by ``jaxflow.train.loop.run_steps``. Data: the synthetic Criteo-like
generator, or a Criteo TSV / MovieLens file given by ``data.path``. Evaluation: AUC and log loss
on held-out batches. Checkpoints every ``train.checkpoint_every`` steps; ``--resume`` continues.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program, count_params
from jaxflow.distributed import to_host
from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer
from jaxflow.embeddings.checkpoint import EmbeddingCheckpointer
from jaxflow.embeddings.step import abstract_state, make_train_step
from jaxflow.experiment import RunContext
from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import build_model, functional
from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_criteo_tsv, read_movielens
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState

#: dense features of a Criteo TSV row (``readers.read_criteo_tsv``'s ``num_dense``)
CRITEO_DENSE = 13


def placement_for(vocab: int, config) -> str:
    """Small tables replicated, middle ones table-wise, large ones row-wise."""
    if vocab <= config.replicate_below:
        return "replicated"
    if vocab <= config.table_wise_below:
        return "table_wise"
    return "row_wise"


class DataSource:
    """Train / eval batches from the synthetic generator or a user file (host numpy)."""

    def __init__(self, config, seed: int):
        d = config.data
        self.kind = d.source
        if d.source == "synthetic":
            self.gen = SyntheticCriteo(SyntheticConfig(
                vocab_sizes=tuple(d.vocab_sizes), multi_hot=d.multi_hot, zipf_a=d.zipf_a,
                drift_period=d.drift_period), seed=seed)
            self.vocab = dict(zip(self.gen.table_names, d.vocab_sizes))
            self.num_dense = self.gen.config.num_dense
            return
        if not d.path:
            raise ValueError(f"data.source={d.source!r} needs data.path=<file>")
        if d.source == "criteo":
            self.data = read_criteo_tsv(d.path, tuple(d.vocab_sizes), max_rows=d.max_rows or None)
            self.vocab = {f"c{i}": v for i, v in enumerate(d.vocab_sizes)}
        elif d.source == "movielens":
            self.data = movielens_to_clicks(read_movielens(d.path, max_rows=d.max_rows or None))
            self.vocab = {k: int(v.max()) + 1 for k, v in self.data["sparse"].items()}
        else:
            raise ValueError(f"data.source={d.source!r}; valid: synthetic, criteo, movielens")
        n = len(self.data["label"])
        self.split = max(1, int(n * (1 - d.eval_fraction)))
        self.num_dense = self.data["dense"].shape[1]

    def train(self, step: int, batch_size: int) -> dict:
        if self.kind == "synthetic":
            return self.gen.batch(step, batch_size)
        return file_batch(self.data, step, batch_size, stop=self.split)

    def eval(self, index: int, batch_size: int) -> dict:
        if self.kind == "synthetic":
            return self.gen.eval_batch(index, batch_size)
        return file_batch(self.data, index, batch_size, start=self.split)


def feature_layout(config) -> tuple[dict[str, int], int, int]:
    """({table: rows}, dense features F, ids per bag L) of the config's data: the synthetic
    generator's and a Criteo file's from the config alone (nothing of the generator is built),
    MovieLens from its file."""
    d = config.data
    if d.source == "synthetic":
        synthetic = SyntheticConfig(vocab_sizes=tuple(d.vocab_sizes), multi_hot=d.multi_hot)
        return ({f"c{i}": v for i, v in enumerate(d.vocab_sizes)}, synthetic.num_dense,
                d.multi_hot)
    if d.source == "criteo":
        return {f"c{i}": v for i, v in enumerate(d.vocab_sizes)}, CRITEO_DENSE, 1
    data = DataSource(config, config.seed)
    return data.vocab, data.num_dense, 1


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


def make_programs(emb: ShardedEmbeddings, apply):
    """(train step, predict) for the tables of ``emb`` and the dense model ``apply``.

    step: ``embeddings.step.make_train_step`` (state donated) with the mean sigmoid
    cross-entropy; predict: jitted ``(tables, dense params, ids {table: int32[B, L]}, {"dense":
    f32[B, F], ...}) -> logits f32[B]``, split over "data"."""
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


def build(config, mesh=None):
    """(data, embeddings, initial state, train step, predict) for a config.

    State: ``{"emb": ShardedEmbeddings state, "dense": TrainState}`` (``embeddings.step``)."""
    data = DataSource(config, config.seed)
    mesh = mesh or config.mesh.make()
    emb = make_embeddings(config, mesh, data.vocab)
    params, apply = make_model(config, data.num_dense, len(data.vocab))
    replicated = NamedSharding(mesh, P())
    dense = TrainState.create(optax.adam(config.train.dense_lr), params,
                              jax.tree.map(lambda _: replicated, params))
    state = {"emb": emb.init(config.seed), "dense": dense}
    step, predict = make_programs(emb, apply)
    return data, emb, state, step, predict


def dense_model_flops(arch: str, params, batch: int, num_tables: int, dim: int, *,
                      train: bool = True) -> float:
    """Analytic FLOPs of the dense model on ``batch`` samples: forward 2 x params x batch (every
    weight multiplies once per sample; biases and activations are noise) plus, for DLRM, the
    dot interaction 2 x batch x (T+1)^2 x D; a training step is 3 x the forward (backward:
    the gradients of the activations and of the weights). The embedding lookups and the
    sparse update move rows, they do not multiply."""
    forward = 2.0 * count_params(params) * batch
    if arch == "dlrm":
        forward += 2.0 * batch * (num_tables + 1) ** 2 * dim
    return 3.0 * forward if train else forward


def placement_words(emb: ShardedEmbeddings) -> str:
    """The placement in words, e.g. "26 tables on data=64: 26 row-wise (1,032,000,000 rows)"."""
    counts = {}
    for s in emb.plan.specs:
        n, rows = counts.get(s.placement, (0, 0))
        counts[s.placement] = (n + 1, rows + s.vocab_size)
    parts = [f"{n} {p.replace('_', '-')} ({rows:,} rows)" for p, (n, rows) in counts.items()]
    return f"{len(emb.plan.specs)} tables on data={emb.plan.num_shards}: " + ", ".join(parts)


def compile_programs(config, meshes) -> list[Program]:
    """The run's two jitted programs with abstract arguments on ``meshes["mesh"]`` (the
    config's "data" mesh on the target's devices): ``train/step`` (lookup, DLRM forward /
    backward, sparse + dense update; state donated) and ``eval/predict`` (lookup + forward),
    built by :func:`make_programs` as the run builds them. The embedding state is
    ``embeddings.step.abstract_state`` (tables split row-wise over "data" as ``emb.init``
    places them), the dense ``TrainState`` replicated, ids / dense features / labels
    ``[train.batch_size, ...]`` split over "data". Nothing is allocated."""
    mesh, tc, mc = meshes["mesh"], config.train, config.model
    vocab, num_dense, bag = feature_layout(config)
    emb = make_embeddings(config, mesh, vocab)
    params, apply = make_model(config, num_dense, len(vocab), abstract=True)
    replicated, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    dense = TrainState.abstract(optax.adam(tc.dense_lr), params,
                                jax.tree.map(lambda _: replicated, params))
    state = abstract_state(emb, dense)
    step, predict = make_programs(emb, apply)
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


def place_batch(mesh, batch: dict):
    sharding = NamedSharding(mesh, P("data"))
    ids = jax.device_put(batch["sparse"], sharding)
    rest = jax.device_put({"dense": batch["dense"], "label": batch["label"]}, sharding)
    return ids, rest


def evaluate(predict, state, data: DataSource, mesh, batches: int, batch_size: int) -> dict:
    labels, probs, oracle = [], [], []
    for i in range(batches):
        b = data.eval(i, batch_size)
        if "true_logit" in b:
            oracle.append(b["true_logit"])
        ids, rest = place_batch(mesh, b)
        logits = predict(state["emb"]["tables"], state["dense"].params, ids, rest)
        probs.append(to_host(jax.nn.sigmoid(logits)))  # every process: the global batch
        labels.append(b["label"])
    y, p = np.concatenate(labels), np.concatenate(probs)
    out = {"auc": roc_auc(y, p), "logloss": log_loss(y, p), "eval_ctr": float(y.mean())}
    if oracle:  # the planted model's own scores: the best AUC / logloss reachable
        z = np.concatenate(oracle)
        out["oracle_auc"] = roc_auc(y, z)
        out["oracle_logloss"] = log_loss(y, 1 / (1 + np.exp(-z)))
    return out


def main(config, run: RunContext) -> dict:
    tc = config.train
    mesh = config.mesh.make()
    data, emb, state, step_fn, predict = build(config, mesh)
    placements = {s.name: s.placement for s in emb.plan.specs}
    run.info(f"{len(placements)} tables on {mesh.shape['data']} devices: "
             f"{sum(p == 'row_wise' for p in placements.values())} row-wise, "
             f"{sum(p == 'table_wise' for p in placements.values())} table-wise, "
             f"{sum(p == 'replicated' for p in placements.values())} replicated; "
             f"{sum(s.vocab_size for s in emb.plan.specs):,} rows; capacity {emb.capacity}")
    ckpt = EmbeddingCheckpointer(run.checkpoint_dir, save_every=tc.checkpoint_every)
    run.set_total_steps(tc.steps, "dlrm_train")

    def train_step(state, step):
        ids, rest = place_batch(mesh, data.train(step, tc.batch_size))
        return step_fn(state, ids, rest)

    def summarize(window):
        """The row of the steps since the last: mean loss; raises if the last step overflowed."""
        check_stats(window[-1], emb.capacity)
        return {"train_loss": float(np.mean(jax.device_get([m["loss"] for m in window]))),
                "max_unique_per_device": int(window[-1]["max_unique"])}

    t0 = time.time()
    loop = run_steps(train_step, state, steps=tc.steps, run=run, checkpointer=ckpt,
                     log_every=tc.log_every, summarize=summarize)
    train_seconds = time.time() - t0
    state = loop.state
    result = evaluate(predict, state, data, mesh, tc.eval_batches, tc.batch_size)
    run.log(tc.steps, {f"eval_{k}": v for k, v in result.items() if k != "eval_ctr"})
    run.info(f"eval AUC {result['auc']:.4f} logloss {result['logloss']:.4f} (ctr {result['eval_ctr']:.3f})")
    steps_run = tc.steps - loop.start  # this process's steps (fewer after --resume)
    return {**result, "train_steps": tc.steps,
            "samples_per_second": steps_run * tc.batch_size / train_seconds if steps_run > 0 else None,
            "placements": placements}
