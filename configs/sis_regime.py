"""sis_regime: where does off-policy data hurt uncorrected RL, and which correction helps there?

Two phases in one run, on the ``sis_study`` testbed (3-digit worked addition, the flagship's
sloppy-teacher warm start and RL settings: 16 prompts x G 16, temperature 1, lr 1e-4, SIS
top-8), every cell a fresh run from the warm start with paired seeds:

1. **Regime map** (``grid.algo``, no correction, ``grid.seeds`` seeds): one off-policy knob at
   a time against the on-policy lag-1 run -
   policy lag N in ``grid.lags`` (N mini-batch updates per rollout; beyond N = 16 the rollout
   grows to 16 x N rows so a mini-batch keeps >= ``grid.min_minibatch_rows`` rows), learning
   rate x ``grid.lr_scales`` at N in ``grid.lr_lags``, asynchronous staleness k in
   ``grid.stalenesses`` (rollouts sampled with the weights of k rollouts ago, N = 1) and
   sampler mismatch ``grid.mismatches`` (bf16 sampling, plus logit noise, N = 1). A setting is
   **in the regime** when its final held-out pass@1 is below the lag-1 run's by >= ``grid.
   threshold`` with a 95% paired t-interval that excludes 0.
2. **Corrections in the regime**: in one staleness and one mismatch setting (the smallest knob
   value in the regime of each family, or ``grid.compare_staleness`` / ``grid.compare_mismatch``;
   the most degraded one when a family never reaches the regime, reported as such) every
   correction of ``grid.compare_corrections`` for every algorithm of ``grid.compare_algos``
   with ``grid.compare_seeds`` paired seeds (the mismatch comparison for
   ``grid.compare_mismatch_algos``); in the learning-rate setting where the lag (not the step
   size) degrades the run (``grid.compare_lr``) and, when asked, in a policy-lag setting, none
   vs sis only (TIS / MIS / RS are identities when the behaviour policy is pi_old). The
   staleness and mismatch comparisons run at ``grid.compare_inner_lag`` updates per rollout
   (default 4): SIS corrects pi_theta against pi_old (the trainer's recomputed log-probs), so
   at N = 1 it is an exact identity whatever the staleness or mismatch.

    python -m jaxflow.run --exp=sis_regime --variant=quick      # ~2 min on 2 CPU cores
    python -m jaxflow.run --exp=sis_regime --variant=default    # the study (~2 h on 2 cores)
    python -m jaxflow.run --exp=sis_regime --variant=task2      # second task: 5-digit worked
                                                                # addition, 40-49 token answers
    python -m jaxflow.run --exp=sis_regime --variant=full       # wider ranges, 16 seeds

pass@1 = mean reward over ``train.eval_examples`` fixed held-out prompts x ``train.
eval_samples`` samples at temperature 1 with a fixed sampling key (``summary["pass_at_1"]``).
"""

from __future__ import annotations

import dataclasses

from configs import flagship
from configs.lm_pretrain import Config as PretrainConfig
from configs.sis_offpolicy import ScheduleConfig
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, OPEN_UNIT, POSITIVE, SEED, Int, domains
from jaxflow.models.pretrained import HFSource
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import ALGOS, CORRECTIONS
from jaxflow.rl.rollout import parse_mismatch
from jaxflow.rl.sis_regime import parse_lr_setting
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("Off-policy regime map of uncorrected GRPO (lag, lr, staleness, mismatch), then "
               "none/sis/tis/mis/rs/sis+tis there, paired seeds")
ENTRY = "jaxflow.main.sis_regime:main"
HEADLINES = "jaxflow.study.headlines_rl:sis_regime"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.hf_path", "pretrain.model.lora")


@domains(lags=COUNT, min_minibatch_rows=COUNT, lr_scales=POSITIVE, lr_lags=COUNT, stalenesses=COUNT0, seeds=COUNT,
         threshold=OPEN_UNIT, compare_seeds=COUNT, compare_staleness=Int(-1), compare_lag=Int(-1),
         compare_inner_lag=COUNT)
@dataclasses.dataclass(frozen=True)
class RegimeGrid:
    """The knob sweep (phase 1) and the comparison (phase 2); see the module doc."""

    algo: str = "grpo"
    lags: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    min_minibatch_rows: int = 16
    lr_scales: tuple[float, ...] = (3.0, 10.0)
    lr_lags: tuple[int, ...] = (1, 8)
    stalenesses: tuple[int, ...] = (1, 2, 4, 8)
    mismatches: tuple[str, ...] = ("bf16", "bf16+noise0.5", "bf16+noise1", "bf16+noise2",
                                   "bf16+noise4")
    seeds: int = 4
    threshold: float = 0.10
    compare_algos: tuple[str, ...] = ("grpo", "dapo")
    compare_corrections: tuple[str, ...] = ("none", "sis", "tis", "mis", "rs", "sis+tis")
    compare_seeds: int = 8
    #: phase-2 settings: 0 / "auto" = chosen from the regime map; "off" / -1 = not compared.
    #: The policy-lag comparison (none vs sis) is off by default: sis_study measured it at
    #: N = 8 and 16 with 16 paired seeds; ``--set grid.compare_lag=0`` adds it at the lag
    #: chosen from the map.
    compare_staleness: int = 0
    compare_mismatch: str = "auto"
    compare_lag: int = -1
    #: the learning-rate setting compared (none vs sis): "auto" = the smallest scale in the
    #: regime at N > 1 whose N = 1 run is not (the lag, not the step size, degrades it),
    #: "SxN" (e.g. "3x8"), or "off"
    compare_lr: str = "auto"
    #: algorithms of the mismatch comparison (empty: compare_algos)
    compare_mismatch_algos: tuple[str, ...] = ("grpo",)
    #: updates per rollout in the staleness / mismatch comparisons: SIS corrects pi_theta
    #: against pi_old, so at N = 1 it is an exact identity whatever the staleness or mismatch
    compare_inner_lag: int = 4

    def __post_init__(self):  # fail at --set time, not an hour into the sweep
        if self.algo not in ALGOS:
            raise ValueError(f"grid.algo={self.algo!r}; valid: {ALGOS}")
        bad = [a for a in self.compare_algos if a not in ALGOS]
        if bad:
            raise ValueError(f"grid.compare_algos has unknown {bad}; valid: {ALGOS}")
        bad = [c for c in self.compare_corrections if c not in CORRECTIONS]
        if bad or "none" not in self.compare_corrections:
            raise ValueError(f"grid.compare_corrections={self.compare_corrections}: need 'none' "
                             f"(the control) and names from {CORRECTIONS}")
        for m in self.mismatches:
            parse_mismatch(m)
        if self.compare_mismatch not in ("auto", "off"):
            parse_mismatch(self.compare_mismatch)
        if self.compare_lr not in ("auto", "off"):
            parse_lr_setting(self.compare_lr)
        bad = [a for a in self.compare_mismatch_algos if a not in ALGOS]
        if bad:
            raise ValueError(f"grid.compare_mismatch_algos has unknown {bad}; valid: {ALGOS}")
        if not isinstance(self.compare_inner_lag, int) or self.compare_inner_lag < 1:
            raise ValueError(f"grid.compare_inner_lag={self.compare_inner_lag!r}: need an int >= 1")
        for field in ("lags", "lr_lags", "stalenesses"):
            values = getattr(self, field)
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"grid.{field}={values}: need ints >= 1")
        if 1 not in self.lags:
            raise ValueError(f"grid.lags={self.lags}: must contain 1 (the on-policy baseline)")
        if any(not s > 0 for s in self.lr_scales):
            raise ValueError(f"grid.lr_scales={self.lr_scales}: need values > 0")
        for field in ("seeds", "compare_seeds", "min_minibatch_rows"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"grid.{field}={getattr(self, field)!r}: need an int >= 1")
        if self.compare_seeds < self.seeds:
            raise ValueError(f"grid.compare_seeds={self.compare_seeds} < grid.seeds="
                             f"{self.seeds}: phase 2 reuses phase 1's seeds and adds more")
        for field in ("compare_staleness", "compare_lag"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < -1:
                raise ValueError(f"grid.{field}={getattr(self, field)!r}: need 0 (auto), -1 "
                                 "(off) or a knob value >= 1")
        if not 0 < self.threshold < 1:
            raise ValueError(f"grid.threshold={self.threshold}: need a pass@1 gap in (0, 1)")


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    """The sis_study testbed (``configs.sis_offpolicy.Config`` fields) with a RegimeGrid."""

    seed: int = 0
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = flagship.WARM_START
    rl: GRPOConfig = dataclasses.replace(flagship.Config().rl, sis_diagnostics=True)
    optim: OptimConfig = flagship.Config().optim
    train: ScheduleConfig = ScheduleConfig(rollouts=30, eval_every=10, eval_examples=512,
                                           eval_samples=4, checkpoint_every=10)
    grid: RegimeGrid = RegimeGrid()
    sync: SyncConfig | None = None  # the dense f32 publish, as sis_study
    model: HFSource = HFSource()  # (sis_offpolicy's cell runner reads model.hf_path)
    task_name: str = "worked addition, 3 digits (25-29 token answers)"
    #: run directories of the same experiment whose finished cells (cells.jsonl) count as done
    #: here (cells are deterministic: the same label is the same run), so processes can split
    #: a study and one run can assemble it
    reuse: tuple[str, ...] = ()
    #: run no cell: report the finished ones (own and ``reuse``d) as they are (an interrupted
    #: study's tables; cells still missing are listed in the summary's ``missing``)
    report_only: bool = False

    def __post_init__(self):
        size = self.rl.prompts_per_rollout * self.rl.group_size
        for n in (*self.grid.lags, *self.grid.lr_lags, self.grid.compare_inner_lag):
            rows = max(size, self.grid.min_minibatch_rows * n)
            if rows % self.rl.group_size or rows % n:
                raise ValueError(f"lag {n}: {rows} rows per rollout do not split into whole "
                                 f"groups of rl.group_size={self.rl.group_size} and {n} "
                                 "mini-batches")


#: Task 2: 5-digit worked addition (40-49 token answers; prompts 12 characters). Its own warm
#: start, same recipe as the flagship's (sloppy teacher, 70% of demonstrations drop every
#: carry), with room for the longer sequences.
TASK2_WARM_START = dataclasses.replace(
    flagship.WARM_START,
    model=dataclasses.replace(flagship.WARM_START.model, max_seq_len=80),
    data=flagship.WorkedDataConfig(digits=5),
    train=dataclasses.replace(flagship.WARM_START.train, steps=400, seq_len=80))


def _default() -> Config:
    return Config()


def _quick() -> Config:
    grid = RegimeGrid(lags=(1, 8), lr_scales=(), stalenesses=(4,), mismatches=("bf16+noise1",),
                      seeds=2, compare_algos=("grpo",), compare_corrections=("none", "sis", "tis"),
                      compare_seeds=2, compare_lag=-1, compare_lr="off")
    return Config(grid=grid, train=ScheduleConfig(rollouts=6, eval_every=3, eval_examples=64,
                                                  eval_samples=2, checkpoint_every=3))


def _task2() -> Config:
    """Task 2 at the off-policy setting where task 1 degrades most (asynchronous staleness
    k = 8; see experiments/README.md ``sis_regime``): the lag-1 baseline, that setting, and
    none / sis / tis / sis+tis there for GRPO (``--set grid.compare_algos=grpo,dapo``
    ``--set grid.compare_corrections=none,sis,tis,mis,rs,sis+tis`` is the full protocol), 20
    rollouts, pass@1 on 256 x 4 held-out prompts at rollouts 10 and 20."""
    base = Config()
    rl = dataclasses.replace(base.rl, max_new_tokens=50)
    grid = dataclasses.replace(base.grid, lags=(1,), lr_scales=(), stalenesses=(8,),
                               mismatches=(), compare_algos=("grpo",), compare_staleness=8,
                               compare_corrections=("none", "sis", "tis", "sis+tis"),
                               compare_mismatch="off", compare_lag=-1, compare_lr="off")
    train = ScheduleConfig(rollouts=20, eval_every=10, eval_examples=256, eval_samples=4,
                           checkpoint_every=10)
    return dataclasses.replace(base, pretrain=TASK2_WARM_START, rl=rl, grid=grid, train=train,
                               task_name="worked addition, 5 digits (40-49 token answers)")


def _full() -> Config:
    grid = RegimeGrid(lags=(1, 2, 4, 8, 16, 32, 64), lr_scales=(3.0, 10.0), lr_lags=(1, 8, 16),
                      stalenesses=(1, 2, 4, 8), mismatches=("bf16", "bf16+noise0.5",
                                                            "bf16+noise1", "bf16+noise2",
                                                            "noise1"),
                      seeds=16, compare_algos=("grpo", "dapo", "gspo", "cispo"),
                      compare_seeds=16)
    return Config(grid=grid, train=ScheduleConfig(rollouts=60, eval_every=10, eval_examples=512,
                                                  eval_samples=4, checkpoint_every=10))


get_config = Variants(quick=_quick, default=_default, task2=_task2, full=_full)
VARIANTS = get_config.variants
