"""bench_kernels: every Pallas kernel (and attention backend) vs its XLA reference, one row each.

    python -m jaxflow.run --exp=bench_kernels --variant=quick    # CPU, interpret mode, < 1 min
    python -m jaxflow.run --exp=bench_kernels --variant=default  # the same shapes, 20 pairs
    python -m jaxflow.run --exp=bench_kernels --variant=full     # GPU / TPU, production shapes
    python -m jaxflow.run --exp=bench_kernels --variant=full --set kernels=attention

Per kernel: max error vs the reference (max |a - b| / max(1, max |b|) over every output and
gradient; sync kernels count mismatching elements, which must be 0), within the kernel's
tolerance; median time of each side over ``pairs`` alternated (kernel, reference) pairs after a
compiled warm-up, and the median per-pair ratio; temporary bytes from
``compiled.memory_analysis()``; achieved bandwidth (a stated bytes-read + written model, also as
a fraction of the bandwidth of an elementwise pass over ``copy_bytes`` measured in the same
run) or FLOP/s (a stated FLOP model). Kernels: fused log-probs fwd+bwd (vs the chunked XLA path),
embedding bag fwd+bwd (vs take + masked sum and its scatter-add gradient), sync diff/compact and
scatter/apply (vs their jnp references), and each attention backend fwd+bwd vs ``xla``.

``quick`` runs the kernel tests' shapes in interpret mode on the CPU: correctness only, its
times measure the Pallas interpreter, not a kernel. ``full`` runs the production shapes of
``pallas_kernels.catalog`` (fused log-probs 8,192 tokens x d 4,096 x V 151,936 bf16, K 100;
embedding bag 10M x 128 f32, 16,384 bags of 32; sync 64M uint16 at 0.6% change, capacity 1M)
and attention at B 1, H 32, D 128, bf16 at 8k and 32k tokens. A side that does not build or
run on the platform (no kernel for it, out of memory) is recorded with its reason.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants, require_finite, require_positive
from jaxflow.config_domains import COUNT, COUNT0, INT64_MAX, SEED, UNIT, Int, domains

DESCRIPTION = "Pallas kernels and attention backends vs XLA: error, time, temp bytes, GB/s, FLOP/s"
ENTRY = "jaxflow.main.bench_kernels:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_kernels"
KERNELS = ("fused_logprobs", "embedding_bag", "sync_diff_compact", "sync_scatter_apply",
           "attention")
SIZES = ("test", "production")
DTYPES = ("float32", "bfloat16")


@domains(tokens=COUNT, batch=COUNT, heads=COUNT, kv_heads=COUNT, head_dim=COUNT, segments=COUNT)
@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    backends: tuple[str, ...] = ("auto", "splash", "flash", "cudnn")  # each vs "xla"
    tokens: tuple[int, ...] = (8192, 32768)
    batch: int = 1
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    dtype: str = "bfloat16"
    segments: int = 1  # packed sequences per row (equal lengths; segment ids 1..segments)

    def __post_init__(self):
        require_positive(self, "batch", "heads", "kv_heads", "head_dim", "segments")
        if not self.tokens or any(t < 1 for t in self.tokens):
            raise ValueError(f"attention.tokens={self.tokens}; valid: positive token counts")
        if self.heads % self.kv_heads:
            raise ValueError(f"attention.heads={self.heads} must be a multiple of kv_heads="
                             f"{self.kv_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"attention.dtype={self.dtype!r}; valid: {', '.join(DTYPES)}")


@domains(seed=SEED, change_fraction=UNIT, pairs=COUNT, warmup=COUNT0, copy_bytes=Int(1, INT64_MAX))
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    kernels: tuple[str, ...] = KERNELS
    size: str = "production"  # pallas_kernels.catalog sizes: test | production
    interpret: bool | None = None  # None: interpret mode exactly when not on a GPU / TPU
    change_fraction: float = 0.006  # sync kernels: elements that differ between versions
    pairs: int = 10  # alternated (kernel, reference) timing pairs
    warmup: int = 1  # untimed calls of each side after the compiling one
    copy_bytes: int = 2**30  # the bandwidth yardstick: an elementwise pass over this many bytes
    attention: AttentionConfig = AttentionConfig()

    def __post_init__(self):
        bad = [k for k in self.kernels if k not in KERNELS]
        if bad or not self.kernels:
            raise ValueError(f"kernels={self.kernels}; valid: a non-empty subset of "
                             f"{', '.join(KERNELS)}")
        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r}; valid: {', '.join(SIZES)}")
        require_positive(self, "pairs", "copy_bytes")
        require_positive(self, "warmup", allow_zero=True)
        require_finite(self, "change_fraction", positive=True)
        if self.change_fraction > 1:
            raise ValueError(f"change_fraction={self.change_fraction}; valid: (0, 1]")


def _quick() -> Config:
    return Config(size="test", pairs=10, warmup=0, change_fraction=0.04, copy_bytes=2**22,
                  attention=AttentionConfig(tokens=(256,), heads=2, kv_heads=1, head_dim=64,
                                            dtype="float32", segments=2))


def _default() -> Config:  # test shapes, more pairs, attention at 1k tokens (a laptop)
    return Config(size="test", pairs=20, change_fraction=0.05, copy_bytes=2**24,
                  attention=AttentionConfig(tokens=(1024,), heads=4, kv_heads=2, head_dim=64,
                                            dtype="float32", segments=2))


def _full() -> Config:
    return Config(size="production", pairs=10)


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
