"""The ``flagship`` experiment: GRPO + SIS on worked addition, trainer and sampler on disjoint
sub-meshes, weights to the sampler through SparseRL-Sync (see ``configs/flagship.py``).

Per rollout ``metrics.jsonl`` gets the reward, the SIS accept rate (all mini-batches and
mini-batches 2..N), the sync payload; every ``eval.every`` rollouts the held-out pass@1.
``plots/flagship.png`` shows reward, held-out pass@1 and accept rate against the rollout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.rl.grpo import GRPOTrainer
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.train.lm_state import lm_functions


def pass_at_1_definition(config) -> dict:
    """How every pass@1 of this run is measured (written into the summary)."""
    return {"temperature": config.rl.temperature, "samples_per_prompt": config.eval.samples,
            "heldout_prompts": config.eval.prompts, "split": "held out (hash of the operands)",
            "sampling_key": "fixed (jax.random.key(0)), the same at every evaluation",
            "reward": "1 iff the whole working and the sum are correct"}


def sync_ratio_vs_dense(weight_sync) -> tuple[float, int, int]:
    """(ratio, dense bytes, sent bytes) over every publish, the first full copy of the weights
    to the replica included (counted as dense on both sides)."""
    if weight_sync is None or not weight_sync.records:
        return float("nan"), 0, 0
    full = weight_sync.records[0].stats.dense_bytes
    dense = full + sum(r.stats.dense_bytes for r in weight_sync.records)
    sent = full + sum(r.stats.payload_bytes for r in weight_sync.records)
    return dense / sent, dense, sent


def plot_flagship(run: RunContext, rows: list[dict], evals: list[tuple[int, float]]) -> None:
    """plots/flagship.png: reward, held-out pass@1 and SIS accept rate vs rollout."""
    if not run.is_primary:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3), dpi=90)
    x = [r["rollout"] for r in rows]
    axes[0].plot(x, [r["reward_mean"] for r in rows], lw=1.2)
    axes[0].set_ylabel("training reward")
    axes[1].plot(*zip(*evals), marker="o", ms=3)
    axes[1].set_ylabel("held-out pass@1")
    axes[2].plot(x, [r["accept_rate"] for r in rows], lw=1.2, label="all mini-batches")
    if "accept_rate_later" in rows[0]:
        axes[2].plot(x, [r["accept_rate_later"] for r in rows], lw=1.2, label="mini-batches 2..N")
        axes[2].legend(fontsize=7)
    axes[2].set_ylabel("SIS accept rate")
    for ax in axes:
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    run.save_figure(fig, "flagship.png")


def main(config, run: RunContext) -> dict:
    meshes, roles = trainer_rollout_meshes(config.roles)
    run.info(f"roles: {roles}")
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    warm_params, pre_summary = load_pretrained_params(config.pretrain, config.cache_root, fns,
                                                      log=run.info)
    tokenizer = CharTokenizer()
    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim, config.task, tokenizer,
                          meshes, seed=config.seed, total_rollouts=config.rollouts,
                          sync=config.sync)
    state = trainer.init_state(warm_params)

    def pass_at_1(st) -> float:
        return trainer.heldout_accuracy(st, config.eval.prompts, samples=config.eval.samples)

    initial = pass_at_1(state)
    run.info(f"warm start held-out pass@1 {initial:.3f}")
    evals = [(0, initial)]
    rows = []
    run.set_total_steps(config.rollouts, "flagship")
    for r in range(config.rollouts):
        state, metrics = trainer.step(state)
        done = r + 1
        row = {"rollout": done, **metrics}
        if done % config.eval.every == 0 or done == config.rollouts:
            row["heldout_pass_at_1"] = pass_at_1(state)
            evals.append((done, row["heldout_pass_at_1"]))
        run.log(done, row)
        rows.append(row)
    plot_flagship(run, rows, evals)
    ratio, dense, sent = sync_ratio_vs_dense(trainer.weight_sync)
    final = evals[-1][1]
    synced = trainer.weight_sync is not None
    run.info(f"held-out pass@1 {initial:.3f} -> {final:.3f}" + (
        f"; sync ratio vs dense bf16 {ratio:.2f}x ({dense} / {sent} bytes)" if synced else ""))
    later = [r["accept_rate_later"] for r in rows if "accept_rate_later" in r]
    return {
        "heldout_pass_at_1_initial": initial,
        "heldout_pass_at_1_final": final,
        "heldout_pass_at_1_curve": evals,
        "pass_at_1": pass_at_1_definition(config),
        "heldout_greedy_accuracy_final": trainer.heldout_accuracy(state, config.eval.prompts),
        "sync_ratio_vs_dense": ratio if synced else None,  # None: sync=none (dense f32)
        "sync_dense_bytes": dense,
        "sync_sent_bytes": sent,
        "sync_publishes": len(trainer.weight_sync.records) if trainer.weight_sync else 0,
        "sync_bit_exact": all(r.bit_exact for r in trainer.weight_sync.records)
        if trainer.weight_sync else None,
        "reward_first5": float(np.mean([r["reward_mean"] for r in rows[:5]])),
        "reward_last5": float(np.mean([r["reward_mean"] for r in rows[-5:]])),
        "accept_rate_later": float(np.mean(later)) if later else None,
        "roles": roles,
        "task": dataclasses.asdict(config.task),
        "warm_start": {"cache": cache_dir(config.pretrain, config.cache_root).name,
                       "pretrain_heldout_greedy_accuracy": pre_summary.get("heldout_accuracy")},
    }
