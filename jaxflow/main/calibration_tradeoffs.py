"""The ``calibration_tradeoffs`` experiment: which calibration source preserves which capability.

For every model size x calibration source x independent draw: build the calibration set,
measure its perplexity under the dense model, prune the dense capability model at every
sparsity (SparseGPT, sequential), score every capability and report retention = pruned /
dense. Then, per size and sparsity, the Spearman correlation across sources of calibration
perplexity with each capability's retention (the paper at 0.6: +0.71 General, -0.53 Math,
-0.59 Code), with a bootstrap interval over sources, and whether each correlation keeps its
sign across sizes and sparsities.

With ``--set model.hf_path=DIR`` the dense model is a local checkpoint (one size), and
``eval_files`` / ``calibration_files`` replace the synthetic capability world
(``jaxflow.prune.task_files``).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.prune.calibration import MODEL_SOURCES, calibration_set
from jaxflow.prune.capabilities import CapabilityEvaluator, make_tokenizer, make_world, retention
from jaxflow.prune.correlation import bootstrap_spearman, sign_stability, spearman
from jaxflow.prune.dense import load_or_train_dense, train_dense
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.selfgen import packed_perplexity
from jaxflow.prune.sequential import prune
from jaxflow.prune.task_files import TaskFileError, load_calibration_files, load_task_files
from jaxflow.train.lm_state import lm_functions

__all__ = ["main", "spearman"]

PAPER = {
    "spearman_at_0.6": {"general": 0.71, "math": -0.53, "code": -0.59},
    "total_retention_llama31_8b": {"mix": 0.588, "best_single_source(metamath)": 0.500, "c4": 0.400},
    "averaged_vs_code_gap_points": {"commonsense_avg_acc": 2.85, "code_retention": 51.9},
}


def _sparsity_value(text: str):
    pattern = parse_sparsity(text)
    return str(pattern) if pattern.is_nm else pattern.fraction


def _split_rows(batch: dict, rows: int) -> list[dict]:
    n = batch["tokens"].shape[0]
    keys = ("tokens", "segment_ids", "positions")
    return [{k: batch[k][i:i + rows] for k in keys} for i in range(0, n, rows)]


def _check_encodable(tokenizer, task_sets, documents) -> None:
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


def _study(config, model_cfg, mesh, run: RunContext, *, hf, task_sets, documents, size: str,
           progress: list[int], total: int) -> dict:
    """The whole grid on one dense model; returns that size's summary."""
    fns = lm_functions(model_cfg, mesh)
    tokenizer = make_tokenizer() if hf is None else hf[2]
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} < tokenizer's {tokenizer.vocab_size}")
    _check_encodable(tokenizer, task_sets, documents)
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

    sparsities = [_sparsity_value(s) for s in config.sparsities]
    per_draw: list[dict] = []
    perplexity: dict[str, list[float]] = {s: [] for s in config.sources}
    for draw in range(config.draws):
        for source in config.sources:
            extra = {"fns": fns, "params": dense_params} if source in MODEL_SOURCES else {}
            calib = calibration_set(source, world=world, tokenizer=tokenizer, cfg=config.calibration,
                                    draw=config.seed * 1000 + draw, documents=documents, **extra)
            ppl = packed_perplexity(fns, dense_params, calib)
            perplexity[source].append(ppl)
            batches = _split_rows(calib, config.calib_batch_rows)
            for sp in sparsities:
                start = time.time()
                pruned, _ = prune(dense_params, batches, sp, method=config.method,
                                  model_config=model_cfg, block_size=config.block_size)
                scores = evaluator(pruned)
                ret = retention(scores, dense_scores)
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


def main(config, run: RunContext) -> dict:
    mesh = config.mesh.make()
    task_sets = load_task_files(config.eval_files) if config.eval_files else None
    documents = load_calibration_files(config.calibration_files) if config.calibration_files else None
    hf = None
    models = config.size_models()
    if config.model.hf_path:  # --set model.hf_path=DIR: prune a local HF checkpoint instead
        from jaxflow.models.pretrained import load_policy

        hf = load_policy(config.model.hf_path, mesh)
        models = [("hf", hf[0])]
        run.info(f"dense model from {config.model.hf_path}: {hf[0].architecture}")
    total = len(models) * len(config.sources) * config.draws * len(config.sparsities)
    progress = [0]
    sizes = {}
    for name, model_cfg in models:
        sizes[name] = _study(config, model_cfg, mesh, run, hf=hf, task_sets=task_sets,
                             documents=documents, size=name, progress=progress,
                             total=total)
    run.write_json("per_draw.json", [r for s in sizes.values() for r in s.pop("per_draw")])
    capabilities = next(iter(sizes.values()))["capabilities"]
    stability = {}
    for cap in (*capabilities, "total"):
        cells = {f"{name}@{sp}": s["spearman_intervals"][sp][cap]
                 for name, s in sizes.items() for sp in s["spearman_intervals"]}
        stability[cap] = sign_stability(cells)
    largest = sizes[models[-1][0]]
    return {
        **{k: v for k, v in largest.items() if k != "model"},  # the largest size, as before
        "sizes": sizes,
        "sign_stability": stability,
        "draws": config.draws,
        "bootstrap": config.bootstrap,
        "method": config.method,
        "paper": PAPER,
    }
