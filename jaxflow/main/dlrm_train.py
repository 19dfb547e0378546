"""The ``dlrm_train`` experiment: DLRM (or DCN-v2) over sharded embedding tables.

Embeddings: ``ShardedEmbeddings`` (placement chosen per table by vocabulary size, sparse
row-wise Adagrad by default); dense model: flax nnx, replicated, optax Adam, gradients psum-ed.
One ``shard_map`` step does both (``jaxflow.embeddings.step``; the dense part is a
``jaxflow.train.state.TrainState``), driven by ``jaxflow.train.loop.run_steps``. Data: the synthetic Criteo-like
generator, or a Criteo TSV / MovieLens file given by ``data.path``. Evaluation: AUC and log loss
on held-out batches. Checkpoints every ``train.checkpoint_every`` steps; ``--resume`` continues.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer
from jaxflow.embeddings.checkpoint import EmbeddingCheckpointer
from jaxflow.embeddings.step import make_train_step
from jaxflow.experiment import RunContext
from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import build_model, functional
from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_criteo_tsv, read_movielens
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState


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


def build(config, mesh=None):
    """(data, embeddings, initial state, train step, predict) for a config.

    State: ``{"emb": ShardedEmbeddings state, "dense": TrainState}`` (``embeddings.step``)."""
    tc, mc = config.train, config.model
    data = DataSource(config, config.seed)
    mesh = mesh or config.mesh.make()
    names = tuple(data.vocab)
    specs = [TableSpec(n, data.vocab[n], mc.embed_dim, placement_for(data.vocab[n], config.placement),
                       "sum", id_policy="hash_modulo") for n in names]
    n_dev = mesh.shape["data"]
    if tc.batch_size % n_dev:
        raise ValueError(f"train.batch_size={tc.batch_size} is not divisible by {n_dev} devices")
    bag = config.data.multi_hot
    # distinct keys per device per group are at most (local batch) x (ids per sample in the group)
    capacity = tc.capacity or (tc.batch_size // n_dev) * bag * len(names)
    emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer(tc.sparse_optimizer, tc.sparse_lr),
                            capacity=capacity)
    model = build_model(mc.arch, data.num_dense, len(names), mc.embed_dim, seed=config.seed,
                        bottom=mc.bottom, top=mc.top, cross_layers=mc.cross_layers, deep=mc.deep)
    params, apply = functional(model)
    tx = optax.adam(tc.dense_lr)

    def loss_fn(params, outputs, batch):
        sparse = jnp.stack([outputs[n] for n in names], axis=1)
        logits = apply(params, batch["dense"], sparse)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["label"])), {}

    replicated = NamedSharding(mesh, P())
    dense = TrainState.create(tx, params, jax.tree.map(lambda _: replicated, params))
    state = {"emb": emb.init(config.seed), "dense": dense}
    step = make_train_step(emb, loss_fn)

    def local_predict(tables, params, ids, batch):
        embs, ctxs = emb.local_forward(tables, ids)
        out = emb.local_pool(embs, ctxs, ids)
        return apply(params, batch["dense"], jnp.stack([out[n] for n in names], axis=1))

    predict = jax.jit(jax.shard_map(
        local_predict, mesh=mesh,
        in_specs=(emb.state_specs()["tables"], P(), P("data"), P("data")),
        out_specs=P("data"), check_vma=False))
    return data, emb, state, step, predict


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
        probs.append(np.asarray(jax.nn.sigmoid(logits)))
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
