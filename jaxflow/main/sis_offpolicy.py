"""The ``sis_offpolicy`` experiment: a grid of GRPO runs under off-policy knobs, +/- SIS.

See ``configs/sis_offpolicy.py`` for the grid. Each cell is an independent RL run from the same
warm start; its curve (held-out greedy accuracy vs rollout) goes to ``metrics.jsonl`` (rows
carry ``cell``; the x axis is a global step ``cell_index * rollouts + rollout``) and to
``cells.jsonl`` when the cell finishes. ``plots/sis_offpolicy_*.png`` overlay the curves.

Resume (``--resume``): finished cells (``cells.jsonl``) are skipped; the running cell continues
from its latest checkpoint (``checkpoints/<cell>/``) bit-exactly. Each cell trains through
:func:`jaxflow.train.loop.run_steps`, so ``--kill-after-checkpoint=N`` (the resume tests'
crash) counts the global step above.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from typing import NamedTuple

import numpy as np

from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.plots import read_metrics
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import RolloutWorker
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.stats import normalized_auc, paired_interval
from jaxflow.sync.replica import tree_digest
from jaxflow.train.lm_state import lm_functions
from jaxflow.train.loop import run_steps


class Cell(NamedTuple):
    """One RL run. ``lr_scale`` multiplies ``optim.lr``; ``prompts`` > 0 replaces
    ``rl.prompts_per_rollout`` (rows = prompts x group size), 0 keeps it."""

    algo: str
    correction: str
    mismatch: str
    lag: int
    staleness: int
    seed: int
    lr_scale: float = 1.0
    prompts: int = 0

    @property
    def label(self) -> str:
        extra = (f"-lr{self.lr_scale:g}" if self.lr_scale != 1.0 else "") + (
            f"-p{self.prompts}" if self.prompts else "")
        return (f"{self.algo}-{self.correction}-{self.mismatch}-lag{self.lag}-k{self.staleness}"
                f"{extra}-s{self.seed}")

    @property
    def group(self) -> tuple:
        return (*self[:5], self.lr_scale, self.prompts)


def _group_key(rec: dict) -> tuple:
    """(algo, correction, mismatch, lag, staleness, lr_scale, prompts) of a cells.jsonl record
    (records written before the last two fields existed have the defaults)."""
    return (rec["algo"], rec["correction"], rec["mismatch"], rec["lag"], rec["staleness"],
            rec.get("lr_scale", 1.0), rec.get("prompts", 0))


def grid_cells(grid) -> list[Cell]:
    """Every cell of the grid, seeds innermost, duplicates dropped (in order); the
    ``extra_lags`` block has ``extra_lag_seeds`` seeds, every other block ``seeds``."""
    keys: list[tuple] = []
    keys += [(a, c, "none", n, 0) for a in grid.algos for c in grid.corrections for n in grid.lags]
    keys += [(a, c, m, grid.mismatch_lag, 0) for m in grid.mismatches
             for a in grid.mismatch_algos for c in grid.mismatch_corrections]
    keys += [(a, c, "none", 1, k) for k in grid.stalenesses
             for a in grid.staleness_algos for c in grid.corrections]
    n_main = len(keys)
    keys += [(a, c, "none", n, 0) for a in grid.algos for c in grid.corrections
             for n in grid.extra_lags]
    seen, cells = set(), []
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            seeds = grid.seeds if i < n_main else grid.extra_lag_seeds
            cells += [Cell(*key, seed=s) for s in range(seeds)]
    return cells


def _load_done(run: RunContext) -> dict[str, dict]:
    path = run.out_dir / "cells.jsonl"
    if not run.resume or not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["label"]: r for r in rows}


def _append_done(run: RunContext, row: dict) -> None:
    if run.is_primary:
        with open(run.out_dir / "cells.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def run_cell(cell: Cell, index: int, config, run: RunContext, *, meshes, warm_params,
             initial_accuracy: tuple[float, float]) -> dict:
    """One RL run through :func:`jaxflow.train.loop.run_steps` (its rows carry ``cell`` and
    ``rollout``; global step ``index * rollouts + rollout``); returns its record for
    cells.jsonl. Resumes from ``checkpoints/<cell>/`` with ``run.resume``; the rows of the
    rollouts before the checkpoint are read back from metrics.jsonl."""
    sched = config.train
    loss = dataclasses.replace(config.rl.loss, algo=cell.algo, correction=cell.correction)
    rl = dataclasses.replace(config.rl, loss=loss, mismatch=cell.mismatch, lag=cell.lag,
                             staleness=cell.staleness,
                             prompts_per_rollout=cell.prompts or config.rl.prompts_per_rollout)
    optim = dataclasses.replace(config.optim, lr=config.optim.lr * cell.lr_scale)
    started = time.perf_counter()
    trainer = GRPOTrainer(config.pretrain.model, rl, optim, _task(config), _tokenizer(config),
                          meshes, seed=config.seed * 1000 + cell.seed,
                          total_rollouts=sched.rollouts, sync=config.sync)
    ckpt = Checkpointer(run.checkpoint_dir / cell.label, save_every=sched.checkpoint_every,
                        max_to_keep=1)

    step_seconds: list[float] = []

    def rl_step(state, step):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state)
        step_seconds.append(time.perf_counter() - t0)
        return state, {"rollout": step + 1, **metrics}

    def evaluate(state, done):
        return {"heldout_accuracy": trainer.heldout_accuracy(state, sched.eval_examples,
                                                             samples=sched.eval_samples),
                "heldout_greedy_accuracy": trainer.heldout_accuracy(state, sched.eval_examples)}

    result = run_steps(rl_step, trainer.init_state(warm_params), steps=sched.rollouts, run=run,
                       checkpointer=ckpt, log_every=1, summarize=rollout_row, eval_fn=evaluate,
                       eval_every=sched.eval_every, step_offset=index * sched.rollouts,
                       row_fields={"cell": cell.label})
    resumed = [row for row in read_metrics(run.out_dir / "metrics.jsonl")
               if row.get("cell") == cell.label and row["rollout"] <= result.start
               ] if result.start else []
    history = resumed + result.rows
    evaluated = [h for h in history if "heldout_accuracy" in h]
    curve = [(0, initial_accuracy[0])] + [(h["rollout"], h["heldout_accuracy"]) for h in evaluated]
    greedy = [(0, initial_accuracy[1])] + [(h["rollout"], h["heldout_greedy_accuracy"])
                                           for h in evaluated]
    state = result.state

    def mean_of(key, rows):
        vals = [h[key] for h in rows if key in h]
        return float(np.mean(vals)) if vals else None

    return {
        "label": cell.label, **cell._asdict(),
        "final_accuracy": curve[-1][1],
        "final_greedy_accuracy": greedy[-1][1],
        "auc": normalized_auc(curve),  # mean held-out pass@1 over training (trapezoid)
        "curve": curve,
        "greedy_curve": greedy,
        "accept_rate": mean_of("actor/accept_rate", history),
        "accept_rate_first": mean_of("actor/accept_rate_first", history),
        "accept_rate_later": mean_of("actor/accept_rate_later", history),
        "clip_fraction": mean_of("actor/pg_clipfrac", history),
        "d_original": mean_of("actor/d_original", history),
        "d_sis": mean_of("actor/d_sis", history),
        "sis_accept_expected": mean_of("actor/sis_accept_expected", history),
        # wall seconds of this process's rollouts (sample + update; evaluation excluded), the
        # first rollout (compile) dropped: median per rollout, and the cell's total
        "rollout_seconds_median": (float(np.median(step_seconds[1:])) if len(step_seconds) > 1
                                   else None),
        "cell_seconds": time.perf_counter() - started,
        "reward_first": history[0]["critic/rewards/mean"] if history else None,
        "reward_last": history[-1]["critic/rewards/mean"] if history else None,
        # fresh training prompts every rollout: an unbiased train-distribution pass rate
        "reward_last5": mean_of("critic/rewards/mean", history[-5:]),
        "params_checksum": tree_digest(state["policy"].params),
    }


def aggregate(records: list[dict]) -> list[dict]:
    """Rows {algo, correction, mismatch, lag, staleness, seeds, acc_mean, acc_std, ...}.

    acc = final held-out pass@1 at the RL temperature (``train.eval_samples`` samples per
    prompt); greedy_acc = final held-out greedy accuracy. Stds are sample stds over seeds
    (ddof=1; 0.0 for one seed)."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(_group_key(rec), []).append(rec)
    rows = []
    for (algo, corr, mismatch, lag, k, lr_scale, prompts), recs in groups.items():
        accs = np.array([r["final_accuracy"] for r in recs], np.float64)
        greedy = np.array([r["final_greedy_accuracy"] for r in recs], np.float64)

        def avg(key):
            vals = [r[key] for r in recs if r.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        rows.append({
            "algo": algo, "correction": corr, "mismatch": mismatch, "lag": lag, "staleness": k,
            "lr_scale": lr_scale, "prompts": prompts, "seeds": len(recs),
            "acc_mean": float(accs.mean()),
            "acc_std": float(accs.std(ddof=1)) if len(accs) > 1 else 0.0,
            "acc_per_seed": accs.tolist(),
            "auc_mean": float(np.mean([normalized_auc(r["curve"]) for r in recs])),
            "greedy_acc_mean": float(greedy.mean()),
            "greedy_acc_std": float(greedy.std(ddof=1)) if len(greedy) > 1 else 0.0,
            # SIS accept rates (None without SIS); "later" = mini-batches 2..N of a rollout
            "accept_rate": avg("accept_rate") if corr.startswith("sis") else None,
            "accept_rate_later": avg("accept_rate_later") if corr.startswith("sis") else None,
            "clip_fraction": avg("clip_fraction"),
            "d_original": avg("d_original"),
            "sis_accept_expected": avg("sis_accept_expected"),
            "reward_first": avg("reward_first"),
            "reward_last": avg("reward_last"),
            "reward_last5": avg("reward_last5"),
        })
    return rows


def _final_accuracy(record: dict) -> float:
    return record["final_accuracy"]


def _auc(record: dict) -> float:
    return normalized_auc(record["curve"])


def paired_differences(records: list[dict], *, control: str = "none",
                       level: float = 0.95) -> list[dict]:
    """Per (algo, mismatch, lag, staleness) and correction != ``control``: the paired
    correction-minus-control difference over the seeds both ran (same seed = same warm start,
    prompts and sampling keys), of the final held-out pass@1 (``final``) and of the area under
    the pass@1 curve divided by its length (``auc``; :func:`jaxflow.stats.normalized_auc`).
    Each as mean, t-interval half width and bootstrap bounds
    (:func:`jaxflow.stats.paired_interval`)."""
    by: dict[tuple, dict[str, dict[int, dict]]] = {}
    for rec in records:
        algo, corr, mismatch, lag, k, lr_scale, prompts = _group_key(rec)
        key = (algo, mismatch, lag, k, lr_scale, prompts)
        by.setdefault(key, {}).setdefault(corr, {})[rec["seed"]] = rec
    rows = []
    for (algo, mismatch, lag, k, lr_scale, prompts), corrs in by.items():
        if control not in corrs:
            continue
        for corr, recs in corrs.items():
            seeds = sorted(set(recs) & set(corrs[control]))
            if corr == control or not seeds:
                continue
            row = {"algo": algo, "correction": corr, "control": control, "mismatch": mismatch,
                   "lag": lag, "staleness": k, "lr_scale": lr_scale, "prompts": prompts,
                   "pairs": len(seeds)}
            for name, value in (("final", _final_accuracy), ("auc", _auc)):
                iv = paired_interval([value(recs[s]) for s in seeds],
                                     [value(corrs[control][s]) for s in seeds], level=level)
                row.update({f"{name}_diff": iv.mean, f"{name}_half_width": iv.half_width,
                            f"{name}_sd": iv.sd, f"{name}_boot": [iv.boot_low, iv.boot_high]})
            rows.append(row)
    return rows


def format_paired_table(rows: list[dict]) -> str:
    """A markdown table of :func:`paired_differences` rows (95% t-intervals, bootstrap)."""
    head = ("| algo | correction - control | mismatch | lag | k | pairs | final pass@1 diff "
            "(95% t) | bootstrap | AUC diff (95% t) | bootstrap |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    def iv(m, h):
        return f"{m:+.3f} +- {h:.3f}"

    def bt(b):
        return f"[{b[0]:+.3f}, {b[1]:+.3f}]"

    lines = [f"| {r['algo']} | {r['correction']} - {r['control']} | {r['mismatch']} | "
             f"{r['lag']} | {r['staleness']} | {r['pairs']} | "
             f"{iv(r['final_diff'], r['final_half_width'])} | {bt(r['final_boot'])} | "
             f"{iv(r['auc_diff'], r['auc_half_width'])} | {bt(r['auc_boot'])} |" for r in rows]
    return "\n".join([head, *lines])


def format_table(rows: list[dict]) -> str:
    """A markdown table of the results rows."""
    head = ("| algo | correction | mismatch | lag | k | seeds | acc_mean | acc_std | greedy_mean | "
            "greedy_std | train reward (last 5) | accept | accept (mb>1) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"| {r['algo']} | {r['correction']} | {r['mismatch']} | {r['lag']} | "
             f"{r['staleness']} | {r['seeds']} | {r['acc_mean']:.3f} | {r['acc_std']:.3f} | "
             f"{r['greedy_acc_mean']:.3f} | {r['greedy_acc_std']:.3f} | {fmt(r['reward_last5'])} | "
             f"{fmt(r['accept_rate'])} | {fmt(r['accept_rate_later'])} |" for r in rows]
    return "\n".join([head, *lines])


def plot_curves(run: RunContext, records: list[dict]) -> None:
    """plots/sis_offpolicy_<algo>.png: seed-mean held-out accuracy vs rollout, one line per
    (correction, mismatch, lag, staleness)."""
    if not run.is_primary or not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_algo: dict[str, dict[tuple, list]] = {}
    for rec in records:
        key = (rec["correction"], rec["mismatch"], rec["lag"], rec["staleness"])
        by_algo.setdefault(rec["algo"], {}).setdefault(key, []).append(rec["curve"])
    out = run.out_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for algo, lines in by_algo.items():
        fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
        for (corr, mismatch, lag, k), curves in sorted(lines.items()):
            steps = [s for s, _ in curves[0]]
            acc = np.mean([[a for _, a in c] for c in curves if len(c) == len(steps)], axis=0)
            style = "-" if corr.startswith("sis") else "--"
            ax.plot(steps, acc, style, marker="o", ms=3,
                    label=f"{corr} {mismatch} N={lag} k={k} ({len(curves)} seeds)")
        ax.set_xlabel("rollout")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"sis_offpolicy: {algo}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"sis_offpolicy_{algo}.png")
        plt.close(fig)


def _task(config):
    """The RL task of the warm start's corpus: worked addition when the pretraining data
    config builds its own corpus (``configs.flagship.WorkedDataConfig``), else addition."""
    if hasattr(config.pretrain.data, "make_corpus"):
        return config.pretrain.data.make_corpus()
    return AdditionRLTask(max_digits=config.pretrain.data.max_digits,
                          heldout_mod=config.pretrain.data.heldout_mod)


def pass_at_1_definition(config) -> dict:
    """How the headline accuracy (``acc``) is measured; written into the summary."""
    return {"temperature": config.rl.temperature, "samples_per_prompt": config.train.eval_samples,
            "heldout_prompts": config.train.eval_examples,
            "sampling_key": "fixed (jax.random.key(0)), the same for every cell and rollout",
            "greedy": "heldout_greedy_accuracy / greedy_acc: temperature 0, same prompts"}


def _tokenizer(config):
    """The checkpoint's tokenizer.json with ``model.hf_path``, else the character tokenizer."""
    if config.model.hf_path:
        from jaxflow.models.tokenizer_hf import HFTokenizer

        return HFTokenizer.from_pretrained(config.model.hf_path)
    return CharTokenizer()


def warm_start_accuracy(config, meshes, params) -> tuple[float, float]:
    """(sampled pass@1, greedy) held-out accuracy of ``params``: the curves' point 0."""
    worker = RolloutWorker(config.pretrain.model, meshes["rollout"], config.rl.rollout_spec,
                           _task(config), _tokenizer(config))
    params = publish_weights(params, worker.param_shardings)
    n = config.train.eval_examples
    return (worker.heldout_accuracy(params, n, samples=config.train.eval_samples),
            worker.heldout_accuracy(params, n))


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(config.roles)
    run.info(f"roles: {roles}")
    if config.model.hf_path:  # a local HF checkpoint replaces the lm_pretrain warm start
        from jaxflow.models.pretrained import load_policy

        model_cfg, warm_params, _ = load_policy(config.model.hf_path, meshes["trainer"])
        config = dataclasses.replace(config, pretrain=dataclasses.replace(config.pretrain,
                                                                          model=model_cfg))
        pre_summary = {"hf_path": config.model.hf_path}
        run.info(f"policy from {config.model.hf_path}: {model_cfg.architecture}")
    else:
        fns = lm_functions(config.pretrain.model, meshes["trainer"])
        warm_params, pre_summary = load_pretrained_params(config.pretrain, config.cache_root,
                                                          fns, log=run.info)
    cells = grid_cells(config.grid)
    done = _load_done(run)
    run.set_total_steps(len(cells) * config.train.rollouts, "sis_offpolicy")
    initial_accuracy = warm_start_accuracy(config, meshes, warm_params)
    run.info(f"warm start held-out accuracy: sampled {initial_accuracy[0]:.3f}, "
             f"greedy {initial_accuracy[1]:.3f}")
    records = []
    for index, cell in enumerate(cells):
        if cell.label in done:
            records.append(done[cell.label])
            continue
        record = run_cell(cell, index, config, run, meshes=meshes, warm_params=warm_params,
                          initial_accuracy=initial_accuracy)
        _append_done(run, record)
        shutil.rmtree(run.checkpoint_dir / cell.label, ignore_errors=True)
        run.info(f"{cell.label}: accuracy {record['final_accuracy']:.3f}, greedy "
                 f"{record['final_greedy_accuracy']:.3f} (first-rollout reward "
                 f"{record['reward_first']:.3f}), accept {record['accept_rate']:.3f}")
        records.append(record)
    rows = aggregate(records)
    paired = paired_differences(records)
    run.write_json("results.json", rows)
    if run.is_primary:
        tables = format_table(rows) + "\n\n" + format_paired_table(paired) + "\n"
        (run.out_dir / "results.md").write_text(tables)
        run.info("results:\n" + tables)
    plot_curves(run, records)
    rewards = [r["reward_first"] for r in records if r.get("reward_first") is not None]
    return {
        "results": rows,
        "paired": paired,
        "pass_at_1": pass_at_1_definition(config),
        "cells_run": [r["label"] for r in records],
        "roles": roles,
        "warm_start": {"cache": cache_dir(config.pretrain, config.cache_root).name,
                       "pretrain_heldout_accuracy": pre_summary.get("heldout_accuracy"),
                       "heldout_accuracy": initial_accuracy[0],
                       "heldout_greedy_accuracy": initial_accuracy[1],
                       "first_rollout_reward_mean": float(np.mean(rewards)) if rewards else None},
        "params_checksums": {r["label"]: r["params_checksum"] for r in records},
    }
