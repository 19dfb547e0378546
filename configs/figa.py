"""figa: SFT on revisions vs DPO vs FIGA, from one warm start, on the model's own revised samples.

Warm start: the ``sis_offpolicy`` recipe (``lm_pretrain``, 2-digit addition, 85k-parameter
decoder; shared cache entry under ``cache_root``). Per seed, the warm start samples answers to
training prompts at temperature 1; every wrong answer that ended with EOS becomes a pair
(original = the sample, revised = the task oracle's minimal revision: the right sum, the
fewest token edits away). SFT (NLL of the revisions), DPO (beta 0.1, the frozen warm start as
reference) and FIGA (token-weighted, ``figa.*``) then train from the same warm start on the
same pairs in the same order for the same steps, batches interleaving (revised, original)
rows. Held-out accuracy (greedy, and pass@1 at temperature 1) every ``train.eval_every`` steps.

    python -m jaxflow.run --exp=figa --variant=quick      # ~2 min on 2 CPU cores (+ warm start)
    python -m jaxflow.run --exp=figa --variant=default
    python -m jaxflow.run --exp=figa --variant=quick --set methods=sft,figa,figa_constant
    python -m jaxflow.run --exp=figa --variant=quick --set figa.neg_nll_min=0.6 --set figa.neg_nll_max=1.0
    python -m jaxflow.run --exp=figa --variant=quick --set lora.rank=8     # LoRA over the warm start

``lora`` (:mod:`jaxflow.models.lora`) trains rank-r adapters over the frozen warm start in every
method (not ``pretrain.model.lora``, which would pretrain adapters over a random base).
"""

from __future__ import annotations

import dataclasses

from configs.lm_pretrain import Config as PretrainConfig
from configs.sis_offpolicy import WARM_START
from jaxflow.align.figa_loss import FigaConfig
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, POSITIVE, SEED, domains
from jaxflow.models.lora import LoraConfig

DESCRIPTION = "FIGA vs SFT-on-revisions vs DPO on the model's own oracle-revised samples (addition)"
ENTRY = "jaxflow.main.figa:main"
HEADLINES = "jaxflow.study.headlines_rl:figa"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("pretrain.model.lora",)
METHODS = ("sft", "dpo", "figa", "figa_constant")


@domains(pairs=COUNT, prompts_per_round=COUNT, samples_per_prompt=COUNT, temperature=POSITIVE, max_rounds=COUNT)
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Pair pool per seed: rounds of ``prompts_per_round`` training prompts x
    ``samples_per_prompt`` samples until ``pairs`` wrong answers are collected (at most
    ``max_rounds`` rounds; the pool is then cut to ``pairs``)."""

    pairs: int = 2048
    prompts_per_round: int = 512
    samples_per_prompt: int = 2
    temperature: float = 1.0
    max_rounds: int = 32

    def __post_init__(self):
        for name in ("pairs", "prompts_per_round", "max_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)!r}: need >= 1")
        if self.samples_per_prompt < 2:
            raise ValueError(f"data.samples_per_prompt={self.samples_per_prompt!r}: need >= 2")
        if not self.temperature > 0:
            raise ValueError(f"data.temperature={self.temperature!r}: need > 0")


@domains(steps=COUNT, pairs_per_batch=COUNT, lr=POSITIVE, grad_clip=POSITIVE, eval_every=COUNT,
         eval_examples=COUNT, eval_samples=COUNT0, log_every=COUNT)
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Each step: ``pairs_per_batch`` pairs = 2x rows (revised, original, ...); Adam, constant
    ``lr``, global-norm clip. Held-out eval every ``eval_every`` steps: greedy accuracy on
    ``eval_examples`` prompts and (``eval_samples`` > 0) pass@1 at temperature 1."""

    steps: int = 150
    pairs_per_batch: int = 16
    lr: float = 3e-4
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_examples: int = 512
    eval_samples: int = 2
    log_every: int = 25

    def __post_init__(self):
        for name in ("steps", "pairs_per_batch", "eval_every", "eval_examples", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)!r}: need >= 1")
        if self.eval_samples < 0 or not self.lr > 0:
            raise ValueError(f"train.eval_samples={self.eval_samples!r} (>= 0) / train.lr="
                             f"{self.lr!r} (> 0)")


@domains(seed=SEED, seeds=COUNT, dpo_beta=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Config:
    """Attributes:
      seed: first seed; seeds ``seed .. seed + seeds - 1`` each draw their own pair pool and
        batch order (shared by all methods of that seed).
      methods: subset of ``METHODS``: "sft", "dpo", "figa", "figa_constant" (the reference
        code's constant-weight ablation, ``figa.constant_*``).
      dpo_beta: DPO's beta.
      figa: FIGA's constants (:class:`jaxflow.align.FigaConfig`); ``weighting`` is set per
        method.
      lora: low-rank adapters trained over the frozen warm start by every method
        (``--set lora.rank=8``; :mod:`jaxflow.models.lora`): fresh adapters (B = 0, so step 0
        and DPO's reference are exactly the warm start), optimizer moments for the adapters
        only, held-out evaluation on the merged weights (``lora.publish`` is unused here).
        Rank 0 (default): full fine-tuning, as without this field.
    """

    seed: int = 0
    seeds: int = 3
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = WARM_START
    methods: tuple[str, ...] = ("sft", "dpo", "figa")
    dpo_beta: float = 0.1
    figa: FigaConfig = FigaConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"methods={self.methods!r} has unknown {bad}; valid: {METHODS}")
        if self.seeds < 1 or not self.dpo_beta > 0:
            raise ValueError(f"seeds={self.seeds!r} (>= 1) / dpo_beta={self.dpo_beta!r} (> 0)")
        if not isinstance(self.lora, LoraConfig):
            raise ValueError(f"lora={self.lora!r}: need a jaxflow.models.lora.LoraConfig")
        if self.lora.enabled and self.pretrain.model.lora.enabled:
            raise ValueError(f"lora.rank={self.lora.rank} with pretrain.model.lora.rank="
                             f"{self.pretrain.model.lora.rank}: the warm start already has adapters; "
                             "set one of them (lora.rank trains adapters over the full warm start)")


def _default() -> Config:
    base = Config()
    return dataclasses.replace(
        base, seeds=5, data=dataclasses.replace(base.data, pairs=8192),
        train=dataclasses.replace(base.train, steps=600, eval_every=50),
        methods=METHODS)


def _full() -> Config:
    base = Config()
    return dataclasses.replace(
        base, seeds=10, data=dataclasses.replace(base.data, pairs=16384, max_rounds=128),
        train=dataclasses.replace(base.train, steps=2000, pairs_per_batch=32,
                                  eval_every=100, eval_examples=1024),
        methods=METHODS)


get_config = Variants(quick=Config, default=_default, full=_full)
VARIANTS = get_config.variants
