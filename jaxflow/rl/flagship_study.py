"""The flagship study's library half (``configs/flagship.py``, driver ``jaxflow/main/flagship.py``):
per-seed warm starts, the GRPO setup of run k, the per-run summary and the summary over runs,
the plot, the meshes of each job role and the rollout job's service.

Run k trains its own warm start (``pretrain.seed + k``, :func:`warm_start`: cached, or trained in
the run directory by the one training loop and cached once complete) and runs RL at seed
``seed + k`` (:func:`flagship_setup`). The summary's headline figures (:data:`HEADLINE_KEYS`) are
means over the runs with a 95% t-interval (:func:`jaxflow.study.seed_interval`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from types import SimpleNamespace
from typing import Any

import numpy as np

from jaxflow.cache import build_once
from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext, is_local
from jaxflow.mesh import make_mesh, trainer_rollout_meshes
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.rl.system import GRPOSetup
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.rollout.paged_attention import paged_attention
from jaxflow.study import seed_interval
from jaxflow.train.lm_state import make_optimizer
from jaxflow.train.pretrain import pretrain as train_warm_start
from jaxflow.train.state import TrainState

__all__ = ["HEADLINE_KEYS", "flagship_meshes", "flagship_setup", "pass_at_1_definition",
           "plot_flagship", "seed_summary", "serve_rollout_job", "summarize_seeds",
           "sync_ratio_vs_dense", "sync_records", "warm_start"]

#: Summary keys that carry a mean and a 95% seed interval.
HEADLINE_KEYS = ("heldout_pass_at_1_initial", "heldout_pass_at_1_final",
                 "heldout_pass_at_1_gain", "sync_ratio_vs_dense")


def flagship_setup(config, k: int) -> GRPOSetup:
    """Run ``k``'s :class:`jaxflow.rl.system.GRPOSetup`: the warm start's architecture, RL seed
    ``config.seed + k``, ``config.eval``'s held-out pass@1."""
    return GRPOSetup(config.pretrain.model, config.rl, config.optim, config.task, CharTokenizer(),
                     seed=config.seed + k, total_rollouts=config.rollouts, sync=config.sync,
                     eval_prompts=config.eval.prompts, eval_samples=config.eval.samples)


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
        axes[0].plot(x, [r["critic/rewards/mean"] for r in rows], lw=1.2)
        axes[1].plot(*zip(*evals), marker="o", ms=3)
        axes[2].plot(x, [r["actor/accept_rate"] for r in rows], lw=1.2, label=f"{tag}all mini-batches")
        if "actor/accept_rate_later" in rows[0]:
            axes[2].plot(x, [r["actor/accept_rate_later"] for r in rows], lw=1.2, ls="--",
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


def warm_start(config, run: RunContext, k: int, fns) -> tuple[Any, dict]:
    """Run ``k``'s warm start (``pretrain.seed + k``): (params laid out with
    ``fns.param_shardings``, the pretraining summary).

    A cached entry (``jaxflow.rl.warm_start.cache_dir``) is loaded. Otherwise the warm start is
    trained in this run's directory (``warm_start/seed<k>/``, checkpoints under
    ``checkpoints/seed<k>/warm_start``) by the one training loop, so a stop signal checkpoints
    it and ``--resume`` continues it; once complete it is copied into the cache."""
    pretrain = dataclasses.replace(config.pretrain, seed=config.pretrain.seed + k)
    entry = cache_dir(pretrain, config.cache_root)
    if (entry / "summary.json").exists():
        return load_pretrained_params(pretrain, config.cache_root, fns, log=run.info)
    out, ckpt_dir = run.out_dir / "warm_start" / f"seed{k}", run.checkpoint_dir / f"seed{k}" / "warm_start"
    run.info(f"warm start: training lm_pretrain in {out} (then cached as {entry})")
    ctx = RunContext(name="lm_pretrain", variant="warm_start", out_dir=out,
                     is_primary=run.is_primary, resume=run.resume, tensorboard=run.tensorboard)
    try:
        ctx.write_json("config.json", {"experiment": "lm_pretrain", "variant": "warm_start",
                                       "config": pretrain})
        summary = train_warm_start(pretrain, ctx, checkpoint_dir=ckpt_dir,
                                   decode_kernel=DecodeKernel(paged_attention))
    finally:
        ctx.close()
    ctx.write_json("summary.json", summary)
    if run.is_primary:
        build_once(entry, lambda tmp: _copy_warm_start(out, ckpt_dir, tmp))
    tx = make_optimizer(pretrain.optim, pretrain.train.steps)
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    state = ckpt.restore(ckpt.latest_step(),
                         TrainState.abstract(tx, fns.abstract_params(), fns.param_shardings))
    ckpt.close()
    return state.params, summary


def _copy_warm_start(out, ckpt_dir, tmp: pathlib.Path) -> None:
    """A cache entry (``jaxflow.rl.warm_start``'s layout) from a warm start trained in a run
    directory: config.json, metrics.jsonl, checkpoints/, and summary.json last."""
    def copy(src, dst: pathlib.Path):
        if is_local(src):
            shutil.copytree(os.fspath(src), dst) if src.is_dir() else shutil.copy(os.fspath(src), dst)
            return
        for f in [src] if src.is_file() else [f for f in src.rglob("*") if f.is_file()]:
            target = dst if f == src else dst / os.path.relpath(str(f), str(src))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())

    tmp.mkdir(parents=True)
    copy(ckpt_dir, tmp / "checkpoints")
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        copy(out / name, tmp / name)


def sync_records(rows: list[dict]) -> list:
    """The publishes that went through the weight sync, from the rows (``jaxflow.sync``
    ``SyncRecord``-like: ``stats.dense_bytes``, ``stats.payload_bytes``, ``bit_exact``)."""
    return [SimpleNamespace(stats=SimpleNamespace(dense_bytes=int(r["sync/dense_bytes"]),
                                                  payload_bytes=int(r["sync/payload_bytes"])),
                            bit_exact=bool(r["sync/bit_exact"])) for r in rows if r.get("sync/synced")]


def seed_summary(config, k: int, rows: list[dict], evals: list[tuple[int, float]],
                 greedy_final: float, pre_summary: dict, log=print) -> dict:
    """Run ``k``'s summary from its metric rows (JSON, every rollout), its (rollout, pass@1)
    evaluations (rollout 0: the warm start) and its final greedy held-out accuracy."""
    ws = config.sync is not None
    records = sync_records(rows)
    ratio, dense, sent = sync_ratio_vs_dense(records)
    initial, final = evals[0][1], evals[-1][1]
    log(f"seed {k}: held-out pass@1 {initial:.3f} -> {final:.3f}" + (
        f"; sync ratio vs dense bf16 {ratio:.2f}x ({dense} / {sent} bytes)" if ws else ""))
    later = [r["actor/accept_rate_later"] for r in rows if "actor/accept_rate_later" in r]
    pretrain = dataclasses.replace(config.pretrain, seed=config.pretrain.seed + k)
    return {
        "rl_seed": config.seed + k,
        "warm_start_seed": pretrain.seed,
        "heldout_pass_at_1_initial": initial,
        "heldout_pass_at_1_final": final,
        "heldout_pass_at_1_gain": final - initial,
        "heldout_pass_at_1_curve": evals,
        "heldout_greedy_accuracy_final": greedy_final,
        "sync_ratio_vs_dense": ratio if ws else None,  # None: sync=none (dense f32)
        "sync_dense_bytes": dense,
        "sync_sent_bytes": sent,
        "sync_publishes": len(records),
        "sync_bit_exact": all(r.bit_exact for r in records) if ws else None,
        "reward_first5": float(np.mean([r["critic/rewards/mean"] for r in rows[:5]])),
        "reward_last5": float(np.mean([r["critic/rewards/mean"] for r in rows[-5:]])),
        "accept_rate_later": float(np.mean(later)) if later else None,
        "warm_start": {"cache": cache_dir(pretrain, config.cache_root).name,
                       "pretrain_heldout_greedy_accuracy": pre_summary.get("heldout_accuracy")},
    }


def flagship_meshes(config, devices=None) -> dict:
    """The run's meshes: ``{"trainer", "rollout"}`` sub-meshes in one job (``remote.role=local``,
    :func:`jaxflow.mesh.trainer_rollout_meshes`), or every device of this job as the trainer
    mesh (``trainer``; it also evaluates) or as the rollout mesh (``rollout``)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    role = config.remote.role
    if role == "local":
        return trainer_rollout_meshes(config.roles, devices)[0]
    mesh = make_mesh(config.roles.axes("trainer" if role == "trainer" else "rollout"), devices)
    return {"trainer": mesh, "rollout": mesh} if role == "trainer" else {"rollout": mesh}


def serve_rollout_job(config, run: RunContext) -> dict:
    """``remote.role=rollout``: this job's devices sample for the trainer job (process i
    listens on ``remote.listen``'s port + i) until it says DONE; returns what was served."""
    import jax

    from jaxflow.rl.remote.protocol import parse_endpoint
    from jaxflow.rl.remote.server import RolloutService
    from jaxflow.rl.rollout import RolloutWorker

    mesh = flagship_meshes(config)["rollout"]
    worker = RolloutWorker(config.pretrain.model, mesh, config.rl.rollout_spec, config.task,
                           CharTokenizer())
    host, port = parse_endpoint(config.remote.listen, "remote.listen")
    service = RolloutService(worker, host=host, port=port + jax.process_index() if port else 0,
                             timeout_s=config.remote.timeout_s,
                             start_timeout_s=config.remote.start_timeout_s, log=run.info)
    served = service.serve()
    run.info(f"rollout job: served {served['rollouts_served']} rollouts; replica at version "
             f"{served['replica_version']}")
    return {"role": "rollout", **served, "devices": mesh.devices.size}
