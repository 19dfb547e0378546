"""sis_study: does SIS beat no correction under policy lag on the worked-addition testbed?

The ``sis_offpolicy`` grid runner (same driver, same cells, resume, tables) with the
``flagship`` testbed: 3-digit worked addition (25-29 character answers), the flagship's
sloppy-teacher warm start (``configs.flagship.WARM_START``, cached under ``cache_root``) and its
RL settings (16 prompts x G 16 per rollout, temperature 1, lr 1e-4, SIS top-K 8). Each cell is
a fresh run from that warm start; policy lag N = N mini-batch updates per rollout, so
mini-batches 2..N are off-policy. Cells with the same seed share the warm start, the prompts
and the sampling keys, so ``summary.json["paired"]`` compares corrections seed by seed: the
SIS-minus-none difference of the final held-out pass@1 and of the area under the pass@1 curve
(divided by its length), each with a 95% paired t-interval and a bootstrap interval.

pass@1: mean reward over ``train.eval_examples`` fixed held-out prompts x
``train.eval_samples`` samples at temperature 1, fixed sampling key (``summary["pass_at_1"]``).

    python -m jaxflow.run --exp=sis_study --variant=quick      # ~2 min on 2 CPU cores
    python -m jaxflow.run --exp=sis_study --variant=default    # ~2 h: lag 8 x {none, sis} x
                                                               # {grpo, dapo} x 16 seeds + lag 1, 16
    python -m jaxflow.run --exp=sis_study --variant=full       # every algo, mismatch corrections
    python -m jaxflow.run --exp=sis_study --variant=default --set grid.seeds=6 \
        --set train.rollouts=20

Weight sync is off (``sync=none``: the dense f32 publish); ``--set sync.codec=auto`` turns
SparseRL-Sync on as in the flagship.
"""

from __future__ import annotations

import dataclasses

from configs import flagship
from configs.sis_offpolicy import Config, GridConfig, ScheduleConfig
from jaxflow.config import Variants
from jaxflow.rl.policy_loss import ALGOS

DESCRIPTION = "SIS vs no correction under policy lag on worked addition, paired seeds, intervals"
ENTRY = "jaxflow.main.sis_offpolicy:main"
HEADLINES = "jaxflow.study.headlines_rl:sis_offpolicy"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.hf_path", "pretrain.model.lora")

#: The default study: lag 8 with many paired seeds, lags 1 and 16 with fewer.
DEFAULT_GRID = GridConfig(algos=("grpo", "dapo"), corrections=("none", "sis"), lags=(8,),
                          mismatches=(), stalenesses=(), seeds=16, extra_lags=(1, 16),
                          extra_lag_seeds=4)
DEFAULT_SCHEDULE = ScheduleConfig(rollouts=30, eval_every=5, eval_examples=512, eval_samples=4,
                                  checkpoint_every=10)


def _testbed(grid: GridConfig, train: ScheduleConfig) -> Config:
    """sis_offpolicy's Config on the flagship's warm start, task and RL settings."""
    base = flagship.Config()
    return Config(seed=0, cache_root=base.cache_root, pretrain=flagship.WARM_START,
                  rl=base.rl, optim=base.optim, train=train, grid=grid, sync=None)


def _default() -> Config:
    return _testbed(DEFAULT_GRID, DEFAULT_SCHEDULE)


def _quick() -> Config:
    return _testbed(
        dataclasses.replace(DEFAULT_GRID, algos=("grpo",), seeds=2, extra_lags=()),
        ScheduleConfig(rollouts=10, eval_every=5, eval_examples=128, eval_samples=4,
                       checkpoint_every=5))


def _full() -> Config:
    grid = GridConfig(algos=ALGOS, corrections=("none", "sis"), lags=(1, 4, 8, 16),
                      mismatches=("bf16", "noise0.1", "noise0.3"), mismatch_algos=ALGOS,
                      mismatch_corrections=("none", "sis", "tis", "mis", "rs", "sis+tis"),
                      mismatch_lag=8, stalenesses=(1, 2, 4), staleness_algos=("grpo", "dapo"),
                      seeds=16)
    return _testbed(grid, dataclasses.replace(DEFAULT_SCHEDULE, rollouts=60, eval_every=10))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
