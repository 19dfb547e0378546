"""The ``flagship`` experiment: GRPO + SIS on worked addition, trainer and sampler on disjoint
sub-meshes, weights to the sampler through SparseRL-Sync (see ``configs/flagship.py``).

``seeds`` runs (``quick``: 1, ``default``: 3): run k trains its own warm start
(``pretrain.seed + k``) and RL at seed ``seed + k``. Per rollout ``metrics.jsonl`` gets the
reward, the SIS accept rate (all mini-batches and mini-batches 2..N), the sync payload, the
run's ``seed_index``; every ``eval.every`` rollouts the held-out pass@1. The summary's headline
figures (held-out pass@1 initial / final / gain, sync ratio) are means over the runs with a 95%
t-interval under ``seed_interval`` (none for one run); per-run values under ``per_seed``.
``plots/flagship.png`` shows reward, held-out pass@1 and accept rate against the rollout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.stats import paired_interval
from jaxflow.train.lm_state import lm_functions
from jaxflow.train.loop import run_steps

#: Summary keys that carry a mean and a 95% seed interval.
HEADLINE_KEYS = ("heldout_pass_at_1_initial", "heldout_pass_at_1_final",
                 "heldout_pass_at_1_gain", "sync_ratio_vs_dense")


def pass_at_1_definition(config) -> dict:
    """How every pass@1 of this run is measured (written into the summary)."""
    return {"temperature": config.rl.temperature, "samples_per_prompt": config.eval.samples,
            "heldout_prompts": config.eval.prompts, "split": "held out (hash of the operands)",
            "sampling_key": "fixed (jax.random.key(0)), the same at every evaluation",
            "reward": "1 iff the whole working and the sum are correct"}


def sync_ratio_vs_dense(records) -> tuple[float, int, int]:
    """(ratio, dense bytes, sent bytes) over every publish (``records``: the
    ``jaxflow.sync.weight_sync.SyncRecord`` of each, in order; None or empty: no sync), the
    first full copy of the weights to the replica included (counted as dense on both sides)."""
    if not records:
        return float("nan"), 0, 0
    full = records[0].stats.dense_bytes
    dense = full + sum(r.stats.dense_bytes for r in records)
    sent = full + sum(r.stats.payload_bytes for r in records)
    return dense / sent, dense, sent


def seed_interval(values, *, level: float = 0.95) -> dict:
    """Mean of ``values`` ([n], one per seed) with a two-sided t-interval.

    Returns ``{"n", "mean", "sd", "half_width", "low", "high", "level"}``: ``half_width`` =
    t_{(1+level)/2, n-1} * sd / sqrt(n) (sd with ddof 1), ``[low, high]`` = mean +- half_width;
    with one value the interval is undefined and ``sd`` / ``half_width`` / ``low`` / ``high``
    are None."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("seed_interval needs at least one value")
    # the interval of mean(values - 0): jaxflow.stats' t-interval for one sample
    pi = paired_interval(vals, [0.0] * len(vals), level=level)
    if pi.n == 1:
        return {"n": 1, "mean": pi.mean, "sd": None, "half_width": None, "low": None,
                "high": None, "level": level}
    return {"n": pi.n, "mean": pi.mean, "sd": pi.sd, "half_width": pi.half_width,
            "low": pi.mean - pi.half_width, "high": pi.mean + pi.half_width, "level": level}


def summarize_seeds(per_seed: list[dict]) -> dict:
    """Headline means and intervals over per-run summaries (each with the
    :data:`HEADLINE_KEYS`; a None ``sync_ratio_vs_dense`` means sync=none and stays None)."""
    out: dict = {"seeds": len(per_seed)}
    intervals = {}
    for key in HEADLINE_KEYS:
        vals = [s[key] for s in per_seed]
        if any(v is None for v in vals):
            out[key] = None
            continue
        intervals[key] = seed_interval(vals)
        out[key] = intervals[key]["mean"]
    out["seed_interval"] = intervals
    if len(per_seed) == 1:
        out["seed_note"] = ("one seed: the figures are that run's, with no interval (the default "
                            "variant runs 3 seeds and gives 95% t-intervals)")
    else:
        out["seed_note"] = (f"means over {len(per_seed)} runs, each with its own warm start "
                            "and RL seed; 95% t-intervals under seed_interval")
    return out


def plot_flagship(run: RunContext, runs: list[tuple[list[dict], list[tuple[int, float]]]]) -> None:
    """plots/flagship.png: reward, held-out pass@1 and SIS accept rate vs rollout, one line per
    seed (``runs``: per seed, its metric rows and its (rollout, pass@1) evaluations)."""
    if not run.is_primary:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3), dpi=90)
    for k, (rows, evals) in enumerate(runs):
        tag = f"seed {k}: " if len(runs) > 1 else ""
        x = [r["rollout"] for r in rows]
        axes[0].plot(x, [r["reward_mean"] for r in rows], lw=1.2)
        axes[1].plot(*zip(*evals), marker="o", ms=3)
        axes[2].plot(x, [r["accept_rate"] for r in rows], lw=1.2, label=f"{tag}all mini-batches")
        if "accept_rate_later" in rows[0]:
            axes[2].plot(x, [r["accept_rate_later"] for r in rows], lw=1.2, ls="--",
                         label=f"{tag}mini-batches 2..N")
    axes[0].set_ylabel("training reward")
    axes[1].set_ylabel("held-out pass@1")
    axes[2].legend(fontsize=6)
    axes[2].set_ylabel("SIS accept rate")
    for ax in axes:
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    run.save_figure(fig, "flagship.png")


def run_seed(config, run: RunContext, k: int, meshes, fns) -> tuple[dict, list, list]:
    """Run ``k`` of the experiment: warm start ``pretrain.seed + k``, RL seed ``seed + k``.
    Returns (its summary, its metric rows, its (rollout, pass@1) evaluations)."""
    pretrain = dataclasses.replace(config.pretrain, seed=config.pretrain.seed + k)
    warm_params, pre_summary = load_pretrained_params(pretrain, config.cache_root, fns,
                                                      log=run.info)
    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim, config.task,
                          CharTokenizer(), meshes, seed=config.seed + k,
                          total_rollouts=config.rollouts, sync=config.sync)
    state = trainer.init_state(warm_params)

    def pass_at_1(st) -> float:
        return trainer.heldout_accuracy(st, config.eval.prompts, samples=config.eval.samples)

    initial = pass_at_1(state)
    run.info(f"seed {k}: warm start held-out pass@1 {initial:.3f}")
    records = []  # the SyncRecord of every publish that went through the weight sync

    def rl_step(state, step):
        state, metrics, record = trainer.step_with_sync(state)
        if record is not None:
            records.append(record)
        return state, {"rollout": step + 1, "seed_index": k, **metrics}

    result = run_steps(rl_step, state, steps=config.rollouts, run=run, log_every=1,
                       summarize=rollout_row,
                       eval_fn=lambda st, done: {"heldout_pass_at_1": pass_at_1(st)},
                       eval_every=config.eval.every, step_offset=k * config.rollouts)
    state, rows = result.state, result.rows
    evals = [(0, initial)] + [(r["rollout"], r["heldout_pass_at_1"]) for r in rows
                              if "heldout_pass_at_1" in r]
    ws = trainer.weight_sync
    ratio, dense, sent = sync_ratio_vs_dense(records)
    final = evals[-1][1]
    run.info(f"seed {k}: held-out pass@1 {initial:.3f} -> {final:.3f}" + (
        f"; sync ratio vs dense bf16 {ratio:.2f}x ({dense} / {sent} bytes)" if ws else ""))
    later = [r["accept_rate_later"] for r in rows if "accept_rate_later" in r]
    summary = {
        "rl_seed": config.seed + k,
        "warm_start_seed": pretrain.seed,
        "heldout_pass_at_1_initial": initial,
        "heldout_pass_at_1_final": final,
        "heldout_pass_at_1_gain": final - initial,
        "heldout_pass_at_1_curve": evals,
        "heldout_greedy_accuracy_final": trainer.heldout_accuracy(state, config.eval.prompts),
        "sync_ratio_vs_dense": ratio if ws else None,  # None: sync=none (dense f32)
        "sync_dense_bytes": dense,
        "sync_sent_bytes": sent,
        "sync_publishes": len(records),
        "sync_bit_exact": all(r.bit_exact for r in records) if ws else None,
        "reward_first5": float(np.mean([r["reward_mean"] for r in rows[:5]])),
        "reward_last5": float(np.mean([r["reward_mean"] for r in rows[-5:]])),
        "accept_rate_later": float(np.mean(later)) if later else None,
        "warm_start": {"cache": cache_dir(pretrain, config.cache_root).name,
                       "pretrain_heldout_greedy_accuracy": pre_summary.get("heldout_accuracy")},
    }
    return summary, rows, evals


def compile_programs(config, meshes) -> list:
    """``--compile-only``: the programs one RL step of run 0 executes (the trainer's own
    jitted functions, :func:`jaxflow.rl.programs.grpo_programs`) on ``meshes`` (trainer /
    rollout, from :func:`jaxflow.mesh.trainer_rollout_meshes` on the target's devices)."""
    from jaxflow.rl.programs import grpo_programs

    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim, config.task,
                          CharTokenizer(), meshes, seed=config.seed,
                          total_rollouts=config.rollouts, sync=config.sync)
    return grpo_programs(trainer)


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(config.roles)
    run.info(f"roles: {roles}")
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    run.set_total_steps(config.seeds * config.rollouts, "flagship")
    per_seed, curves = [], []
    for k in range(config.seeds):
        summary, rows, evals = run_seed(config, run, k, meshes, fns)
        per_seed.append(summary)
        curves.append((rows, evals))
    plot_flagship(run, curves)
    head = summarize_seeds(per_seed)
    if config.seeds > 1:
        run.info("over seeds: " + "; ".join(
            f"{key} {iv['mean']:.3f} +- {iv['half_width']:.3f}"
            for key, iv in head["seed_interval"].items()))
    synced = [s for s in per_seed if s["sync_bit_exact"] is not None]
    return {
        **head,
        "pass_at_1": pass_at_1_definition(config),
        "sync_bit_exact": all(s["sync_bit_exact"] for s in synced) if synced else None,
        "per_seed": per_seed,
        "roles": roles,
        "task": dataclasses.asdict(config.task),
    }
