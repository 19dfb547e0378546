"""The distilled student: one multi-task model that rates, tags and edits.

DecorateLM (Zhao et al., EMNLP 2024) distils a large model's annotations into one small model
that does all three tasks. Here: a shared ``BidirectionalTrunk`` (the project's transformer
blocks, non-causal), and on top of it a rating head (masked mean pool -> 8 scores), three
tagging heads (pooled -> logits per level, decoded to a consistent path) and the per-token edit
head. The loss is the sum of the rating MSE (targets: the teacher's Bradley-Terry scores,
z-scored per criterion), the mean over levels of the tag cross-entropy, and the edit-op
cross-entropy over real tokens (non-KEEP tokens weighted ``edit_nonkeep_weight``).

Parameters (a pure dict) and optimizer state are a :class:`jaxflow.train.state.TrainState`; the
train step is a jitted, donating ``(state, batch) -> (state, metrics)`` with the batch sharded
over the mesh's "data" axis and the (small) parameters replicated; :func:`distill` runs it with
:func:`jaxflow.train.loop.run_steps`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.decorate.editing import KEEP, BidirectionalTrunk, EditHead, apply_ops, edit_similarity
from jaxflow.decorate.rating import CRITERIA, spearman
from jaxflow.decorate.tagging import TagHierarchy, hierarchical_accuracy, hierarchical_decode
from jaxflow.mesh import jit_on
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


class DecorateStudent(nnx.Module):
    """Shared trunk + rating, tagging and editing heads.

    ``model(tokens, valid)`` with tokens [B, T] int32, valid [B, T] bool returns
    {"ratings": [B, K] f32, "tag_logits": ([B, n1], [B, n2], [B, n3]) f32,
     "edit_logits": [B, T, N_OPS] f32}.
    """

    def __init__(self, trunk: TransformerConfig, tag_sizes: Sequence[int], *,
                 n_criteria: int = len(CRITERIA), rngs: nnx.Rngs):
        d = trunk.d_model
        self.trunk = BidirectionalTrunk(trunk, rngs=rngs)
        self.rating = nnx.Linear(d, n_criteria, rngs=rngs)
        self.tags = nnx.List([nnx.Linear(d, int(n), rngs=rngs) for n in tag_sizes])
        self.edit = EditHead(d, rngs=rngs)

    def __call__(self, tokens: jax.Array, valid: jax.Array) -> dict:
        hidden = self.trunk(tokens, valid)
        w = valid.astype(jnp.float32)[..., None]
        pooled = (hidden.astype(jnp.float32) * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
        return {"ratings": self.rating(pooled),
                "tag_logits": tuple(head(pooled) for head in self.tags),
                "edit_logits": self.edit(hidden)}


@dataclasses.dataclass(frozen=True)
class StudentFunctions:
    """The student's static half: graph definition, abstract state, shardings."""

    graphdef: Any
    abstract_state: Any
    param_shardings: Any
    batch_sharding: NamedSharding
    hierarchy: TagHierarchy
    trunk: TransformerConfig

    def model(self, params) -> DecorateStudent:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def student_functions(trunk: TransformerConfig, hierarchy: TagHierarchy, mesh: Mesh) -> StudentFunctions:
    """Graph definition and replicated parameter shardings of a student on ``mesh``."""
    abstract = nnx.eval_shape(lambda: DecorateStudent(trunk, hierarchy.sizes, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = jax.tree.map(lambda _: replicated, nnx.to_pure_dict(state))
    data = "data" if "data" in mesh.shape else None
    return StudentFunctions(graphdef, state, shardings, NamedSharding(mesh, PartitionSpec(data)),
                            hierarchy, trunk)


def init_student(fns: StudentFunctions, key: jax.Array) -> Any:
    """Fresh parameters (pure dict), placed in their (replicated) shardings.

    Built eagerly and then placed: the student is small, and compiling the whole init as one
    program costs far more than running it."""
    model = DecorateStudent(fns.trunk, fns.hierarchy.sizes, rngs=nnx.Rngs(params=key))
    return jax.device_put(nnx.to_pure_dict(nnx.state(model)), fns.param_shardings)


def encode_texts(texts: Sequence[str], tokenizer: CharTokenizer, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, length] int32, valid [N, length] bool); texts longer than ``length`` are
    cut (decoration sees the first ``length`` characters; the corpus keeps documents within
    that length, see corpus.chunk_text)."""
    tokens = np.full((len(texts), length), tokenizer.pad_id, np.int32)
    valid = np.zeros((len(texts), length), bool)
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t[:length])
        tokens[i, : len(ids)] = ids
        valid[i, : len(ids)] = True
    return tokens, valid


def pad_ops(ops: Sequence[np.ndarray], length: int) -> np.ndarray:
    """[N, length] int32 edit-op targets (KEEP beyond each text)."""
    out = np.full((len(ops), length), KEEP, np.int32)
    for i, o in enumerate(ops):
        o = np.asarray(o)[:length]
        out[i, : len(o)] = o
    return out


def student_loss(model: DecorateStudent, batch: dict, edit_nonkeep_weight: float = 3.0):
    """(loss, metrics) of one batch: tokens, valid, ratings [B, K], tags [B, 3], ops [B, T]."""
    out = model(batch["tokens"], batch["valid"])
    rating_mse = jnp.mean((out["ratings"] - batch["ratings"]) ** 2)
    tag_ce = sum(optax.softmax_cross_entropy_with_integer_labels(lg, batch["tags"][:, i]).mean()
                 for i, lg in enumerate(out["tag_logits"])) / len(out["tag_logits"])
    ce = optax.softmax_cross_entropy_with_integer_labels(out["edit_logits"], batch["ops"])
    w = batch["valid"].astype(jnp.float32) * jnp.where(batch["ops"] == KEEP, 1.0, edit_nonkeep_weight)
    edit_ce = (ce * w).sum() / jnp.maximum(w.sum(), 1.0)
    loss = rating_mse + tag_ce + edit_ce
    return loss, {"loss": loss, "rating_mse": rating_mse, "tag_ce": tag_ce, "edit_ce": edit_ce}


def make_student_train_step(fns: StudentFunctions, *, edit_nonkeep_weight: float = 3.0) -> Callable:
    """Jitted, donating ``(state, batch) -> (state, metrics)``; state a :class:`TrainState`
    (optimizer ``tx``), batch as in :func:`student_loss` (sharded over "data"), metrics scalars."""

    def step(state: TrainState, batch):
        def loss_fn(params):
            return student_loss(fns.model(params), batch, edit_nonkeep_weight)

        grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads), metrics

    bs = fns.batch_sharding
    batch_sh = {"tokens": bs, "valid": bs, "ratings": bs, "tags": bs, "ops": bs}
    replicated = NamedSharding(bs.mesh, PartitionSpec())
    return jit_on(bs.mesh, step, in_shardings=(replicated, batch_sh),
                  out_shardings=(replicated, replicated), donate_argnums=(0,))


def make_predict(fns: StudentFunctions) -> Callable:
    """Jitted ``(params, tokens, valid) -> {"ratings" [B, K], "tags" [B, 3] int32 (a consistent
    path), "ops" [B, T] int32}``; the batch is sharded over "data"."""

    def predict(params, tokens, valid):
        out = fns.model(params)(tokens, valid)
        logp = [jax.nn.log_softmax(lg, axis=-1) for lg in out["tag_logits"]]
        ops = jnp.where(valid, jnp.argmax(out["edit_logits"], axis=-1), KEEP).astype(jnp.int32)
        return {"ratings": out["ratings"], "tags": hierarchical_decode(*logp, fns.hierarchy),
                "ops": ops}

    bs = fns.batch_sharding
    return jit_on(bs.mesh, predict, in_shardings=(fns.param_shardings, bs, bs))


def zscore(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z [N, K], mean [K], std [K]) per column; a constant column gets std 1."""
    x = np.asarray(x, np.float64)
    mu, sd = x.mean(0), x.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    return ((x - mu) / sd).astype(np.float32), mu, sd


def distill(fns: StudentFunctions, *, tokens: np.ndarray, valid: np.ndarray, ratings: np.ndarray,
            tags: np.ndarray, ops: np.ndarray, steps: int, batch_size: int, lr: float,
            key: jax.Array, edit_nonkeep_weight: float = 3.0, log: Callable | None = None):
    """Trains a fresh student on teacher labels; returns (params, last metrics).

    Args:
      tokens, valid: [N, T] encoded texts.
      ratings: [N, K] teacher scores (z-scored here).
      tags: [N, 3].
      ops: [N, T] edit-op targets.
      key: seeds the permutation per epoch that minibatches are drawn with.
    """
    n = tokens.shape[0]
    if batch_size > n:
        raise ValueError(f"student batch_size={batch_size} exceeds the {n} annotated texts")
    targets, _, _ = zscore(ratings)
    k_init, k_data = jax.random.split(key)
    state = init_student_state(fns, student_optimizer(lr, steps), k_init)
    train_step = make_student_train_step(fns, edit_nonkeep_weight=edit_nonkeep_weight)
    batches = batch_order(k_data, n, batch_size)

    def step_fn(state, step):
        idx = next(batches)
        return train_step(state, {"tokens": tokens[idx], "valid": valid[idx], "ratings": targets[idx],
                                  "tags": tags[idx].astype(np.int32), "ops": ops[idx].astype(np.int32)})

    def log_row(done, state, row):
        if log is not None and (done % 50 == 0 or done == steps):
            log(done, host_floats(row))

    # rows stay on device (summarize: the step's own metrics): only a logged step waits
    result = run_steps(step_fn, state, steps=steps, summarize=last_row,
                       hooks=[log_row])
    return result.state.params, host_floats(result.last_metrics or {})


def student_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.01) with 10% linear warmup to ``lr`` and cosine decay to
    ``lr / 10`` over ``steps``."""
    return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps,
                                                          lr * 0.1), weight_decay=0.01)


def init_student_state(fns: StudentFunctions, tx: optax.GradientTransformation,
                       key: jax.Array) -> TrainState:
    """A fresh :class:`TrainState` (parameters from ``key``, optimizer ``tx``), replicated."""
    replicated = NamedSharding(fns.batch_sharding.mesh, PartitionSpec())
    return jax.device_put(TrainState.create(tx, init_student(fns, key)), replicated)


def batch_order(key: jax.Array, n: int, batch_size: int) -> Iterator[np.ndarray]:
    """Endless minibatch indices ``[batch_size]`` into ``n`` texts, seeded by ``key``:
    consecutive slices of a fresh permutation per epoch."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().astype(np.uint32))
    return _epoch_batches(rng, n, batch_size)


def _epoch_batches(rng: np.random.Generator, n: int, batch_size: int):
    """Endless minibatch indices: consecutive slices of a fresh permutation per epoch (a
    permutation's tail shorter than a batch is dropped)."""
    order, pos = rng.permutation(n), 0
    while True:
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        yield order[pos: pos + batch_size]
        pos += batch_size


def host_floats(metrics) -> dict[str, float]:
    """Device scalars ``{name: []}`` -> host floats."""
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def predict_in_batches(predict: Callable, params, tokens: np.ndarray, valid: np.ndarray,
                       batch_size: int) -> dict[str, np.ndarray]:
    """Runs ``predict`` over [N, T] arrays in fixed-size batches (the last one padded)."""
    outs = {"ratings": [], "tags": [], "ops": []}
    n = tokens.shape[0]
    for s in range(0, n, batch_size):
        t, v = tokens[s: s + batch_size], valid[s: s + batch_size]
        m = t.shape[0]
        if m < batch_size:
            t = np.concatenate([t, np.zeros((batch_size - m, t.shape[1]), t.dtype)])
            v = np.concatenate([v, np.zeros((batch_size - m, v.shape[1]), bool)])
        out = jax.device_get(predict(params, t, v))
        for k in outs:
            outs[k].append(np.asarray(out[k])[:m])
    return {k: np.concatenate(v) for k, v in outs.items()}


def agreement(student: dict, teacher_ratings: np.ndarray, teacher_tags: np.ndarray,
              texts: Sequence[str], teacher_edits: Sequence[str]) -> dict:
    """Student-teacher agreement on the same texts.

    Returns {"spearman": {criterion: rho}, "spearman_mean", "tag_accuracy": per-level dict,
    "edit_similarity": mean over texts of 1 - Levenshtein / max length between the student's
    and the teacher's edit, "edit_similarity_unedited": the same for the unedited text (what
    an edit head that keeps everything would get)}.
    """
    rho = spearman(student["ratings"], teacher_ratings)
    edits = [apply_ops(t, o) for t, o in zip(texts, student["ops"])]
    sim = [edit_similarity(a, b) for a, b in zip(edits, teacher_edits)]
    base = [edit_similarity(a, b) for a, b in zip(texts, teacher_edits)]
    return {"spearman": dict(zip(CRITERIA, map(float, rho))), "spearman_mean": float(np.nanmean(rho)),
            "tag_accuracy": hierarchical_accuracy(student["tags"], teacher_tags),
            "edit_similarity": float(np.mean(sim)), "edit_similarity_unedited": float(np.mean(base)),
            "edit_exact": float(np.mean([a == b for a, b in zip(edits, teacher_edits)]))}
