"""The ``decoratelm`` selection arms: select up to a token budget by each arm's weights, train
one LM per arm and seed, report perplexity.

Arms (:data:`ARMS`): (a) ``random``, (b) ``rating``, (c) ``rating+tags`` (rating + tag
balance), (d) ``rating+tags+edit`` = (c) with the student's edits, (e) ``teacher`` = (d) with
the teacher's labels and edits.

  LMRunner      one compiled LM train step and eval function, reused by every arm and seed
  ArmInputs     what the arms select from: the decorated table and the teacher's labels
  run_arms      every (seed, arm): selection statistics and the LM's perplexities
  arm_table     the per-arm means over seeds
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.decorate import corpus as C
from jaxflow.decorate import selection as S
from jaxflow.decorate.corpus import Document
from jaxflow.decorate.editing import apply_ops
from jaxflow.decorate.mixture import composition
from jaxflow.decorate.tagging import TagHierarchy
from jaxflow.train.lm_state import init_train_state, lm_functions, make_optimizer, make_train_step, token_nll
from jaxflow.train.loop import last_row, run_steps

ARMS = ("random", "rating", "rating+tags", "rating+tags+edit", "teacher")


def encode_docs(texts: Sequence[str], tokenizer: CharTokenizer, length: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(rows [N, length + 1] int32: BOS + text + EOS, right-padded; lengths [N] int32)."""
    rows = np.full((len(texts), length + 1), tokenizer.pad_id, np.int32)
    lens = np.zeros(len(texts), np.int32)
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t[: length - 1], bos=True, eos=True)
        rows[i, : len(ids)] = ids
        lens[i] = len(ids)
    return rows, lens


class LMRunner:
    """One compiled LM train step and eval function, reused by every arm and seed.

    ``cfg``: ``configs.decoratelm.LMConfig``; ``eval_sets``: ``{name: texts}`` each trained LM
    is scored on (perplexity per character token)."""

    def __init__(self, cfg, optim, mesh: Mesh, tokenizer: CharTokenizer,
                 eval_sets: Mapping[str, Sequence[str]], max_chars: int):
        model = cfg.model
        if model.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"lm.model.vocab_size={model.vocab_size} < tokenizer's {tokenizer.vocab_size}")
        if model.max_seq_len < max(cfg.seq_len, max_chars + 1):
            raise ValueError(f"lm.model.max_seq_len={model.max_seq_len} < max(seq_len, max_chars + 1)")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.fns = lm_functions(model, mesh)
        self.tx = make_optimizer(optim, cfg.steps)
        self.model_cfg = model
        data = "data" if "data" in mesh.shape else None
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(data))
        _, self.shardings = init_train_state(self.fns, model, self.tx, jax.random.key(0))
        self.train_step = make_train_step(self.fns, self.tx, self.shardings, self.batch_sharding)
        self.eval_sets = {k: encode_docs(v, tokenizer, max_chars + 1) for k, v in eval_sets.items()}
        fns = self.fns

        @jax.jit
        def nll_sum(params, rows, lens):
            tokens, targets = rows[:, :-1], rows[:, 1:]
            logits = fns.model(params)(tokens)
            mask = (jnp.arange(tokens.shape[1])[None] < (lens[:, None] - 1)).astype(jnp.float32)
            return (token_nll(logits, targets) * mask).sum(), mask.sum()

        self._nll_sum = nll_sum

    def stream(self, texts: Sequence[str]) -> np.ndarray:
        """The texts' tokens, each followed by EOS, concatenated: [sum of lengths] int32."""
        parts = [np.asarray(self.tokenizer.encode(t, eos=True), np.int32) for t in texts]
        return np.concatenate(parts)

    def train(self, texts: Sequence[str], *, seed: int) -> dict[str, float]:
        """Trains a fresh LM (init and windows from ``seed``) on random windows of ``texts``;
        ``{"train_loss_last", "<eval set>_ppl", ...}``."""
        cfg = self.cfg
        stream = self.stream(texts)
        L, B = cfg.seq_len, cfg.batch_size
        if len(stream) < L + 2:
            raise ValueError(f"selection holds {len(stream)} tokens, fewer than one LM row ({L + 1})")
        state, _ = init_train_state(self.fns, self.model_cfg, self.tx, jax.random.key(seed))
        rng = np.random.default_rng(seed)
        pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
        ones = np.ones((B, L), np.int32)

        def step_fn(state, step):
            starts = rng.integers(0, len(stream) - L - 1, size=B)
            win = stream[starts[:, None] + np.arange(L + 1)[None]]
            return self.train_step(state, {"tokens": win[:, :-1], "targets": win[:, 1:],
                                           "loss_mask": ones.astype(np.float32), "segment_ids": ones,
                                           "positions": pos})

        # rows: each step's metrics, left on device (no step waits for the previous one)
        result = run_steps(step_fn, state, steps=cfg.steps, summarize=last_row)
        losses = [row["loss"] for row in result.rows]
        out = {"train_loss_last": float(np.mean(jax.device_get(losses[-10:])))}
        for name, (rows, lens) in self.eval_sets.items():
            out[f"{name}_ppl"] = self.perplexity(result.state.params, rows, lens)
        return out

    def perplexity(self, params, rows: np.ndarray, lens: np.ndarray) -> float:
        """exp(mean NLL per predicted token) of rows [N, L + 1] with lengths [N]."""
        b = self.cfg.eval_batch_size
        tot, cnt = 0.0, 0.0
        for s in range(0, len(rows), b):
            r, ln = rows[s: s + b], lens[s: s + b]
            if len(r) < b:
                r = np.concatenate([r, np.zeros((b - len(r), r.shape[1]), np.int32)])
                ln = np.concatenate([ln, np.ones(b - len(ln), np.int32)])
            a, c = jax.device_get(self._nll_sum(params, r, ln))
            tot, cnt = tot + float(a), cnt + float(c)
        return math.exp(tot / cnt)


def level1_entropy(tags: np.ndarray, n1: int) -> float:
    """Entropy (nats) of the level-1 tags of ``tags`` [N, 3] over ``n1`` categories."""
    p = np.bincount(tags[:, 0], minlength=n1) / max(len(tags), 1)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


@dataclasses.dataclass(frozen=True)
class ArmInputs:
    """What the arms select from: the ``pool`` documents, the student's decorated ``table``
    (:func:`jaxflow.decorate.decorate.read_table`) and the teacher's labels of the whole pool
    (``teacher``: :func:`jaxflow.decorate.teacher.annotate`'s dict)."""

    pool: Sequence[Document]
    table: Mapping[str, np.ndarray]
    teacher: Mapping[str, Any]

    def weights(self, sel) -> dict[str, np.ndarray]:
        """Each arm's selection weights [N] (``sel``: ``configs.decoratelm.SelectionConfig``)."""
        table, full, n = self.table, self.teacher, len(self.pool)
        ex = (sel.tag_exponent,) * 3
        out = {
            "random": np.ones(n),
            "rating": S.combined_weights(table["ratings"], None, n, coefs=sel.coefs),
            "rating+tags": S.combined_weights(table["ratings"], table["tags"], n, coefs=sel.coefs,
                                              exponents=ex),
            "teacher": S.combined_weights(full["scores"], full["tags"], n, coefs=sel.coefs,
                                          exponents=ex),
        }
        out["rating+tags+edit"] = out["rating+tags"]
        return out

    def token_counts(self) -> dict[str, np.ndarray]:
        """Each arm's tokens per document [N] (edited lengths for the editing arms)."""
        lengths = self.table["lengths"]
        teacher_edit_len = np.array([int((o != 1).sum()) + 1 for o in self.teacher["ops"]])
        return {"random": lengths, "rating": lengths, "rating+tags": lengths,
                "rating+tags+edit": self.table["edited_lengths"], "teacher": teacher_edit_len}

    def tags(self, arm: str) -> np.ndarray:
        """The tags [N, 3] ``arm`` balances by (the teacher's for ``teacher``)."""
        return self.teacher["tags"] if arm == "teacher" else self.table["tags"]

    def texts(self, arm: str, idx: Sequence[int]) -> list[str]:
        """The training texts of the selected documents ``idx`` under ``arm``."""
        if arm == "rating+tags+edit":
            return [apply_ops(self.pool[i].text, self.table["ops"][i]) for i in idx]
        if arm == "teacher":
            return [self.teacher["edits"][i] for i in idx]
        return [self.pool[i].text for i in idx]


def run_arms(inputs: ArmInputs, runner: LMRunner, config, hierarchy: TagHierarchy,
             key: jax.Array, log: Callable[[int, dict], None] = lambda done, row: None
             ) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """For each of ``config.seeds`` seeds and each arm: select up to
    ``config.selection.token_budget`` tokens (:func:`jaxflow.decorate.selection.select_budget`,
    key ``fold_in(key, seed)``) and train an LM on them. Returns (results, selections), per
    arm one dict per seed; ``log(done, row)`` after each LM (``done`` counts from 1)."""
    sel = config.selection
    weights, counts = inputs.weights(sel), inputs.token_counts()
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    selections: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    done = 0
    for seed in range(config.seeds):
        for arm in ARMS:
            idx = S.select_budget(weights[arm], counts[arm], sel.token_budget,
                                  key=jax.random.fold_in(key, seed))
            docs = [inputs.pool[i] for i in idx]
            texts = inputs.texts(arm, idx)
            res = runner.train(texts, seed=config.seed + 1000 * seed)
            quality = [C.latent_quality(d) for d in docs]
            selections[arm].append({
                "tokens": int(sum(len(t) + 1 for t in texts)), "texts": len(idx),
                "composition": composition(docs), "mean_known_quality": float(np.nanmean(quality)),
                "level1_entropy": level1_entropy(inputs.tags(arm)[idx], hierarchy.sizes[0]),
                "true_level1_entropy_templates": level1_entropy(
                    np.array([hierarchy.path(d.leaf) for d in docs if d.leaf >= 0] or [[0, 0, 0]]),
                    hierarchy.sizes[0])})
            results[arm].append(res)
            done += 1
            log(done, {"arm": ARMS.index(arm), "seed": seed, **res})
    return results, selections


def arm_table(results: Mapping[str, Sequence[dict]],
              selections: Mapping[str, Sequence[dict]]) -> dict[str, dict]:
    """Per arm: perplexities' mean and std over seeds, mean tokens, known quality, level-1
    entropy and source composition of the selections."""
    table = {}
    for arm in ARMS:
        r, s = results[arm], selections[arm]
        table[arm] = {
            "heldout_real_ppl_mean": float(np.mean([x["heldout_real_ppl"] for x in r])),
            "heldout_real_ppl_std": float(np.std([x["heldout_real_ppl"] for x in r])),
            "probe_ppl_mean": float(np.mean([x["probe_ppl"] for x in r])),
            "probe_ppl_std": float(np.std([x["probe_ppl"] for x in r])),
            "tokens_mean": float(np.mean([x["tokens"] for x in s])),
            "mean_known_quality": float(np.mean([x["mean_known_quality"] for x in s])),
            "level1_entropy": float(np.mean([x["level1_entropy"] for x in s])),
            "composition": {k: float(np.mean([x["composition"][k] for x in s]))
                            for k in s[0]["composition"]},
        }
    return table
