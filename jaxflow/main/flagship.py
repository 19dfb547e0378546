"""The ``flagship`` experiment: GRPO + SIS on worked addition, trainer and sampler on disjoint
sub-meshes, weights to the sampler through SparseRL-Sync (see ``configs/flagship.py``).

``seeds`` runs (``quick``: 1, ``default``: 3): run k trains its own warm start
(``pretrain.seed + k``) and RL at seed ``seed + k``. Per rollout ``metrics.jsonl`` gets the
reward, the SIS accept rate (all mini-batches and mini-batches 2..N), the sync payload, the
run's ``seed_index``; every ``eval.every`` rollouts the held-out pass@1. The summary's headline
figures (held-out pass@1 initial / final / gain, sync ratio) are means over the runs with a 95%
t-interval under ``seed_interval`` (none for one run); per-run values under ``per_seed``.
``plots/flagship.png`` shows reward, held-out pass@1 and accept rate against the rollout.

Stops and ``--resume``: everything trains through ``jaxflow.train.loop.run_steps``. A warm
start missing from the cache trains in the run directory (``warm_start/seed<k>/``, checkpoints
under ``checkpoints/seed<k>/warm_start``) and is cached once complete; the RL of run k
checkpoints under ``checkpoints/seed<k>/rl`` (at a stop signal and at its end); finished runs
are recorded in ``seeds.jsonl``. A resumed run gives the rows and figures of one that never
stopped.

Two jobs (``remote.role``, :mod:`jaxflow.rl.remote`): ``--set remote.role=rollout --set
remote.listen=HOST:PORT`` runs only the rollout side (its own ``jax.distributed`` job, every
device of it a rollout device), and ``--set remote.role=trainer --set
remote.rollout=HOST:PORT[,...]`` trains on every device of its job and gets its rollouts from
that job; the weights cross only as SparseRL-Sync payloads over TCP. The held-out pass@1 is
then evaluated on the trainer's devices (with the trainer's f32 params, as the rollout mesh
does in one job). A rollout job that stays lost for ``remote.timeout_s`` ends the trainer with
exit 75 and one line naming it; ``--resume`` continues from the last RL checkpoint
(``checkpoint_every`` rollouts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

from jaxflow import signals
from jaxflow.cache import build_once
from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import LOST_PEER_EXIT
from jaxflow.experiment import RunContext, is_local, to_jsonable
from jaxflow.mesh import make_mesh, trainer_rollout_meshes
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.stats import paired_interval
from jaxflow.train.lm_state import lm_functions, make_optimizer
from jaxflow.train.loop import run_steps
from jaxflow.train.pretrain import pretrain as train_warm_start
from jaxflow.train.state import TrainState

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
        summary = train_warm_start(pretrain, ctx, checkpoint_dir=ckpt_dir)
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


def _seed_rows(run: RunContext, k: int, upto: int) -> list[dict]:
    """Seed ``k``'s metrics rows of rollouts 1..``upto`` as metrics.jsonl holds them."""
    path = run.out_dir / "metrics.jsonl"
    if upto == 0 or not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if r.get("seed_index") == k and "rollout" in r and r["rollout"] <= upto]


def _sync_records(rows: list[dict]) -> list:
    """The publishes that went through the weight sync, from the rows (``jaxflow.sync``
    ``SyncRecord``-like: ``stats.dense_bytes``, ``stats.payload_bytes``, ``bit_exact``)."""
    return [SimpleNamespace(stats=SimpleNamespace(dense_bytes=int(r["sync/dense_bytes"]),
                                                  payload_bytes=int(r["sync/payload_bytes"])),
                            bit_exact=bool(r["sync/bit_exact"])) for r in rows if r.get("sync/synced")]


def run_seed(config, run: RunContext, k: int, meshes, fns, remote=None) -> tuple[dict, list, list]:
    """Run ``k`` of the experiment: warm start ``pretrain.seed + k``, RL seed ``seed + k``,
    checkpointed under ``checkpoints/seed<k>/rl`` (at a stop signal and at the end) and resumed
    from there. Returns (its summary, its metric rows, its (rollout, pass@1) evaluations); the
    rows and figures of a resumed run are those of one that never stopped."""
    warm_params, pre_summary = warm_start(config, run, k, fns)
    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim, config.task,
                          CharTokenizer(), meshes, seed=config.seed + k,
                          total_rollouts=config.rollouts, sync=config.sync, remote=remote)
    state = trainer.init_state(warm_params)

    def pass_at_1(st) -> float:
        return trainer.heldout_accuracy(st, config.eval.prompts, samples=config.eval.samples)

    initial = pass_at_1(state)
    run.info(f"seed {k}: warm start held-out pass@1 {initial:.3f}")

    def rl_step(state, step):
        state, metrics, record = trainer.step_with_sync(state)
        if record is not None:  # the summary's sync totals are read from the rows
            metrics["sync/dense_bytes"] = float(record.stats.dense_bytes)
        return state, {"rollout": step + 1, "seed_index": k, **metrics}

    ckpt = Checkpointer(run.checkpoint_dir / f"seed{k}" / "rl",
                        save_every=config.checkpoint_every or config.rollouts, max_to_keep=1)
    result = run_steps(rl_step, state, steps=config.rollouts, run=run, checkpointer=ckpt,
                       log_every=1, summarize=rollout_row,
                       eval_fn=lambda st, done: {"heldout_pass_at_1": pass_at_1(st)},
                       eval_every=config.eval.every, step_offset=k * config.rollouts)
    state = result.state
    # the rows as logged (JSON), those before a resume read back: the same figures either way
    rows = _seed_rows(run, k, result.start) + [json.loads(json.dumps(to_jsonable(r)))
                                               for r in result.rows]
    evals = [(0, initial)] + [(r["rollout"], r["heldout_pass_at_1"]) for r in rows
                              if "heldout_pass_at_1" in r]
    ws = config.sync is not None
    records = _sync_records(rows)
    ratio, dense, sent = sync_ratio_vs_dense(records)
    final = evals[-1][1]
    run.info(f"seed {k}: held-out pass@1 {initial:.3f} -> {final:.3f}" + (
        f"; sync ratio vs dense bf16 {ratio:.2f}x ({dense} / {sent} bytes)" if ws else ""))
    later = [r["actor/accept_rate_later"] for r in rows if "actor/accept_rate_later" in r]
    pretrain = dataclasses.replace(config.pretrain, seed=config.pretrain.seed + k)
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
        "reward_first5": float(np.mean([r["critic/rewards/mean"] for r in rows[:5]])),
        "reward_last5": float(np.mean([r["critic/rewards/mean"] for r in rows[-5:]])),
        "accept_rate_later": float(np.mean(later)) if later else None,
        "warm_start": {"cache": cache_dir(pretrain, config.cache_root).name,
                       "pretrain_heldout_greedy_accuracy": pre_summary.get("heldout_accuracy")},
    }
    return summary, rows, evals


def _finished_seeds(run: RunContext) -> dict[int, dict]:
    """On ``--resume``: the summaries of the seeds that had finished (``seeds.jsonl``)."""
    path = run.out_dir / "seeds.jsonl"
    if not run.resume or not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r.pop("seed_index"): r for r in rows}


def compile_programs(config, meshes) -> list:
    """``--compile-only``: the programs one RL step of run 0 executes (the trainer's own
    jitted functions, :func:`jaxflow.rl.programs.grpo_programs`) on ``meshes`` (trainer /
    rollout, from :func:`jaxflow.mesh.trainer_rollout_meshes` on the target's devices)."""
    from jaxflow.rl.programs import grpo_programs

    trainer = GRPOTrainer(config.pretrain.model, config.rl, config.optim, config.task,
                          CharTokenizer(), meshes, seed=config.seed,
                          total_rollouts=config.rollouts, sync=config.sync)
    return grpo_programs(trainer)


def resolve_meshes(config, devices=None) -> dict:
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


def main(config, run: RunContext) -> dict:
    """Every seed's warm start and RL; the summary over seeds. The whole run polls for stop
    signals (``signals.polling``): a SIGINT / SIGTERM between steps (loading, compiling,
    evaluating) takes effect at the end of the next warm-start or RL step, checkpointed.
    ``remote.role=rollout``: serves rollouts to the trainer job until it is done."""
    if config.remote.role == "rollout":
        return serve_rollout_job(config, run)
    from jaxflow.rl.remote.protocol import RolloutLost

    with signals.polling():
        try:
            return _main(config, run)
        except RolloutLost as e:  # the rollout job is gone: say so, keep the checkpoints
            run.info(f"stopping: {e}")
            print(f"flagship: {e}; rerun with --resume once the rollout job is back",
                  file=sys.stderr, flush=True)
            signals.exit_now(LOST_PEER_EXIT)
            raise  # not reached


def serve_rollout_job(config, run: RunContext) -> dict:
    """``remote.role=rollout``: this job's devices sample for the trainer job (process i
    listens on ``remote.listen``'s port + i) until it says DONE; returns what was served."""
    import jax

    from jaxflow.rl.remote.protocol import parse_endpoint
    from jaxflow.rl.remote.server import RolloutService
    from jaxflow.rl.rollout import RolloutWorker

    mesh = resolve_meshes(config)["rollout"]
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


def _main(config, run: RunContext) -> dict:
    meshes = resolve_meshes(config)
    if config.remote.role == "local":
        roles = trainer_rollout_meshes(config.roles)[1]
    else:
        roles = (f"trainer job: {meshes['trainer'].devices.size} device(s); rollouts from the "
                 f"rollout job at {config.remote.rollout}")
    run.info(f"roles: {roles}")
    remote = None
    if config.remote.role == "trainer":
        from jaxflow.rl.remote.client import RemoteRollout

        remote = RemoteRollout(config.remote.endpoints(), config.rl.rollout_spec, config.task,
                               CharTokenizer(), config.sync, timeout_s=config.remote.timeout_s,
                               start_timeout_s=config.remote.start_timeout_s, log=run.info)
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    run.set_total_steps(config.seeds * config.rollouts, "flagship")
    done = _finished_seeds(run)
    per_seed, curves = [], []
    for k in range(config.seeds):
        if k in done:  # --resume: a seed that had finished is not run again
            summary = done[k]
            rows = _seed_rows(run, k, config.rollouts)
            evals = [tuple(e) for e in summary["heldout_pass_at_1_curve"]]
        else:
            summary, rows, evals = run_seed(config, run, k, meshes, fns, remote)
            if run.is_primary:
                with (run.out_dir / "seeds.jsonl").open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"seed_index": k, **to_jsonable(summary)}) + "\n")
        per_seed.append(summary)
        curves.append((rows, evals))
    if remote is not None:
        remote.close()  # DONE: the rollout job exits 0
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
