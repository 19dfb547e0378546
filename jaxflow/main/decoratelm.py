"""The ``decoratelm`` experiment (DecorateLM, Zhao et al., EMNLP 2024) end to end.

1. Corpus: real passages (pydoc_data.topics + stdlib docstrings; a held-out part is never
   selectable), templated multi-topic documents with a skewed topic mix, degraded copies of
   known noise level, keyword-salad noise. Written to ``corpus.jsonl`` in the run directory.
2. The programmatic teacher annotates a sample (pairwise comparisons -> Bradley-Terry, tags,
   edits); a multi-task student is distilled on part of it; agreement on the rest.
3. The student decorates the whole pool (streamed, sharded, resumable tensorstore table).
4. Arms, each selecting <= ``token_budget`` tokens: (a) random, (b) rating, (c) rating + tag
   balance, (d) = (c) with the student's edits, (e) = (d) with the teacher's labels and edits.
5. One LM per arm and seed; perplexity (per character token) on the held-out real passages and
   on the probe set.
Plus the Bradley-Terry recovery study (known scores vs comparisons per item).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.config import ConfigError
from jaxflow.decorate import corpus as C
from jaxflow.decorate import decorate as D
from jaxflow.decorate import selection as S
from jaxflow.decorate import student as ST
from jaxflow.decorate.editing import apply_ops
from jaxflow.decorate.rating import CRITERIA, recovery_study, spearman
from jaxflow.decorate.tagging import default_hierarchy, hierarchical_accuracy
from jaxflow.decorate.teacher import ProgrammaticTeacher, annotate
from jaxflow.experiment import RunContext
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import init_train_state, lm_functions, make_optimizer, make_train_step, token_nll
from jaxflow.train.loop import last_row, run_steps

ARMS = ("random", "rating", "rating+tags", "rating+tags+edit", "teacher")


def build_corpus(cfg, hierarchy, seed: int):
    """(pool docs, held-out real docs, probe docs, fingerprint of the real text)."""
    real = C.pydoc_passages(cfg.max_chars) + C.docstring_passages(cfg.max_chars)
    fingerprint = C.corpus_fingerprint(real)
    rng = np.random.default_rng(seed)
    need = cfg.n_real + cfg.n_heldout_real
    if need > len(real):
        raise ValueError(f"corpus.n_real + n_heldout_real = {need} exceeds the {len(real)} real "
                         f"passages of this Python at max_chars={cfg.max_chars}")
    # Held-out passages come from whole topics/objects not in the pool, so no near-duplicate
    # chunk of the same topic leaks into training.
    groups = sorted({d.id.split("#")[0] for d in real})
    order = rng.permutation(len(groups))
    by_group = collections.defaultdict(list)
    for d in real:
        by_group[d.id.split("#")[0]].append(d)
    heldout, pool_real = [], []
    for g in order:
        (heldout if len(heldout) < cfg.n_heldout_real else pool_real).extend(by_group[groups[g]])
    heldout = heldout[: cfg.n_heldout_real]
    pool_real = [pool_real[i] for i in rng.permutation(len(pool_real))[: cfg.n_real]]
    gen = C.TemplateGenerator(hierarchy, max_chars=cfg.max_chars)
    templates = gen.generate(cfg.n_template, seed=seed + 1, level1_skew=cfg.level1_skew)
    sources = pool_real + templates
    degraded = []
    for i in range(cfg.n_degraded):
        src = sources[rng.integers(len(sources))]
        level = cfg.noise_levels[i % len(cfg.noise_levels)]
        text = C.chunk_text(C.degrade(src.text, level, rng), cfg.max_chars)[0]
        degraded.append(dataclasses.replace(src, id=f"deg:{i}:{src.id}", text=text,
                                            source="degraded", noise=level))
    noise = [C.noise_document(rng, hierarchy, f"noise:{i}", int(rng.integers(cfg.max_chars // 2, cfg.max_chars)))
             for i in range(cfg.n_noise)]
    pool = pool_real + templates + degraded + noise
    pool = [pool[i] for i in rng.permutation(len(pool))]
    probe = gen.generate(cfg.n_probe, seed=seed + 2, level1_skew=0.0, prefix="probe", latent_low=0.5)
    return pool, heldout, probe, fingerprint


def _encode_docs(texts, tokenizer, length):
    """[N, length + 1] rows BOS + text + EOS, right-padded, and their lengths."""
    rows = np.full((len(texts), length + 1), tokenizer.pad_id, np.int32)
    lens = np.zeros(len(texts), np.int32)
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t[: length - 1], bos=True, eos=True)
        rows[i, : len(ids)] = ids
        lens[i] = len(ids)
    return rows, lens


class LMRunner:
    """One compiled LM train step and eval function, reused by every arm and seed."""

    def __init__(self, cfg, optim, mesh, tokenizer, eval_sets: dict, max_chars: int):
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
        self.eval_sets = {k: _encode_docs(v, tokenizer, max_chars + 1) for k, v in eval_sets.items()}
        fns = self.fns

        @jax.jit
        def nll_sum(params, rows, lens):
            tokens, targets = rows[:, :-1], rows[:, 1:]
            logits = fns.model(params)(tokens)
            mask = (jnp.arange(tokens.shape[1])[None] < (lens[:, None] - 1)).astype(jnp.float32)
            return (token_nll(logits, targets) * mask).sum(), mask.sum()

        self._nll_sum = nll_sum

    def stream(self, texts) -> np.ndarray:
        parts = [np.asarray(self.tokenizer.encode(t, eos=True), np.int32) for t in texts]
        return np.concatenate(parts)

    def train(self, texts, *, seed: int) -> dict:
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

    def perplexity(self, params, rows, lens) -> float:
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


def _composition(docs) -> dict:
    counts = collections.Counter(d.source for d in docs)
    n = max(len(docs), 1)
    return {k: counts.get(k, 0) / n for k in ("pydoc_topics", "docstring", "template", "degraded", "noise")}


def _level1_entropy(tags: np.ndarray, n1: int) -> float:
    p = np.bincount(tags[:, 0], minlength=n1) / max(len(tags), 1)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def main(config, run: RunContext) -> dict:
    t_start = time.time()
    hierarchy = default_hierarchy()
    tokenizer = C.text_tokenizer()
    mesh = config.mesh.make()
    cc, tc, sc = config.corpus, config.teacher, config.student
    T = cc.max_chars

    # 1. corpus ----------------------------------------------------------------------------
    pool, heldout, probe, fingerprint = build_corpus(cc, hierarchy, config.seed)
    pool_tokens = sum(C.count_tokens(d.text) for d in pool)
    if config.selection.token_budget > pool_tokens:
        raise ConfigError(f"selection.token_budget={config.selection.token_budget} exceeds the corpus's "
                          f"{pool_tokens} tokens; lower it or enlarge the corpus")
    corpus_path = run.out_dir / "corpus.jsonl"
    run.out_dir.mkdir(parents=True, exist_ok=True)
    C.write_jsonl(pool, corpus_path)
    run.info(f"corpus: {len(pool)} pool docs, {len(heldout)} held-out real, {len(probe)} probe; "
             f"real text sha256 {fingerprint['sha256'][:12]} (python {fingerprint['python']})")

    # 2. teacher annotation + distillation --------------------------------------------------
    teacher = ProgrammaticTeacher(hierarchy, judge_noise=tc.judge_noise, seed=config.seed)
    key = jax.random.key(config.seed)
    k_ann, k_full, k_student, k_sel = jax.random.split(key, 4)
    rng = np.random.default_rng(config.seed + 7)
    sample_idx = rng.permutation(len(pool))[: tc.n_annotate]
    sample = [pool[i].text for i in sample_idx]
    t0 = time.time()
    ann = annotate(teacher, sample, min_comparisons=tc.min_comparisons, key=k_ann, l2=tc.l2)
    annotate_s = time.time() - t0
    n_hold = max(int(round(tc.heldout_fraction * len(sample))), 1)
    hold, train = np.arange(n_hold), np.arange(n_hold, len(sample))
    tokens, valid = ST.encode_texts(sample, tokenizer, T)
    ops = ST.pad_ops(ann["ops"], T)
    trunk = TransformerConfig(vocab_size=tokenizer.vocab_size, d_model=sc.d_model, n_layers=sc.n_layers,
                              n_heads=sc.n_heads, n_kv_heads=sc.n_heads, d_ff=sc.d_ff, max_seq_len=T)
    sfns = ST.student_functions(trunk, hierarchy, mesh)
    t0 = time.time()
    run.set_total_steps(sc.steps, "student")
    params, last = ST.distill(sfns, tokens=tokens[train], valid=valid[train], ratings=ann["scores"][train],
                              tags=ann["tags"][train], ops=ops[train], steps=sc.steps,
                              batch_size=sc.batch_size, lr=sc.lr, key=k_student,
                              edit_nonkeep_weight=sc.edit_nonkeep_weight,
                              log=lambda s, m: run.log(s, {f"student_{k}": v for k, v in m.items()}))
    distill_s = time.time() - t0
    predict = ST.make_predict(sfns)
    pred = ST.predict_in_batches(predict, params, tokens[hold], valid[hold], config.decorate.batch_size)
    agree = ST.agreement(pred, ann["scores"][hold], ann["tags"][hold], [sample[i] for i in hold],
                         [ann["edits"][i] for i in hold])
    run.info(f"agreement: spearman mean {agree['spearman_mean']:.3f}, tag acc "
             f"{agree['tag_accuracy']}, edit similarity {agree['edit_similarity']:.3f} "
             f"(unedited {agree['edit_similarity_unedited']:.3f})")

    # 3. decoration of the whole pool -------------------------------------------------------
    dec = D.decorate_corpus(corpus_path, run.out_dir / "decorated", predict=predict, params=params,
                            tokenizer=tokenizer, seq_len=T, batch_size=config.decorate.batch_size,
                            checkpoint_every=config.decorate.checkpoint_every)
    table = D.read_table(run.out_dir / "decorated")
    run.info(f"decorated {dec.rows} texts at {dec.texts_per_second:.0f} texts/s")

    # 4. teacher labels of the whole pool (arm e) ------------------------------------------
    t0 = time.time()
    full = annotate(teacher, [d.text for d in pool], min_comparisons=tc.min_comparisons, key=k_full, l2=tc.l2)
    teacher_full_s = time.time() - t0
    teacher_edit_len = np.array([int((o != 1).sum()) + 1 for o in full["ops"]])

    # 5. selections -------------------------------------------------------------------------
    sel = config.selection
    ex = (sel.tag_exponent,) * 3
    n = len(pool)
    weights = {
        "random": np.ones(n),
        "rating": S.combined_weights(table["ratings"], None, n, coefs=sel.coefs),
        "rating+tags": S.combined_weights(table["ratings"], table["tags"], n, coefs=sel.coefs, exponents=ex),
        "teacher": S.combined_weights(full["scores"], full["tags"], n, coefs=sel.coefs, exponents=ex),
    }
    weights["rating+tags+edit"] = weights["rating+tags"]
    counts = {"random": table["lengths"], "rating": table["lengths"], "rating+tags": table["lengths"],
              "rating+tags+edit": table["edited_lengths"], "teacher": teacher_edit_len}
    tags_of = {"random": table["tags"], "rating": table["tags"], "rating+tags": table["tags"],
               "rating+tags+edit": table["tags"], "teacher": full["tags"]}

    def texts_of(arm, idx):
        if arm == "rating+tags+edit":
            return [apply_ops(pool[i].text, table["ops"][i]) for i in idx]
        if arm == "teacher":
            return [full["edits"][i] for i in idx]
        return [pool[i].text for i in idx]

    runner = LMRunner(config.lm, config.optim, mesh, tokenizer,
                      {"heldout_real": [d.text for d in heldout], "probe": [d.text for d in probe]}, T)
    results = {arm: [] for arm in ARMS}
    selections = {arm: [] for arm in ARMS}
    run.set_total_steps(sc.steps + len(ARMS) * config.seeds, "lm arms")
    t0 = time.time()
    done = 0
    for seed in range(config.seeds):
        for arm in ARMS:
            idx = S.select_budget(weights[arm], counts[arm], sel.token_budget,
                                  key=jax.random.fold_in(k_sel, seed))
            docs = [pool[i] for i in idx]
            texts = texts_of(arm, idx)
            res = runner.train(texts, seed=config.seed + 1000 * seed)
            quality = [C.latent_quality(d) for d in docs]
            selections[arm].append({
                "tokens": int(sum(len(t) + 1 for t in texts)), "texts": len(idx),
                "composition": _composition(docs), "mean_known_quality": float(np.nanmean(quality)),
                "level1_entropy": _level1_entropy(tags_of[arm][idx], hierarchy.sizes[0]),
                "true_level1_entropy_templates": _level1_entropy(
                    np.array([hierarchy.path(d.leaf) for d in docs if d.leaf >= 0] or [[0, 0, 0]]),
                    hierarchy.sizes[0])})
            results[arm].append(res)
            done += 1
            run.log(sc.steps + done, {"arm": ARMS.index(arm), "seed": seed, **res})
    lm_s = time.time() - t0

    table_rows = {}
    for arm in ARMS:
        r = results[arm]
        table_rows[arm] = {
            "heldout_real_ppl_mean": float(np.mean([x["heldout_real_ppl"] for x in r])),
            "heldout_real_ppl_std": float(np.std([x["heldout_real_ppl"] for x in r])),
            "probe_ppl_mean": float(np.mean([x["probe_ppl"] for x in r])),
            "probe_ppl_std": float(np.std([x["probe_ppl"] for x in r])),
            "tokens_mean": float(np.mean([s["tokens"] for s in selections[arm]])),
            "mean_known_quality": float(np.mean([s["mean_known_quality"] for s in selections[arm]])),
            "level1_entropy": float(np.mean([s["level1_entropy"] for s in selections[arm]])),
            "composition": {k: float(np.mean([s["composition"][k] for s in selections[arm]]))
                            for k in selections[arm][0]["composition"]},
        }
    # Student vs teacher over the whole pool (the teacher's full-pool labels are exact there).
    pool_agree = {
        "spearman": dict(zip(CRITERIA, map(float, spearman(table["ratings"], full["scores"])))),
        "tag_accuracy": hierarchical_accuracy(table["tags"], full["tags"]),
    }
    recovery = recovery_study(config.recovery.n_items, config.recovery.comparisons,
                              spread=config.recovery.spread, repeats=config.recovery.repeats,
                              key=jax.random.fold_in(key, 99))
    return {
        "arms": table_rows,
        "per_seed": results,
        "selections": selections,
        "agreement_heldout": agree,
        "agreement_pool": pool_agree,
        "student_final_metrics": last,
        "decoration": dataclasses.asdict(dec),
        "decoration_texts_per_second": dec.texts_per_second,
        "bt_recovery": {str(k): v for k, v in recovery.items()},
        "bt_recovery_spread": config.recovery.spread,
        "corpus": {"pool": len(pool), "heldout_real": len(heldout), "probe": len(probe),
                   "pool_tokens": int(table["lengths"].sum()), "real_text": fingerprint,
                   "tokenizer": C.TOKENIZER_NAME, "composition": _composition(pool)},
        "timings_s": {"annotate_sample": annotate_s, "distill": distill_s, "decorate": dec.seconds,
                      "teacher_full_pool": teacher_full_s, "lm_arms": lm_s,
                      "total": time.time() - t_start},
        "heldout_real_ppl": {arm: table_rows[arm]["heldout_real_ppl_mean"] for arm in ARMS},
        "probe_ppl": {arm: table_rows[arm]["probe_ppl_mean"] for arm in ARMS},
    }
