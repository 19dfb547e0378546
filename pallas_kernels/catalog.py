"""Every Pallas kernel of jaxflow at test and production sizes, per platform, as abstract calls.

``kernel_cases()`` lists 6 kernels (fused log-probs forward and backward, embedding bag forward
and backward, sync diff/compact and scatter/apply) x 2 sizes; ``case.build(platform)`` returns
``(fn, args)`` with the platform's default block sizes and ``jax.ShapeDtypeStruct`` args, ready
for ``pallas_kernels.lowering.export_for`` / ``pallas_footprints`` (nothing is allocated).

Production sizes: fused log-probs 8,192 tokens, d 4,096, V 151,936 bf16, K 100 given top-K
ids; embedding bag a 10M x 128 f32 table, 16,384 bags of 32; sync 64M uint16 elements with a
1M capacity. Test sizes are the interpret-mode test shapes of ``tests/test_pallas_*``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import embedding_bag as eb
from pallas_kernels import fused_logprobs as fl
from pallas_kernels import sync_diff_compact as dc
from pallas_kernels import sync_scatter_apply as sa

SIZES = {
    "fused_logprobs": {"test": dict(n=12, d=16, vocab=300, k=3, dtype=jnp.float32),
                       "production": dict(n=8192, d=4096, vocab=151_936, k=100,
                                          dtype=jnp.bfloat16)},
    "embedding_bag": {"test": dict(vocab=23, dim=136, bags=10, bag_len=3),
                      "production": dict(vocab=10_000_000, dim=128, bags=16_384, bag_len=32)},
    "sync": {"test": dict(n=5000, capacity=256),
             "production": dict(n=64 * 2**20, capacity=2**20)},
}


def block_platform(platform: str) -> str:
    """Export platform ("tpu" / "cuda") -> block-size platform ("tpu" / "gpu")."""
    return "gpu" if platform in ("cuda", "gpu") else "tpu"


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # e.g. "fused_logprobs_bwd"
    size: str  # "test" | "production"
    _build: Callable[[str], tuple[Callable, tuple]]

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.size}]"

    def build(self, platform: str) -> tuple[Callable, tuple]:
        """(fn, abstract args) for export platform "tpu" or "cuda"."""
        return self._build(block_platform(platform))


S = jax.ShapeDtypeStruct


def _fused(size: str, backward: bool):
    p = SIZES["fused_logprobs"][size]

    def build(bp):
        blocks = fl.FusedLogprobsBlockSizes.get_default(bp, d=p["d"], dtype=p["dtype"],
                                                        num_ids=p["k"] + 1)
        args = (S((p["n"], p["d"]), p["dtype"]), S((p["d"], p["vocab"]), p["dtype"]),
                S((p["n"],), jnp.int32), S((p["n"], p["k"]), jnp.int32))

        def fwd(h, w, t, k):
            return fl.fused_logprobs(h, w, t, k, block_sizes=blocks)

        def bwd(h, w, t, k):
            def loss(h, w):
                out = fl.fused_logprobs(h, w, t, k, block_sizes=blocks)
                return jnp.sum(out.target_logp) + jnp.sum(out.topk_logp)
            return jax.grad(loss, argnums=(0, 1))(h, w)

        return (bwd if backward else fwd), args

    return build


def _bag(size: str, backward: bool):
    p = SIZES["embedding_bag"][size]

    def build(bp):
        bs = eb.EmbeddingBagBlockSizes.get_default(bp)
        args = (S((p["vocab"], p["dim"]), jnp.float32), S((p["bags"], p["bag_len"]), jnp.int32))

        def fwd(table, ids):
            return eb.embedding_bag(table, ids, mode="mean", block_sizes=bs)

        def bwd(table, ids):
            return jax.grad(lambda t: jnp.sum(eb.embedding_bag(t, ids, mode="mean",
                                                               block_sizes=bs)))(table)

        return (bwd if backward else fwd), args

    return build


def _diff(size: str):
    p = SIZES["sync"][size]

    def build(bp):
        bs = dc.BlockSizes.get_default(bp)
        u = S((p["n"],), jnp.uint16)
        return (lambda a, b: dc.diff_compact(a, b, capacity=p["capacity"], block_sizes=bs)), (u, u)

    return build


def _scatter(size: str):
    p = SIZES["sync"][size]

    def build(bp):
        bs = sa.BlockSizes.get_default(bp)
        args = (S((p["n"],), jnp.uint16), S((p["capacity"],), jnp.int32),
                S((p["capacity"],), jnp.uint16))
        return (lambda d, pos, v: sa.scatter_apply(d, pos, v, block_sizes=bs)), args

    return build


def kernel_cases() -> list[KernelCase]:
    """The 12 (kernel, size) cases; with 2 platforms, 24 lowerings."""
    out = []
    for size in ("test", "production"):
        out += [KernelCase("fused_logprobs_fwd", size, _fused(size, False)),
                KernelCase("fused_logprobs_bwd", size, _fused(size, True)),
                KernelCase("embedding_bag_fwd", size, _bag(size, False)),
                KernelCase("embedding_bag_bwd", size, _bag(size, True)),
                KernelCase("sync_diff_compact", size, _diff(size)),
                KernelCase("sync_scatter_apply", size, _scatter(size))]
    return out
