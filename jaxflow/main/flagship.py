"""The ``flagship`` experiment: GRPO + SIS on worked addition, trainer and sampler on disjoint
sub-meshes, weights to the sampler through SparseRL-Sync (see ``configs/flagship.py``).

``seeds`` runs (``quick``: 1, ``default``: 3): run k trains its own warm start
(``pretrain.seed + k``) and RL at seed ``seed + k`` (:class:`jaxflow.rl.system.GRPOSystem`).
Per rollout ``metrics.jsonl`` gets the reward, the SIS accept rate, the sync payload, the run's
``seed_index``; every ``eval.every`` rollouts the held-out pass@1. The summary's headline
figures are means over the runs with a 95% t-interval under ``seed_interval``; per-run values
under ``per_seed`` (:mod:`jaxflow.rl.flagship_study`). ``plots/flagship.png``: reward, held-out
pass@1 and accept rate against the rollout.

Stops and ``--resume``: everything trains through ``jaxflow.train.loop.run_steps``; the RL of
run k checkpoints under ``checkpoints/seed<k>/rl``; finished runs are recorded in
``seeds.jsonl``. A resumed run gives the rows and figures of one that never stopped.

Two jobs (``remote.role``, :mod:`jaxflow.rl.remote`): ``--set remote.role=rollout --set
remote.listen=HOST:PORT`` runs only the rollout side, ``--set remote.role=trainer --set
remote.rollout=HOST:PORT[,...]`` trains on every device of its job and gets its rollouts from
that job; the weights cross only as SparseRL-Sync payloads over TCP. A rollout job that stays
lost for ``remote.timeout_s`` ends the trainer with exit 75 and one line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

from jaxflow import signals
from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import LOST_PEER_EXIT
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.rl import flagship_study as study
from jaxflow.rl.grpo import rollout_row
from jaxflow.rl.system import GRPOSystem
from jaxflow.study import finished_cells, record_cell, rows_of_cell
from jaxflow.train.lm_state import lm_functions
from jaxflow.train.loop import run_steps

SEEDS_FILE = "seeds.jsonl"


def run_seed(config, run: RunContext, k: int, meshes, fns, remote=None) -> tuple[dict, list, list]:
    """Run ``k``: warm start, RL through ``run_steps`` (checkpoints ``checkpoints/seed<k>/rl``);
    returns (its summary, its metric rows, its (rollout, pass@1) evaluations)."""
    warm_params, pre_summary = study.warm_start(config, run, k, fns)
    system, setup = GRPOSystem(remote=remote), study.flagship_setup(config, k)
    state = system.init(setup, meshes, jax.random.key(setup.seed), params=warm_params)
    initial = system.evaluate(state)["heldout_pass_at_1"]
    run.info(f"seed {k}: warm start held-out pass@1 {initial:.3f}")
    run_key = jax.random.key(setup.seed)

    def rl_step(state, step):
        state, metrics = system.step(state, None, key=jax.random.fold_in(run_key, step))
        return state, {"rollout": step + 1, "seed_index": k, **metrics}

    ckpt = Checkpointer(run.checkpoint_dir / f"seed{k}" / "rl",
                        save_every=config.checkpoint_every or config.rollouts, max_to_keep=1)
    result = run_steps(rl_step, state, steps=config.rollouts, run=run, checkpointer=ckpt,
                       log_every=1, summarize=rollout_row,
                       eval_fn=lambda st, done: system.evaluate(st),
                       eval_every=config.eval.every, step_offset=k * config.rollouts)
    # the rows as logged (JSON), those before a resume read back: the same figures either way
    rows = rows_of_cell(run, field="seed_index", value=k, upto=result.start) + [
        json.loads(json.dumps(to_jsonable(r))) for r in result.rows]
    evals = [(0, initial)] + [(r["rollout"], r["heldout_pass_at_1"]) for r in rows
                              if "heldout_pass_at_1" in r]
    greedy = system.heldout_accuracy(result.state, config.eval.prompts)
    summary = study.seed_summary(config, k, rows, evals, greedy, pre_summary, log=run.info)
    return summary, rows, evals


def compile_programs(config, meshes) -> list:
    """``--compile-only``: the programs one RL step of run 0 executes
    (:meth:`jaxflow.rl.system.GRPOSystem.programs`) on ``meshes``."""
    return GRPOSystem().programs(study.flagship_setup(config, 0), meshes)


def resolve_meshes(config, devices=None) -> dict:
    """The run's meshes (:func:`jaxflow.rl.flagship_study.flagship_meshes`)."""
    return study.flagship_meshes(config, devices)


def main(config, run: RunContext) -> dict:
    """Every seed's warm start and RL; the summary over seeds. The whole run polls for stop
    signals (``signals.polling``). ``remote.role=rollout``: serves rollouts until done."""
    if config.remote.role == "rollout":
        return study.serve_rollout_job(config, run)
    from jaxflow.rl.remote.protocol import RolloutLost

    with signals.polling():
        try:
            return run_seeds(config, run)
        except RolloutLost as e:  # the rollout job is gone: say so, keep the checkpoints
            run.info(f"stopping: {e}")
            print(f"flagship: {e}; rerun with --resume once the rollout job is back",
                  file=sys.stderr, flush=True)
            signals.exit_now(LOST_PEER_EXIT)
            raise  # not reached


def run_seeds(config, run: RunContext) -> dict:
    """The seeds (finished ones read back on ``--resume``), the plot and the summary."""
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
                               CharTokenizer(), config.sync, timeout_s=config.remote.timeout_s, log=run.info,
                               start_timeout_s=config.remote.start_timeout_s, model=config.pretrain.model)
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    run.set_total_steps(config.seeds * config.rollouts, "flagship")
    done = finished_cells(run, filename=SEEDS_FILE, key="seed_index")
    per_seed, curves = [], []
    for k in range(config.seeds):
        if k in done:  # --resume: a seed that had finished is not run again
            summary = {f: v for f, v in done[k].items() if f != "seed_index"}
            rows = rows_of_cell(run, field="seed_index", value=k, upto=config.rollouts)
            evals = [tuple(e) for e in summary["heldout_pass_at_1_curve"]]
        else:
            summary, rows, evals = run_seed(config, run, k, meshes, fns, remote)
            record_cell(run, {"seed_index": k, **to_jsonable(summary)}, filename=SEEDS_FILE)
        per_seed.append(summary)
        curves.append((rows, evals))
    if remote is not None:
        remote.close()  # DONE: the rollout job exits 0
    study.plot_flagship(run, curves)
    head = study.summarize_seeds(per_seed)
    if config.seeds > 1:
        run.info("over seeds: " + "; ".join(
            f"{key} {iv['mean']:.3f} +- {iv['half_width']:.3f}"
            for key, iv in head["seed_interval"].items()))
    synced = [s for s in per_seed if s["sync_bit_exact"] is not None]
    return {**head, "pass_at_1": study.pass_at_1_definition(config),
            "sync_bit_exact": all(s["sync_bit_exact"] for s in synced) if synced else None,
            "per_seed": per_seed, "roles": roles, "task": dataclasses.asdict(config.task)}
