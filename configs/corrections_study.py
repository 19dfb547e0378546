"""corrections_study: every off-policy correction of the menu, ranked in each degraded regime.

The successor of ``sis_regime``'s phase 2, on the same testbed (3-digit worked addition, the
flagship's sloppy-teacher warm start and RL settings: 16 prompts x G 16, temperature 1,
lr 1e-4, SIS top-8), every cell a fresh run from the warm start with paired seeds
(:mod:`jaxflow.rl.corrections_study`):

* **staleness** (``study.staleness`` = 4 rollouts, ``study.inner_lag`` = 4 updates per
  rollout) and **lr** (lr x ``study.lr_scale`` = 3 at policy lag ``study.lr_lag`` = 8), the two
  settings ``sis_regime`` found degraded: every correction of ``study.corrections`` (default: all
  of ``jaxflow.rl.policy_loss.CORRECTIONS``: none, sis, sis_b, tis, mis, rs, their combinations
  and the menu: icepop, seq-mask-tis, geo-rs(+tis / +seq-tis / +token-mis), m2po(+mis),
  prime-masks) for every algorithm of ``study.algos`` with ``study.seeds`` paired seeds, and
  the on-policy lag-1 run to the same seeds (is the regime degraded?). Under pure policy lag the
  behaviour corrections see rho = pi_old / mu ~ 1 (sampler and trainer in f32); they run anyway.
* **moe**: a small Qwen3-MoE warm start (``moe_pretrain``: 2 layers, d 64, 4 experts top-2,
  qk-norm; pretrained like the dense one, cached), sampled in bf16 and trained in f32
  (``study.moe_mismatch``) at ``study.moe_lag`` updates per rollout, without R3
  (``routing_replay="record"``: the trainer routes anew and logs the router disagreement) and
  with it (``"replay"``), for the corrections ``study.moe_corrections``.

The report ranks the corrections per regime and algorithm by their paired final-pass@1 effect
against none (95% t-interval), beside each correction's policy-loss step overhead: alternated
(none, correction) pairs (``study.overhead_pairs``) of the loss step on ``bench_policy_loss``'s
quick synthetic rollout, run once per run directory after the cells (the cells get a loaded
machine's CPU first) and kept in ``overheads.json``; SIS's figure from
the latest ``bench_policy_loss`` record in ``experiments/results`` too, when there is one.

    python -m jaxflow.run --exp=corrections_study --variant=quick     # 14 cells, ~2.5 CPU-minutes
    python -m jaxflow.run --exp=corrections_study --out experiments/studies/corrections   # the study
    python -m jaxflow.run --exp=corrections_study --out experiments/studies/corrections --resume

The default study is 640 cells (GRPO and DAPO: 16 lag-1 controls, 19 corrections x 8 seeds in
each dense regime; 16 MoE cells), ~40-50 CPU-seconds each (a 30-rollout cell with three
held-out evaluations; measured at nice 19 under load ~20: 334 s wall): ~8 CPU-hours.

Cells resume: the finished ones in ``cells.jsonl`` count as done, the running one restarts from
its checkpoint; ``reuse`` adds other run directories' finished cells (labels equal
``sis_regime``'s phase-2 cells, so its run directories can be reused), ``report_only`` reports
what is done (with ``reuse`` into a new run directory: ``--resume`` takes only the run's own
config). The tables of a run directory, partial or complete, at any time (running no cell,
measuring nothing, writing nothing; the missing cells show as missing)::

    python -m jaxflow.rl.corrections_study_report experiments/studies/corrections [MORE_DIRS]
    python -m jaxflow.run --exp=corrections_study --out NEW --set reuse=DIR --set report_only=true
"""

from __future__ import annotations

import dataclasses

from configs import flagship
from configs.lm_pretrain import Config as PretrainConfig
from configs.sis_offpolicy import ScheduleConfig
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, POSITIVE, SEED, domains
from jaxflow.models.pretrained import HFSource
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import ALGOS, CORRECTIONS
from jaxflow.rl.rollout import parse_mismatch
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("Every off-policy correction (sis, sis_b, tis, mis, rs, the menu) ranked in the "
               "staleness, lr-at-lag and MoE (with / without R3) regimes, paired seeds")
ENTRY = "jaxflow.main.corrections_study:main"
HEADLINES = "jaxflow.study.headlines_rl:corrections_study"
READS = ("pretrain.model.lora",)

#: the regimes the study compares corrections in, in run order after the first
REGIMES = ("staleness", "lr", "moe")


@domains(seeds=COUNT, staleness=COUNT, inner_lag=COUNT, lr_scale=POSITIVE, lr_lag=COUNT, moe_lag=COUNT,
         overhead_pairs=COUNT)
@dataclasses.dataclass(frozen=True)
class StudyGrid:
    """Which cells run (see the module doc); cells run regime by regime in ``regimes`` order,
    algorithm by algorithm, seeds outermost within a block (a partial block has whole seeds)."""

    algos: tuple[str, ...] = ("grpo", "dapo")
    corrections: tuple[str, ...] = CORRECTIONS
    seeds: int = 8
    regimes: tuple[str, ...] = REGIMES
    staleness: int = 4
    inner_lag: int = 4
    lr_scale: float = 3.0
    lr_lag: int = 8
    moe_algos: tuple[str, ...] = ("grpo",)
    moe_corrections: tuple[str, ...] = ("none",)
    moe_mismatch: str = "bf16"
    moe_lag: int = 4
    #: alternated (none, correction) loss-step pairs per correction for the overhead column
    overhead_pairs: int = 10

    def __post_init__(self):  # fail at --set time, not hours into the study
        for field, valid in (("algos", ALGOS), ("moe_algos", ALGOS), ("corrections", CORRECTIONS),
                             ("moe_corrections", CORRECTIONS), ("regimes", REGIMES)):
            bad = [v for v in getattr(self, field) if v not in valid]
            if bad or not getattr(self, field):
                raise ValueError(f"study.{field}={getattr(self, field)}: unknown {bad}; valid: {valid}")
        for field in ("corrections", "moe_corrections"):
            if "none" not in getattr(self, field):
                raise ValueError(f"study.{field}={getattr(self, field)}: need 'none' (the control)")
        if parse_mismatch(self.moe_mismatch)[0] == "none":
            raise ValueError(f"study.moe_mismatch={self.moe_mismatch!r}: the MoE regime needs a "
                             "sampler mismatch (e.g. 'bf16')")
        for field in ("seeds", "staleness", "inner_lag", "lr_lag", "moe_lag", "overhead_pairs"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"study.{field}={value!r}: need an int >= 1")
        if not self.lr_scale > 0:
            raise ValueError(f"study.lr_scale={self.lr_scale}: need a value > 0")


#: The MoE regime's warm start: the flagship's recipe on a Qwen3-MoE-shaped policy (qk-norm,
#: 4 experts, top-2 renormalised, every layer MoE; ~0.15 M parameters).
MOE_WARM_START = dataclasses.replace(
    flagship.WARM_START,
    model=dataclasses.replace(flagship.WARM_START.model, qk_norm=True, n_experts=4, n_experts_per_token=2,
                              d_ff_expert=64, architecture="qwen3_moe"))


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    """The ``sis_regime`` testbed with a :class:`StudyGrid` and the MoE warm start."""

    seed: int = 0
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = flagship.WARM_START
    moe_pretrain: PretrainConfig = MOE_WARM_START
    rl: GRPOConfig = dataclasses.replace(flagship.Config().rl, sis_diagnostics=True)
    optim: OptimConfig = flagship.Config().optim
    train: ScheduleConfig = ScheduleConfig(rollouts=30, eval_every=10, eval_examples=512,
                                           eval_samples=4, checkpoint_every=10)
    study: StudyGrid = StudyGrid()
    sync: SyncConfig | None = None  # the dense f32 publish, as sis_regime
    model: HFSource = HFSource()  # (the cell runner's tokenizer reads model.hf_path; "" here)
    task_name: str = "worked addition, 3 digits (25-29 token answers)"
    #: run directories whose finished cells (cells.jsonl) count as done here (same labels =
    #: same runs), so processes can split the study and one run can assemble it
    reuse: tuple[str, ...] = ()
    #: run no cell: report the finished ones (own and ``reuse``d); missing ones are listed
    report_only: bool = False

    def __post_init__(self):
        if not self.moe_pretrain.model.n_experts:
            raise ValueError("moe_pretrain.model.n_experts=0: the MoE regime needs an MoE policy "
                             "(n_experts > 0)")
        size = self.rl.prompts_per_rollout * self.rl.group_size
        for n in (self.study.inner_lag, self.study.lr_lag, self.study.moe_lag):
            if size % n:
                raise ValueError(f"lag {n}: {size} rows per rollout do not split into {n} mini-batches")


def _default() -> Config:
    return Config()


def _quick() -> Config:
    """Every code path once, in about two minutes on 2 cores: the lag-1 control, none and sis_b
    (the behaviour top-K record) in both dense regimes, the MoE cells without and with R3, GRPO,
    2 seeds (paired intervals), 4 rollouts of 8 prompts x G 8, one evaluation per cell; the
    default's regimes otherwise (staleness 2 so the stale version advances within 4 rollouts).
    Measured with the warm starts cached, three runs at load ~9-11 on 2 cores: 147, 125 and 128
    CPU-s (376, 269 and 237 s wall): mostly compiling, each of the 7 cell configurations its own GRPO update
    (more than half of the compile time) and the samplers once per policy (and for sis_b's
    top-K); the second seed's cells take 1-4 s each. The former quick (18 cells, 6 rollouts of
    16 x 16) took 209 CPU-s."""
    study = StudyGrid(algos=("grpo",), corrections=("none", "sis_b"), seeds=2, staleness=2, overhead_pairs=2)
    rl = dataclasses.replace(Config().rl, prompts_per_rollout=8, group_size=8)
    return Config(study=study, rl=rl, train=ScheduleConfig(rollouts=4, eval_every=4, eval_examples=32,
                                                           eval_samples=2, checkpoint_every=4))


get_config = Variants(quick=_quick, default=_default)
VARIANTS = get_config.variants
