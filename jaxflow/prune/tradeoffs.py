"""The calibration-tradeoffs study (``calibration_tradeoffs``) on one dense model: which
calibration source preserves which capability.

For every calibration source x independent draw: build the calibration set, measure its
perplexity under the dense model, prune the dense capability model at every sparsity
(:class:`jaxflow.prune.system.PruneSystem`: SparseGPT, sequential), score every capability and
report retention = pruned / dense; then, per sparsity, the Spearman correlation across sources of
calibration perplexity with each capability's retention, with a bootstrap interval over sources
(:func:`study_size`), and whether each correlation keeps its sign across sizes and sparsities
(:func:`sign_stability_across`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.prune.calibration import MODEL_SOURCES, calibration_set
from jaxflow.prune.capabilities import CapabilityEvaluator, make_tokenizer, make_world
from jaxflow.prune.correlation import bootstrap_spearman, sign_stability
from jaxflow.prune.dense import load_or_train_dense, train_dense
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.selfgen import packed_perplexity
from jaxflow.prune.system import PruneConfig, PruneSystem
from jaxflow.prune.task_files import TaskFileError
from jaxflow.study.grid import cell_seed
from jaxflow.train.lm_state import lm_functions

__all__ = ["check_encodable", "scores_and_retention", "sign_stability_across", "sparsity_value", "split_rows",
           "study_size"]


def scores_and_retention(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """:meth:`PruneSystem.evaluate`'s flat row split back into (scores, retention) dicts."""
    scores = {k.removeprefix("score/"): v for k, v in metrics.items() if k.startswith("score/")}
    ret = {k.removeprefix("retention/"): v for k, v in metrics.items() if k.startswith("retention/")}
    return scores, ret


def sparsity_value(text: str) -> float | str:
    """A configured sparsity as the study keys it: the fraction (0.6) or the "N:M" text."""
    pattern = parse_sparsity(text)
    return str(pattern) if pattern.is_nm else pattern.fraction


def split_rows(batch: dict, rows: int) -> list[dict]:
    """A packed calibration set (``tokens`` / ``segment_ids`` / ``positions`` [N, T]) cut into
    batches of ``rows`` rows [rows, T] (the last may be shorter)."""
    n = batch["tokens"].shape[0]
    keys = ("tokens", "segment_ids", "positions")
    return [{k: batch[k][i:i + rows] for k in keys} for i in range(0, n, rows)]


def check_encodable(tokenizer, task_sets, documents) -> None:
    """Every user-given prompt, answer, choice and document encodes (before any training)."""
    for cap, exs in (task_sets or {}).items():
        for i, e in enumerate(exs):
            for text in (e.prompt, e.answer, *e.choices):
                try:
                    tokenizer.encode(text)
                except ValueError as err:
                    raise TaskFileError(f"evaluation item {i} of {cap!r}: {err}") from None
    for name, docs in (documents or {}).items():
        for i, d in enumerate(docs):
            try:
                tokenizer.encode(d)
            except ValueError as err:
                raise TaskFileError(f"calibration document {i} of {name!r}: {err}") from None


def study_size(config, model_cfg, mesh, run: RunContext, *, hf, task_sets, documents, size: str,
           progress: list[int], total: int) -> dict:
    """The whole grid (draws x sources x sparsities) on one dense model; that size's summary.

    Trains (or loads from ``config.cache_root``) the dense model of ``model_cfg`` unless ``hf``
    (``load_policy``'s (config, params, tokenizer)) gives one, then per calibration draw and
    source prunes it at every sparsity (:class:`PruneSystem`) and scores every capability;
    ``progress`` [done] counts cells across sizes out of ``total`` (the rows' step).
    Returns the size's retention rows, Spearman map / intervals, perplexities, totals and
    ``per_draw`` (one row per cell)."""
    fns = lm_functions(model_cfg, mesh)
    tokenizer = make_tokenizer() if hf is None else hf[2]
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} < tokenizer's {tokenizer.vocab_size}")
    check_encodable(tokenizer, task_sets, documents)
    world = None if (task_sets is not None and documents is not None) else make_world(
        config.world_seed, math_digits=config.math_digits)
    recipe = {"model": model_cfg, "train": config.train, "optim": config.optim,
              "world_seed": config.world_seed, "seed": config.seed,
              "math_digits": config.math_digits}

    def train():
        run.set_total_steps(config.train.steps, f"dense model ({size})")
        return train_dense(fns, model_cfg, config.optim, config.train, make_world(
            config.world_seed, math_digits=config.math_digits), seed=config.seed,
            log=lambda step, row: run.log(step, {"phase": "dense", "size": size, **row}))

    t0 = time.time()
    if hf is None:
        dense_params, cache = load_or_train_dense(fns, recipe, config.cache_root, train=train,
                                                  info=run.info)
    else:
        dense_params, cache = hf[1], hf[0].hf_path
    run.set_total_steps(total, "prune+eval")
    evaluator = CapabilityEvaluator(fns, tokenizer, world, n=config.eval_examples, sets=task_sets)
    capabilities = evaluator.capabilities
    dense_scores = evaluator(dense_params)
    run.info(f"[{size}] dense scores {dense_scores} ({time.time() - t0:.0f}s incl. training/loading)")

    sparsities = [sparsity_value(s) for s in config.sparsities]
    per_draw: list[dict] = []
    perplexity: dict[str, list[float]] = {s: [] for s in config.sources}
    for draw in range(config.draws):
        for source in config.sources:
            extra = {"fns": fns, "params": dense_params} if source in MODEL_SOURCES else {}
            calib = calibration_set(source, world=world, tokenizer=tokenizer, cfg=config.calibration,
                                    draw=cell_seed(config.seed, draw), documents=documents, **extra)
            ppl = packed_perplexity(fns, dense_params, calib)
            perplexity[source].append(ppl)
            batches = split_rows(calib, config.calib_batch_rows)
            for sp in sparsities:
                start = time.time()
                system = PruneSystem(dense_params, batches, evaluator=evaluator, dense_scores=dense_scores)
                scores, ret = scores_and_retention(system.evaluate(system.run(PruneConfig(
                    sparsity=sp, method=config.method, model=model_cfg, block_size=config.block_size))))
                progress[0] += 1
                per_draw.append({"size": size, "source": source, "sparsity": sp, "draw": draw,
                                 "perplexity": ppl, "scores": scores, "retention": ret})
                run.log(progress[0], {"phase": "prune", "size": size, "source": source,
                                      "sparsity": str(sp), "draw": draw, "perplexity": ppl,
                                      "seconds": time.time() - start,
                                      **{f"retention_{k}": v for k, v in ret.items()}})

    rows, totals = [], {}
    for source in config.sources:
        for sp in sparsities:
            cell = [r for r in per_draw if r["source"] == source and r["sparsity"] == sp]
            for cap in (*capabilities, "total"):
                vals = [r["retention"][cap] for r in cell]
                rows.append({"source": source, "sparsity": sp, "capability": cap,
                             "retention": float(np.mean(vals)), "retention_std": float(np.std(vals)),
                             "draws": len(vals)})
            totals.setdefault(source, {})[str(sp)] = rows[-1]["retention"]
    mean_ppl = {s: float(np.mean(v)) for s, v in perplexity.items()}
    ppl_list = [mean_ppl[s] for s in config.sources]
    intervals = {}
    for sp in sparsities:
        intervals[str(sp)] = {}
        for cap in (*capabilities, "total"):
            ret = [next(r["retention"] for r in rows if r["source"] == s and r["sparsity"] == sp
                        and r["capability"] == cap) for s in config.sources]
            intervals[str(sp)][cap] = bootstrap_spearman(ppl_list, ret, n_boot=config.bootstrap,
                                                         seed=config.seed)
    rho_sparsity = 0.6 if 0.6 in sparsities else sparsities[0]
    spearman_map = {cap: v["rho"] for cap, v in intervals[str(rho_sparsity)].items()}
    singles = [s for s in config.sources if s not in ("mix", "igsp")]
    at = str(rho_sparsity)
    best_single = max(singles, key=lambda s: totals[s][at]) if singles else None
    return {
        "model": {k: getattr(model_cfg, k) for k in ("d_model", "n_layers", "n_heads", "d_ff")},
        "params": int(sum(np.size(x) for x in jax.tree.leaves(dense_params))),
        "capabilities": list(capabilities),
        "retention": rows,
        "spearman": spearman_map,
        "spearman_sparsity": rho_sparsity,
        "spearman_intervals": intervals,
        "total_retention": totals,
        "perplexity": mean_ppl,
        "dense_scores": dense_scores,
        "best_single_source": {"source": best_single, "total_retention": totals[best_single][at]}
        if best_single else None,
        "dense_cache": str(cache),
        "per_draw": per_draw,
    }


def sign_stability_across(sizes: dict[str, dict]) -> dict[str, dict]:
    """Per capability (and ``total``), :func:`~jaxflow.prune.correlation.sign_stability` of the
    Spearman intervals of every size x sparsity cell (``"<size>@<sparsity>"``)."""
    capabilities = next(iter(sizes.values()))["capabilities"]
    stability = {}
    for cap in (*capabilities, "total"):
        cells = {f"{name}@{sp}": s["spearman_intervals"][sp][cap]
                 for name, s in sizes.items() for sp in s["spearman_intervals"]}
        stability[cap] = sign_stability(cells)
    return stability
