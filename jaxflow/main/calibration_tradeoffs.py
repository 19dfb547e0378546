"""The ``calibration_tradeoffs`` experiment: which calibration source preserves which capability.

For every calibration source x independent draw: build the calibration set, measure its
perplexity under the dense model, prune the dense capability model at every sparsity
(SparseGPT, sequential), score every capability and report retention = pruned / dense. Then the
Spearman correlation, across sources at sparsity 0.6, of calibration perplexity with each
capability's retention (the paper: +0.71 General, -0.53 Math, -0.59 Code).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.prune.calibration import MODEL_SOURCES, calibration_set
from jaxflow.prune.capabilities import CAPABILITIES, CapabilityEvaluator, make_tokenizer, make_world, retention
from jaxflow.prune.dense import load_or_train_dense, train_dense
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.selfgen import packed_perplexity
from jaxflow.prune.sequential import prune
from jaxflow.train.lm_state import lm_functions

PAPER = {
    "spearman_at_0.6": {"general": 0.71, "math": -0.53, "code": -0.59},
    "total_retention_llama31_8b": {"mix": 0.588, "best_single_source(metamath)": 0.500, "c4": 0.400},
    "averaged_vs_code_gap_points": {"commonsense_avg_acc": 2.85, "code_retention": 51.9},
}


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties); nan when either side is constant."""
    def ranks(v):
        v = np.asarray(v, np.float64)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):
            same = v == value
            r[same] = r[same].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _sparsity_value(text: str):
    pattern = parse_sparsity(text)
    return str(pattern) if pattern.is_nm else pattern.fraction


def _split_rows(batch: dict, rows: int) -> list[dict]:
    n = batch["tokens"].shape[0]
    keys = ("tokens", "segment_ids", "positions")
    return [{k: batch[k][i:i + rows] for k in keys} for i in range(0, n, rows)]


def main(config, run: RunContext) -> dict:
    mesh = config.mesh.make()
    hf = None
    if config.model.hf_path:  # --set model.hf_path=DIR: prune a local HF checkpoint instead
        from jaxflow.models.pretrained import load_policy

        hf = load_policy(config.model.hf_path, mesh)
        config = dataclasses.replace(config, model=hf[0])
        run.info(f"dense model from {config.model.hf_path}: {hf[0].architecture}")
    fns = lm_functions(config.model, mesh)
    tokenizer = make_tokenizer() if hf is None else hf[2]
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={config.model.vocab_size} < tokenizer's {tokenizer.vocab_size}")
    world = make_world(config.world_seed, math_digits=config.math_digits)
    recipe = {"model": config.model, "train": config.train, "optim": config.optim,
              "world_seed": config.world_seed, "seed": config.seed,
              "math_digits": config.math_digits}

    def train():
        run.set_total_steps(config.train.steps, "dense model")
        return train_dense(fns, config.model, config.optim, config.train, world, seed=config.seed,
                           log=lambda step, row: run.log(step, {"phase": "dense", **row}))

    t0 = time.time()
    if hf is None:
        dense_params, cache = load_or_train_dense(fns, recipe, config.cache_root, train=train,
                                                  info=run.info)
    else:
        dense_params, cache = hf[1], hf[0].hf_path
    evaluator = CapabilityEvaluator(fns, tokenizer, world, n=config.eval_examples)
    dense_scores = evaluator(dense_params)
    run.info(f"dense scores {dense_scores} ({time.time() - t0:.0f}s incl. training/loading)")

    sparsities = [_sparsity_value(s) for s in config.sparsities]
    per_draw: list[dict] = []
    perplexity: dict[str, list[float]] = {s: [] for s in config.sources}
    total = len(config.sources) * config.draws * len(sparsities)
    run.set_total_steps(total, "prune+eval")
    done = 0
    for draw in range(config.draws):
        for source in config.sources:
            extra = {"fns": fns, "params": dense_params} if source in MODEL_SOURCES else {}
            calib = calibration_set(source, world=world, tokenizer=tokenizer, cfg=config.calibration,
                                    draw=config.seed * 1000 + draw, **extra)
            ppl = packed_perplexity(fns, dense_params, calib)
            perplexity[source].append(ppl)
            batches = _split_rows(calib, config.calib_batch_rows)
            for sp in sparsities:
                start = time.time()
                pruned, _ = prune(dense_params, batches, sp, method=config.method,
                                  model_config=config.model, block_size=config.block_size)
                scores = evaluator(pruned)
                ret = retention(scores, dense_scores)
                done += 1
                per_draw.append({"source": source, "sparsity": sp, "draw": draw, "perplexity": ppl,
                                 "scores": scores, "retention": ret})
                run.log(done, {"phase": "prune", "source": source, "sparsity": str(sp), "draw": draw,
                               "perplexity": ppl, "seconds": time.time() - start,
                               **{f"retention_{k}": v for k, v in ret.items()}})
    run.write_json("per_draw.json", per_draw)

    rows, totals = [], {}
    for source in config.sources:
        for sp in sparsities:
            cell = [r for r in per_draw if r["source"] == source and r["sparsity"] == sp]
            for cap in (*CAPABILITIES, "total"):
                vals = [r["retention"][cap] for r in cell]
                rows.append({"source": source, "sparsity": sp, "capability": cap,
                             "retention": float(np.mean(vals)), "retention_std": float(np.std(vals)),
                             "draws": len(vals)})
            totals.setdefault(source, {})[str(sp)] = rows[-1]["retention"]
    mean_ppl = {s: float(np.mean(v)) for s, v in perplexity.items()}
    rho_sparsity = 0.6 if 0.6 in sparsities else sparsities[0]
    spearman_map = {}
    for cap in (*CAPABILITIES, "total"):
        ret = [next(r["retention"] for r in rows if r["source"] == s and r["sparsity"] == rho_sparsity
                    and r["capability"] == cap) for s in config.sources]
        spearman_map[cap] = spearman([mean_ppl[s] for s in config.sources], ret)
    singles = [s for s in config.sources if s not in ("mix", "igsp")]
    at = str(rho_sparsity)
    best_single = max(singles, key=lambda s: totals[s][at]) if singles else None
    return {
        "retention": rows,
        "spearman": spearman_map,
        "spearman_sparsity": rho_sparsity,
        "total_retention": totals,
        "perplexity": mean_ppl,
        "dense_scores": dense_scores,
        "best_single_source": {"source": best_single, "total_retention": totals[best_single][at]}
        if best_single else None,
        "draws": config.draws,
        "method": config.method,
        "dense_cache": str(cache),
        "paper": PAPER,
    }
