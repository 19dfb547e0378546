"""Off-policy RL study cells: one GRPO run from a shared warm start under one setting of the
off-policy knobs (algorithm, correction, sampler mismatch, policy lag N, staleness k, learning
rate scale, rollout size) and one seed.

The ``sis_offpolicy`` / ``sis_study`` grid (:func:`grid_cells`) and the ``sis_regime`` study
(:mod:`jaxflow.rl.sis_regime`) both run their cells with :func:`run_cell`: the RL run trains
through :func:`jaxflow.train.loop.run_steps` (rows tagged with the cell's label, global step
``index * rollouts + rollout``), resumes from ``checkpoints/<label>/`` and returns the cell's
record for ``cells.jsonl`` (:mod:`jaxflow.study.cells`). Cells with the same seed share the
warm start, the prompts and the sampling keys, so settings compare seed by seed
(:mod:`jaxflow.rl.offpolicy_report`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from jaxflow.checkpoint import Checkpointer
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.publish import publish_weights
from jaxflow.rl.rollout import RolloutWorker
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.rl.warm_start import load_pretrained_params
from jaxflow.study import curve_from_rows, mean_of, median_after_warmup, normalized_auc, rows_of_cell, seed_grid, timed
from jaxflow.sync.replica import tree_digest
from jaxflow.train.lm_state import lm_functions
from jaxflow.train.loop import run_steps

__all__ = ["Cell", "group_key", "grid_cells", "run_cell", "study_task", "study_tokenizer",
           "warm_policy", "warm_start_accuracy", "pass_at_1_definition"]


class Cell(NamedTuple):
    """One RL run. ``lr_scale`` multiplies ``optim.lr``; ``prompts`` > 0 replaces
    ``rl.prompts_per_rollout`` (rows = prompts x group size), 0 keeps it; ``moe`` "" runs the
    study's dense policy, "record" / "replay" its MoE policy with that ``rl.routing_replay``
    (without / with R3; the caller passes the MoE config and warm start)."""

    algo: str
    correction: str
    mismatch: str
    lag: int
    staleness: int
    seed: int
    lr_scale: float = 1.0
    prompts: int = 0
    moe: str = ""

    @property
    def label(self) -> str:
        """The cell's unique name, e.g. ``grpo-sis-none-lag8-k0-s2`` (its checkpoints' folder)."""
        extra = (f"-lr{self.lr_scale:g}" if self.lr_scale != 1.0 else "") + (
            f"-p{self.prompts}" if self.prompts else "") + (f"-moe-{self.moe}" if self.moe else "")
        return (f"{self.algo}-{self.correction}-{self.mismatch}-lag{self.lag}-k{self.staleness}"
                f"{extra}-s{self.seed}")

    @property
    def group(self) -> tuple:
        """The setting without the seed (what seeds are averaged over)."""
        return (*self[:5], self.lr_scale, self.prompts)


def group_key(rec: Mapping[str, Any]) -> tuple:
    """(algo, correction, mismatch, lag, staleness, lr_scale, prompts) of a cells.jsonl record
    (records written before the last two fields existed have the defaults)."""
    return (rec["algo"], rec["correction"], rec["mismatch"], rec["lag"], rec["staleness"],
            rec.get("lr_scale", 1.0), rec.get("prompts", 0))


def grid_cells(grid) -> list[Cell]:
    """Every cell of the ``sis_offpolicy`` grid (``configs.sis_offpolicy.GridConfig``), seeds
    innermost, duplicates dropped (in order); the ``extra_lags`` block has
    ``extra_lag_seeds`` seeds, every other block ``seeds``."""
    main = [(a, c, "none", n, 0) for a in grid.algos for c in grid.corrections for n in grid.lags]
    main += [(a, c, m, grid.mismatch_lag, 0) for m in grid.mismatches
             for a in grid.mismatch_algos for c in grid.mismatch_corrections]
    main += [(a, c, "none", 1, k) for k in grid.stalenesses
             for a in grid.staleness_algos for c in grid.corrections]
    extra = [(a, c, "none", n, 0) for a in grid.algos for c in grid.corrections
             for n in grid.extra_lags]
    return [Cell(*key, seed=s) for key, s in seed_grid([(main, grid.seeds),
                                                        (extra, grid.extra_lag_seeds)])]


def study_task(config):
    """The RL task of the warm start's corpus: worked addition when the pretraining data
    config builds its own corpus (``configs.flagship.WorkedDataConfig``), else addition."""
    if hasattr(config.pretrain.data, "make_corpus"):
        return config.pretrain.data.make_corpus()
    return AdditionRLTask(max_digits=config.pretrain.data.max_digits,
                          heldout_mod=config.pretrain.data.heldout_mod)


def study_tokenizer(config):
    """The checkpoint's tokenizer.json with ``model.hf_path``, else the character tokenizer."""
    if config.model.hf_path:
        from jaxflow.models.tokenizer_hf import HFTokenizer

        return HFTokenizer.from_pretrained(config.model.hf_path)
    return CharTokenizer()


def warm_policy(config, meshes: Mapping[str, Any], *, log: Callable[[str], None],
                hf: bool = True) -> tuple[Any, Any, dict]:
    """(config, params on ``meshes["trainer"]``, pretraining summary) of the study's warm start:
    the local Hugging Face checkpoint ``model.hf_path`` when set and ``hf`` (the config's
    ``pretrain.model`` becomes its architecture; the summary is ``{"hf_path": ...}``), else the
    cached ``lm_pretrain`` run of ``config.pretrain`` (trained on first use)."""
    if hf and config.model.hf_path:
        from jaxflow.models.pretrained import load_policy

        model_cfg, params, _ = load_policy(config.model.hf_path, meshes["trainer"])
        config = dataclasses.replace(config, pretrain=dataclasses.replace(config.pretrain,
                                                                          model=model_cfg))
        log(f"policy from {config.model.hf_path}: {model_cfg.architecture}")
        return config, params, {"hf_path": config.model.hf_path}
    fns = lm_functions(config.pretrain.model, meshes["trainer"])
    params, summary = load_pretrained_params(config.pretrain, config.cache_root, fns, log=log)
    return config, params, summary


def warm_start_accuracy(config, meshes: Mapping[str, Any], params) -> tuple[float, float]:
    """(sampled pass@1, greedy) held-out accuracy of ``params``: the curves' point 0."""
    worker = RolloutWorker(config.pretrain.model, meshes["rollout"], config.rl.rollout_spec,
                           study_task(config), study_tokenizer(config))
    params = publish_weights(params, worker.param_shardings)
    n = config.train.eval_examples
    return (worker.heldout_accuracy(params, n, samples=config.train.eval_samples),
            worker.heldout_accuracy(params, n))


def pass_at_1_definition(config) -> dict:
    """How the headline accuracy (``acc``) is measured; written into the summary."""
    return {"temperature": config.rl.temperature, "samples_per_prompt": config.train.eval_samples,
            "heldout_prompts": config.train.eval_examples,
            "sampling_key": "fixed (jax.random.key(0)), the same for every cell and rollout",
            "greedy": "heldout_greedy_accuracy / greedy_acc: temperature 0, same prompts"}


def _cell_trainer(cell: Cell, config, meshes) -> GRPOTrainer:
    loss = dataclasses.replace(config.rl.loss, algo=cell.algo, correction=cell.correction)
    rl = dataclasses.replace(config.rl, loss=loss, mismatch=cell.mismatch, lag=cell.lag,
                             staleness=cell.staleness,
                             prompts_per_rollout=cell.prompts or config.rl.prompts_per_rollout,
                             routing_replay=cell.moe or config.rl.routing_replay)
    optim = dataclasses.replace(config.optim, lr=config.optim.lr * cell.lr_scale)
    return GRPOTrainer(config.pretrain.model, rl, optim, study_task(config), study_tokenizer(config),
                       meshes, seed=config.seed * 1000 + cell.seed,
                       total_rollouts=config.train.rollouts, sync=config.sync)


def run_cell(cell: Cell, index: int, config, run: RunContext, *, meshes, warm_params,
             initial_accuracy: tuple[float, float]) -> dict:
    """One RL run through :func:`jaxflow.train.loop.run_steps` (its rows carry ``cell`` and
    ``rollout``; global step ``index * rollouts + rollout``); returns its record for
    cells.jsonl. Resumes from ``checkpoints/<cell>/`` with ``run.resume``; the rows of the
    rollouts before the checkpoint are read back from metrics.jsonl.

    ``initial_accuracy``: the warm start's (sampled pass@1, greedy) held-out accuracy
    (:func:`warm_start_accuracy`), point 0 of the cell's curves."""
    sched = config.train
    started = time.perf_counter()
    trainer = _cell_trainer(cell, config, meshes)
    ckpt = Checkpointer(run.checkpoint_dir / cell.label, save_every=sched.checkpoint_every,
                        max_to_keep=1)
    step_seconds: list[float] = []
    trainer_step = timed(trainer.step, step_seconds)

    def rl_step(state, step):
        state, metrics = trainer_step(state)
        return state, {"rollout": step + 1, **metrics}

    def evaluate(state, done):
        return {"heldout_accuracy": trainer.heldout_accuracy(state, sched.eval_examples,
                                                             samples=sched.eval_samples),
                "heldout_greedy_accuracy": trainer.heldout_accuracy(state, sched.eval_examples)}

    result = run_steps(rl_step, trainer.init_state(warm_params), steps=sched.rollouts, run=run,
                       checkpointer=ckpt, log_every=1, summarize=rollout_row, eval_fn=evaluate,
                       eval_every=sched.eval_every, step_offset=index * sched.rollouts,
                       row_fields={"cell": cell.label})
    history = rows_of_cell(run, field="cell", value=cell.label, upto=result.start) + result.rows
    curve = curve_from_rows(history, "heldout_accuracy", start=initial_accuracy[0])
    greedy = curve_from_rows(history, "heldout_greedy_accuracy", start=initial_accuracy[1])
    return {
        "label": cell.label, **cell._asdict(),
        "final_accuracy": curve[-1][1],
        "final_greedy_accuracy": greedy[-1][1],
        "auc": normalized_auc(curve),  # mean held-out pass@1 over training (trapezoid)
        "curve": curve,
        "greedy_curve": greedy,
        "accept_rate": mean_of(history, "actor/accept_rate"),
        "accept_rate_first": mean_of(history, "actor/accept_rate_first"),
        "accept_rate_later": mean_of(history, "actor/accept_rate_later"),
        "clip_fraction": mean_of(history, "actor/pg_clipfrac"),
        "d_original": mean_of(history, "actor/d_original"),
        "d_sis": mean_of(history, "actor/d_sis"),
        "sis_accept_expected": mean_of(history, "actor/sis_accept_expected"),
        # train / inference mismatch (jaxflow.rl.mismatch_metrics): KL(mu || pi_old) per token,
        # the share of tokens the correction masks, the MoE routers' disagreement with the sampler
        "mismatch_kl": mean_of(history, "actor/mismatch/kl"),
        "masked_fraction": next((v for v in (mean_of(history, f"actor/mismatch/masked_fraction/{part}")
                                             for part in (cell.correction, *cell.correction.split("+")))
                                 if v is not None), None),
        "router_disagreement": mean_of(history, "actor/moe/router_disagreement"),
        # wall seconds of this process's rollouts (sample + update; evaluation excluded), the
        # first rollout (compile) dropped: median per rollout, and the cell's total
        "rollout_seconds_median": median_after_warmup(step_seconds),
        "cell_seconds": time.perf_counter() - started,
        "reward_first": history[0]["critic/rewards/mean"] if history else None,
        "reward_last": history[-1]["critic/rewards/mean"] if history else None,
        # fresh training prompts every rollout: an unbiased train-distribution pass rate
        "reward_last5": mean_of(history[-5:], "critic/rewards/mean"),
        "params_checksum": tree_digest(result.state["policy"].params),
    }
