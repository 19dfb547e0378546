"""bench_rollout: the paged rollout engine vs the static sampler: useful tokens/s and peak KV
bytes at equal slots and KV budget.

    python -m jaxflow.run --exp=bench_rollout --variant=quick     # 64 sequences; 4.5M stand-in for the large shape
    python -m jaxflow.run --exp=bench_rollout --variant=default   # flagship + ~100M shape, 256 sequences
    python -m jaxflow.run --exp=bench_rollout --set large=none    # the flagship only
    python -m jaxflow.run --exp=bench_rollout --variant=full --compile-only --target=tpu-v5p:4x4x4

``full`` runs the default's CPU cases and adds ``serve``, the production engine for
``--compile-only``: one Qwen3-8B engine replica (``serve.model_parallel`` chips, K/V heads and
weights tensor-parallel; a pod runs one such engine per group of chips), 256 slots of 4k tokens
in 64-token pages, its prefill and decode programs compiled for the target's chips.

Cases (``requests`` sequences each): ``equal`` (every answer ``max_new`` tokens), ``long_tail``
(lognormal output lengths, median ``tail_median_frac * max_new``, log-std ``tail_sigma``, the
mass above the cap at the cap), ``grpo`` (``requests / group_size`` prompts x G samples, the
long-tailed lengths; the engine prefills each prompt once, the baselines every copy). Prompt
lengths uniform in [P / 2, P]. Lengths are forced by a logits hook that gives EOS its hazard
at every step, identically in every arm (random-init weights; see
``jaxflow/rollout/bench_arms.py``). Useful tokens: up to and including EOS. Every arm is
run once untimed on the exact workload first (compiles every shape it hits); then ``pairs``
alternated rounds (engine, static; reversed every other round).
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, POSITIVE, SEED, Real, domains
from jaxflow.models.transformer import TransformerConfig

DESCRIPTION = ("paged rollout engine vs static sampler: useful tokens/s, "
               "peak KV bytes (equal / long-tailed / GRPO lengths)")
ENTRY = "jaxflow.main.bench_rollout:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_rollout"

#: The flagship's model (configs/flagship.py WARM_START.model), random init.
FLAGSHIP = TransformerConfig(vocab_size=23, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                             d_ff=128, max_seq_len=80)
#: A ~100M-parameter shape: d 768, 12 layers, 12 heads, SwiGLU 2048, vocab 8192 (97.5M).
LARGE = TransformerConfig(vocab_size=8192, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
                          d_ff=2048, max_seq_len=128)
#: The quick variant's stand-in for LARGE: d 256, 4 layers (4.5M).
MEDIUM = TransformerConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                           d_ff=768, max_seq_len=128)


@domains(prompt_len=COUNT, max_new=COUNT, slots=COUNT, page_size=COUNT, pairs=COUNT, decode_steps=COUNT,
         prefill_rows=COUNT, loop_steps=COUNT0, loop_refill=COUNT)
@dataclasses.dataclass(frozen=True)
class ModelCase:
    """One model and its shapes: prompts of P = ``prompt_len`` tokens at most, answers of N =
    ``max_new`` at most, ``slots`` rows, ``page_size`` tokens per KV page, ``pairs`` rounds; the
    engine's ``decode_steps`` per decode call and ``prefill_rows`` prompts per prefill call
    (many steps / rows where host overhead dominates, as on the flagship's tiny model; one step
    and few rows where compute dominates: a finished row idles for the rest of a call, and a
    prefill call computes all its rows)."""

    name: str = "flagship"
    model: TransformerConfig = FLAGSHIP
    prompt_len: int = 16
    max_new: int = 64
    slots: int = 32
    page_size: int = 8
    pairs: int = 10
    decode_steps: int = 8
    loop_steps: int = 64  # engine: decode steps of one compiled loop while no request waits (0: off)
    # ... returning once this many slots freed while work is queued; at ``slots`` or more a loop
    # with work queued runs until every row has ended: the static sampler's waves (keep < slots)
    loop_refill: int = 16
    prefill_rows: int = 32

    def __post_init__(self):
        require_positive(self, "prompt_len", "max_new", "slots", "page_size", "pairs",
                         "decode_steps", "prefill_rows")
        if self.prompt_len + self.max_new > self.model.max_seq_len:
            raise ValueError(f"{self.name}: prompt_len {self.prompt_len} + max_new {self.max_new} "
                             f"exceeds model.max_seq_len={self.model.max_seq_len}")


@domains(n_layers=COUNT, model_parallel=COUNT, slots=COUNT, prompt_len=COUNT, max_new=COUNT, page_size=COUNT,
         prefill_rows=COUNT, prefill_chunk=COUNT, decode_steps=COUNT)
@dataclasses.dataclass(frozen=True)
class ServeCase:
    """The production engine ``--compile-only`` compiles (variant ``full``): ``model`` (a
    ``configs/hf`` name) on a mesh of ``model_parallel`` chips (weights and K/V heads over
    "model"), ``slots`` sequences of ``prompt_len + max_new`` tokens in pages of ``page_size``,
    a pool of exactly slots x pages_per_seq pages (+ the null page), ``prefill_rows`` x
    ``prefill_chunk`` prefill calls, ``decode_steps`` per decode call, bf16 weights (the sync
    replica), ``attention`` as EngineConfig; ``n_layers`` None: the model's (fewer: a quick
    compile of the same widths, as the compile gate's tests do)."""

    model: str = "qwen3-8b"
    n_layers: int | None = None
    model_parallel: int = 8
    slots: int = 256
    prompt_len: int = 1024
    max_new: int = 3072
    page_size: int = 64
    prefill_rows: int = 8
    prefill_chunk: int = 512
    decode_steps: int = 1
    attention: str = "auto"

    def __post_init__(self):
        require_positive(self, "model_parallel", "slots", "prompt_len", "max_new", "page_size",
                         "prefill_rows", "prefill_chunk", "decode_steps")
        if self.n_layers is not None:
            require_positive(self, "n_layers")


@domains(seed=SEED, devices=COUNT, requests=COUNT, group_size=COUNT, tail_median_frac=Real(0.0, 1.0, low_open=True),
         tail_sigma=NON_NEGATIVE, temperature=POSITIVE, prefill_calls=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    devices: int | None = 1
    requests: int = 256  # sequences per case
    group_size: int = 8  # G of the grpo case
    cases: tuple[str, ...] = ("equal", "long_tail", "grpo")
    run_flagship: bool = True  # False: the large model only
    flagship: ModelCase = ModelCase()
    large: ModelCase | None = ModelCase(name="large_100m", model=LARGE, prompt_len=16,
                                        max_new=16, slots=32, page_size=8, pairs=10,
                                        decode_steps=1, prefill_rows=8)
    tail_median_frac: float = 0.125  # long-tailed lengths: lognormal median / cap
    tail_sigma: float = 1.0  # ... and its log-std
    temperature: float = 1.0
    prefill_calls: int = 2  # engine: prefill calls per step at most
    serve: ServeCase | None = None  # --compile-only's production engine (variant full)

    def __post_init__(self):
        require_positive(self, "requests", "group_size", "prefill_calls")
        bad = set(self.cases) - {"equal", "long_tail", "grpo"}
        if bad or not self.cases:
            raise ValueError(f"cases={self.cases}: valid: equal, long_tail, grpo (at least one)")
        if "grpo" in self.cases and self.requests % self.group_size:
            raise ValueError(f"requests={self.requests} must be a multiple of "
                             f"group_size={self.group_size}")
        if not 0 < self.tail_median_frac <= 1 or self.tail_sigma <= 0:
            raise ValueError(f"tail_median_frac={self.tail_median_frac} must be in (0, 1] and "
                             f"tail_sigma={self.tail_sigma} > 0")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 (the hook forces "
                             "lengths through the sampled distribution)")

    def models(self) -> tuple[ModelCase, ...]:
        """The model cases to run."""
        models = ((self.flagship,) if self.run_flagship else ()) + (
            () if self.large is None else (self.large,))
        if not models:
            raise ValueError("run_flagship=False and large=None: no model to run")
        return models


def _quick() -> Config:
    # loop_refill = slots / 2, as the default's 16 of 32
    return Config(requests=64, flagship=ModelCase(max_new=32, slots=16, pairs=3, loop_refill=8),
                  large=ModelCase(name="medium_standin", model=MEDIUM, prompt_len=16, max_new=16,
                                  slots=16, page_size=8, pairs=3, decode_steps=2, prefill_rows=8,
                                  loop_refill=8))


def _full() -> Config:
    return Config(serve=ServeCase())


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
