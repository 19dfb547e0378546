"""sis_offpolicy: does SIS keep GRPO / DAPO / GSPO / CISPO accurate when training goes off-policy?

Warm start: an ``lm_pretrain`` checkpoint (2-digit addition, tiny model) trained on the fly and
cached under ``cache_root`` (``runs/_cache/lm_pretrain-<config hash>``), so RL starts at a
20-60% sampled pass rate. Then, per cell, a fresh GRPO-style run from that checkpoint:

  base grid       algos x corrections x lags            (mismatch "none", staleness 0)
  mismatch cells  mismatch_algos x mismatch_corrections x mismatches at lag mismatch_lag
  staleness cells staleness_algos x corrections x stalenesses (lag 1)

each for ``seeds`` seeds; held-out greedy accuracy after ``train.rollouts`` rollouts.

    python -m jaxflow.run --exp=sis_offpolicy --variant=quick      # ~3-5 min on 2 CPU cores
    python -m jaxflow.run --exp=sis_offpolicy --variant=default    # the ~2 h grid, 3 seeds
    python -m jaxflow.run --exp=sis_offpolicy --variant=default --set grid.algos=grpo

Weight sync: ``--set sync.codec=entropy --set sync.every=4`` makes each cell's trainer publish
through SparseRL-Sync to a bf16 rollout replica every 4 rollouts (``every`` counts rollouts; see
jaxflow.rl.grpo); the default ``sync=none`` is the dense f32 publish of the results in
experiments/README.md. Weight sync does not combine with staleness cells (k > 0).

Checkpoint: ``--set model.hf_path=DIR`` starts every cell from a local Hugging Face checkpoint
(Llama / Qwen3 / Qwen3-MoE; its tokenizer.json replaces the character tokenizer) instead of
the lm_pretrain warm start.

Roles: with >= 2 devices the trainer and the rollout sampler live on disjoint sub-meshes
(``roles.rollout_devices`` for the sampler, the rest for the trainer); on a 1-device CPU, or
with ``--set roles.colocate=true``, both roles share every device (reported as ``roles``).
"""

from __future__ import annotations

import dataclasses

from configs.lm_pretrain import Config as PretrainConfig
from configs.lm_pretrain import DataConfig, TrainConfig
from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, COUNT0, SEED, domains
from jaxflow.mesh import RolesConfig
from jaxflow.models.pretrained import HFSource
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import ALGOS, CORRECTIONS
from jaxflow.rl.rollout import parse_mismatch
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "SIS vs GRPO/DAPO/GSPO/CISPO under policy lag, staleness and sampler mismatch"
ENTRY = "jaxflow.main.sis_offpolicy:main"
HEADLINES = "jaxflow.study.headlines_rl:sis_offpolicy"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.hf_path", "pretrain.model.lora")

#: The warm-start recipe: ~85k-param model, 2-digit addition, ~2 min on a 2-core CPU.
WARM_START = PretrainConfig(
    seed=0,
    model=TransformerConfig(vocab_size=23, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                            d_ff=128, max_seq_len=32),
    data=DataConfig(max_digits=2, heldout_mod=20),
    train=TrainConfig(steps=300, batch_size=32, seq_len=32, log_every=50, eval_every=300,
                      eval_examples=256, checkpoint_every=300, keep_checkpoints=1),
    optim=OptimConfig(lr=3e-3, warmup_steps=20),
)


@domains(lags=COUNT, mismatch_lag=COUNT, stalenesses=COUNT0, seeds=COUNT, extra_lags=COUNT, extra_lag_seeds=COUNT)
@dataclasses.dataclass(frozen=True)
class GridConfig:
    """The cells. Tuples of names; empty tuples switch a block of cells off."""

    algos: tuple[str, ...] = ("grpo", "dapo", "gspo", "cispo")
    corrections: tuple[str, ...] = ("none", "sis")
    lags: tuple[int, ...] = (1, 4, 8, 16)
    mismatches: tuple[str, ...] = ("noise0.3",)
    mismatch_algos: tuple[str, ...] = ("grpo",)
    mismatch_corrections: tuple[str, ...] = ("none", "tis", "mis", "sis+tis")
    mismatch_lag: int = 4
    stalenesses: tuple[int, ...] = ()
    staleness_algos: tuple[str, ...] = ("grpo",)
    seeds: int = 3
    #: algos x corrections x extra_lags with their own (usually fewer) ``extra_lag_seeds``
    extra_lags: tuple[int, ...] = ()
    extra_lag_seeds: int = 1

    def __post_init__(self):  # fail at --set time, not an hour into the sweep
        for field, valid in (("algos", ALGOS), ("mismatch_algos", ALGOS),
                             ("staleness_algos", ALGOS), ("corrections", CORRECTIONS),
                             ("mismatch_corrections", CORRECTIONS)):
            bad = [v for v in getattr(self, field) if v not in valid]
            if bad:
                raise ValueError(f"grid.{field} has unknown {bad}; valid: {valid}")
        for m in self.mismatches:
            parse_mismatch(m)
        for field in ("lags", "extra_lags", "stalenesses"):
            if any(not isinstance(v, int) or v < (0 if field == "stalenesses" else 1)
                   for v in getattr(self, field)):
                raise ValueError(f"grid.{field}={getattr(self, field)}: need ints "
                                 f"{'>= 0' if field == 'stalenesses' else '>= 1'}")
        if self.mismatch_lag < 1 or self.seeds < 1 or self.extra_lag_seeds < 1:
            raise ValueError(f"grid.mismatch_lag={self.mismatch_lag}, grid.seeds={self.seeds} "
                             f"and grid.extra_lag_seeds={self.extra_lag_seeds} must be >= 1")


@domains(rollouts=COUNT, eval_every=COUNT, eval_examples=COUNT, eval_samples=COUNT, checkpoint_every=COUNT)
@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Per cell: rollouts (each = one batch + ``lag`` optimizer steps), eval, checkpoints.

    The headline accuracy is held-out pass@1 at the RL temperature, ``eval_samples`` samples
    of each of ``eval_examples`` held-out prompts; greedy accuracy is logged beside it.
    """

    rollouts: int = 40
    eval_every: int = 10
    eval_examples: int = 256
    eval_samples: int = 4
    checkpoint_every: int = 10

    def __post_init__(self):
        require_positive(self, "rollouts", "eval_every", "eval_examples", "eval_samples",
                         "checkpoint_every")


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = WARM_START
    rl: GRPOConfig = GRPOConfig(prompts_per_rollout=8, group_size=8, temperature=1.0,
                                max_new_tokens=4, sis_topk=8)
    optim: OptimConfig = OptimConfig(lr=2e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)
    train: ScheduleConfig = ScheduleConfig()
    grid: GridConfig = GridConfig()
    roles: RolesConfig = RolesConfig()
    sync: SyncConfig | None = None  # --set sync.codec=entropy turns SparseRL-Sync on
    model: HFSource = HFSource()  # --set model.hf_path=DIR: RL on a local HF checkpoint

    def __post_init__(self):
        if self.sync is not None and (self.grid.stalenesses or self.rl.staleness):
            raise ValueError(f"sync.codec={self.sync.codec!r} with grid.stalenesses="
                             f"{self.grid.stalenesses} / rl.staleness={self.rl.staleness}: weight "
                             "sync needs staleness 0; set grid.stalenesses= (empty) or "
                             "sync=none")
        size = self.rl.rollout_size
        bad = [n for n in (*self.grid.lags, *self.grid.extra_lags, self.grid.mismatch_lag)
               if size % n]
        if bad:
            raise ValueError(f"lags {bad} do not divide the rollout size rl.prompts_per_rollout"
                             f" * rl.group_size = {size}")


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        grid=GridConfig(algos=("grpo",), corrections=("none", "sis"), lags=(1, 8),
                        mismatches=("noise0.3",), mismatch_corrections=("tis", "sis+tis"),
                        mismatch_lag=8, seeds=1),
        train=ScheduleConfig(rollouts=16, eval_every=8, eval_examples=128,
                             eval_samples=4, checkpoint_every=8),
    )


def _full() -> Config:
    base = Config()
    # SA-GCPO joins the algorithms here (not in the ~2 h default); rl.loss.agg is None by
    # default, so each algorithm uses its own default aggregation (token-mean; seq-mean-token-
    # mean for gspo, as GSPO and verl, and for sa_gcpo, as OxygenREC). Rewards are 0/1 with no per-request
    # target, so SA-GCPO's
    # target gate does not apply: it is the soft gate on group-normalised advantages.
    return dataclasses.replace(
        base,
        grid=dataclasses.replace(base.grid, algos=(*base.grid.algos, "sa_gcpo"),
                                 mismatches=("bf16", "noise0.1", "noise0.3"),
                                 stalenesses=(1, 2, 4), seeds=5),
        train=ScheduleConfig(rollouts=100, eval_every=10, eval_examples=512,
                             checkpoint_every=10),
    )


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
