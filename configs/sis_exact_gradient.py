"""sis_exact_gradient: bias and variance of off-policy gradient estimators vs the exact gradient.

A tabular softmax policy over a tiny vocabulary and a fixed response length, so every response
can be enumerated and the exact on-policy gradient g of E[R] is known; data come from a
perturbed behaviour policy. See jaxflow/rl/exact_gradient.py for the design.

Run:
    python -m jaxflow.run --exp=sis_exact_gradient --variant=quick     # ~1 min on 2 CPU cores
    python -m jaxflow.run --exp=sis_exact_gradient --variant=default   # ~5 min
    python -m jaxflow.run --exp=sis_exact_gradient --variant=quick --set perturbations=0,0.5
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, NON_NEGATIVE, POSITIVE, SEED, UNIT, domains

DESCRIPTION = ("SIS vs token/sequence IS, TIS, MIS (GRPO/DAPO/GSPO/CISPO/SA-GCPO): exact-gradient "
               "bias and variance on a toy policy")
ENTRY = "jaxflow.main.sis_exact_gradient:main"
HEADLINES = "jaxflow.study.headlines_rl:sis_exact_gradient"


@domains(seed=SEED, vocab=COUNT, length=COUNT, logit_scale=POSITIVE, reward_rate=UNIT, perturbations=NON_NEGATIVE,
         draws=COUNT, batch=COUNT, topk=COUNT, chunk=COUNT, exact_chunk=COUNT, tis_cap=POSITIVE, mis_low=NON_NEGATIVE,
         mis_high=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Config:
    """Attributes:
      seed: seeds the policy, the reward table, the perturbation direction and the draws.
      vocab: |V|; every response of ``length`` tokens is enumerated (vocab ** length of them).
      length: response length (fixed; no EOS).
      logit_scale: std of the current policy's tabular logits.
      reward_rate: each response's reward is 1 with this probability (a fixed random table).
      perturbations: behaviour logits = current + p * eps, eps ~ N(0, 1) (one fixed eps).
      draws: independent draws of each estimator (>= 1000 for stable Monte Carlo checks).
      batch: responses per draw (the estimator averages over them).
      topk: K of the SIS envelope (K = vocab is the exact envelope).
      chunk: draws evaluated per compiled call (memory / progress granularity).
      exact_chunk: responses per compiled call of the exact (enumerated) moments.
      tis_cap, mis_low, mis_high: the TIS / MIS settings of the library defaults.
    """

    seed: int = 0
    vocab: int = 14
    length: int = 3
    logit_scale: float = 1.0
    reward_rate: float = 0.3
    perturbations: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0)
    draws: int = 4000
    batch: int = 16
    topk: int = 14
    chunk: int = 500
    exact_chunk: int = 98
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0


def _quick() -> Config:
    # a smaller vocabulary (512 responses) keeps the quick run (and its test) short
    return Config(vocab=8, topk=8, perturbations=(0.0, 1.0), draws=1000, chunk=1000,
                  exact_chunk=256)


def _full() -> Config:
    return Config(perturbations=(0.0, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0), draws=20000,
                  chunk=1000)


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
