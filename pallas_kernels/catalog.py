"""Every Pallas kernel of jaxflow at test and production sizes, per platform, as abstract calls.

``kernel_cases()`` lists 6 Pallas kernels (fused log-probs forward and backward, embedding bag
forward and backward, sync diff/compact and scatter/apply) x 2 sizes, each on both platforms;
``attention_cases(calls)`` the attention kernels a library passes in (``calls``: "splash",
"flash", "cudnn" -> ``fn(q, k, v, segment_ids)``; jaxflow's are
``jaxflow.models.attention_backends.catalog_cases()``), forward and forward + gradient, x 2
sizes, each on its platform: splash (tpu), Pallas flash and cuDNN (cuda). The catalog imports
no library: the kernel floor sits below jaxflow. ``case.build(platform)`` returns
``(fn, args)`` with the platform's default block sizes and ``jax.ShapeDtypeStruct`` args, ready
for ``pallas_kernels.lowering.export_for`` / ``pallas_footprints`` (nothing is allocated).
``case.platforms`` names the platforms a case is built for; ``case.custom_calls`` the
custom-call targets of a kernel that is not a Pallas call (cuDNN attention), which its export
must allow and must contain.

Production sizes: fused log-probs 8,192 tokens, d 4,096, V 151,936 bf16, K 100 given top-K
ids; embedding bag a 10M x 128 f32 table, 16,384 bags of 32; sync 64M uint16 elements with a
1M capacity; attention 1 x 8,192 tokens, 32 query / 8 key-value heads of 128, bf16. Test sizes
are the interpret-mode test shapes of ``tests/test_pallas_*`` and
``tests/test_attention_backends.py``.

cuDNN attention on a host without cuDNN (this CPU): jax reads the local cuDNN version when it
traces the call, for compatibility checks only (the version is not in the lowered module), so
``declared_cudnn`` declares one there, as ``lowering.declared_tpu`` declares a TPU device kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import embedding_bag as eb
from pallas_kernels import fused_logprobs as fl
from pallas_kernels import lowering
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
    # cuDNN takes bf16 / f16 only: its cases use bf16 at every size.
    "attention": {"test": dict(batch=2, tokens=128, heads=4, kv_heads=2, head_dim=16,
                               dtype=jnp.float32),
                  "production": dict(batch=1, tokens=8192, heads=32, kv_heads=8, head_dim=128,
                                     dtype=jnp.bfloat16)},
}
PLATFORMS = ("tpu", "cuda")
CUDNN_ATTENTION_CALLS = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
DECLARED_CUDNN_VERSION = 90800  # cuDNN 9.8 (any >= 9.0: only jax's checks read it)


def block_platform(platform: str) -> str:
    """Export platform ("tpu" / "cuda") -> block-size platform ("tpu" / "gpu")."""
    return "gpu" if platform in ("cuda", "gpu") else "tpu"


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # e.g. "fused_logprobs_bwd"
    size: str  # "test" | "production"
    _build: Callable[[str, str | None], tuple[Callable, tuple]]
    platforms: tuple[str, ...] = PLATFORMS  # export platforms this kernel is built for
    custom_calls: tuple[str, ...] = ()  # a non-Pallas kernel's custom-call targets

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.size}]"

    def build(self, platform: str, chip: str | None = None) -> tuple[Callable, tuple]:
        """(fn, abstract args) for export platform "tpu" or "cuda"; ``chip`` ("v5e", ...,
        "h200", ``pallas_kernels.targets``) picks that chip's block sizes and VMEM limit."""
        return self._build(block_platform(platform), chip)

    def arg_bytes(self, platform: str = "tpu") -> int:
        """Bytes of the case's arguments (to tell "does not fit" from a compile failure)."""
        _, args = self.build(platform)
        return sum(int(math.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
                   for a in jax.tree.leaves(args))

    def export(self, platform: str):
        """``jax.export`` of the case for ``platform`` (``lowering.export_for``, plus this
        kernel's own custom calls allowed)."""
        if platform not in self.platforms:
            raise ValueError(f"{self.name} is built for {', '.join(self.platforms)}, not "
                             f"{platform!r}")
        fn, args = self.build(platform)
        if not self.custom_calls:
            return lowering.export_for(fn, *args, platform=platform)
        checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in self.custom_calls]
        return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


S = jax.ShapeDtypeStruct


def default_blocks(cls, platform: str, chip: str | None, **kw):
    """``cls.get_default(platform, **kw)``, with ``chip=`` where the kernel's defaults are per
    chip generation."""
    if chip is not None and "chip" in inspect.signature(cls.get_default).parameters:
        kw["chip"] = chip
    return cls.get_default(platform, **kw)


def _fused(size: str, backward: bool, params: dict | None = None):
    p = params or SIZES["fused_logprobs"][size]

    def build(bp, chip=None):
        blocks = default_blocks(fl.FusedLogprobsBlockSizes, bp, chip, d=p["d"], dtype=p["dtype"],
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


def _bag(size: str, backward: bool, params: dict | None = None):
    p = params or SIZES["embedding_bag"][size]

    def build(bp, chip=None):
        kw = {"dim": p["dim"]} if "dim" in inspect.signature(
            eb.EmbeddingBagBlockSizes.get_default).parameters else {}
        bs = default_blocks(eb.EmbeddingBagBlockSizes, bp, chip, **kw)
        args = (S((p["vocab"], p["dim"]), p.get("dtype", jnp.float32)),
                S((p["bags"], p["bag_len"]), jnp.int32))

        def fwd(table, ids):
            return eb.embedding_bag(table, ids, mode="mean", block_sizes=bs)

        def bwd(table, ids):
            return jax.grad(lambda t: jnp.sum(eb.embedding_bag(t, ids, mode="mean",
                                                               block_sizes=bs)))(table)

        return (bwd if backward else fwd), args

    return build


def _diff(size: str):
    p = SIZES["sync"][size]

    def build(bp, chip=None):
        bs = default_blocks(dc.BlockSizes, bp, chip)
        u = S((p["n"],), jnp.uint16)
        return (lambda a, b: dc.diff_compact(a, b, capacity=p["capacity"], block_sizes=bs)), (u, u)

    return build


def _scatter(size: str):
    p = SIZES["sync"][size]

    def build(bp, chip=None):
        bs = default_blocks(sa.BlockSizes, bp, chip)
        args = (S((p["n"],), jnp.uint16), S((p["capacity"],), jnp.int32),
                S((p["capacity"],), jnp.uint16))
        return (lambda d, pos, v: sa.scatter_apply(d, pos, v, block_sizes=bs)), args

    return build


@contextlib.contextmanager
def declared_cudnn(version: int = DECLARED_CUDNN_VERSION):
    """Traces cuDNN attention on a host without cuDNN as if ``version`` were installed (a no-op
    where jax finds cuDNN)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax._src.lib import cuda_versions

    if cuda_versions is not None:
        yield
        return
    original = fa.check_cudnn_version
    fa.check_cudnn_version = lambda: version
    try:
        yield
    finally:
        fa.check_cudnn_version = original


def _attention(kernel: str, call: Callable, size: str, backward: bool):
    p = SIZES["attention"][size]

    def build(bp, chip=None):
        del bp, chip  # the wrappers pick their own tiles
        dtype = jnp.bfloat16 if kernel == "cudnn" else p["dtype"]
        b, t, d = p["batch"], p["tokens"], p["head_dim"]
        kv = S((b, t, p["kv_heads"], d), dtype)
        args = (S((b, t, p["heads"], d), dtype), kv, kv, S((b, t), jnp.int32))
        context = declared_cudnn if kernel == "cudnn" else contextlib.nullcontext

        def fwd(q, k, v, seg):
            with context():
                return call(q, k, v, seg)

        def bwd(q, k, v, seg):
            with context():
                return jax.grad(lambda q, k, v: jnp.sum(call(q, k, v, seg).astype(jnp.float32)),
                                argnums=(0, 1, 2))(q, k, v)

        return (bwd if backward else fwd), args

    return build


#: The attention kernels ``attention_cases`` builds, each on its platform.
ATTENTION_PLATFORMS = {"splash": ("tpu",), "flash": ("cuda",), "cudnn": ("cuda",)}


def kernel_cases() -> list[KernelCase]:
    """The 12 Pallas (kernel, size) cases; with 2 platforms, 24 lowerings."""
    out = []
    for size in ("test", "production"):
        out += [KernelCase("fused_logprobs_fwd", size, _fused(size, False)),
                KernelCase("fused_logprobs_bwd", size, _fused(size, True)),
                KernelCase("embedding_bag_fwd", size, _bag(size, False)),
                KernelCase("embedding_bag_bwd", size, _bag(size, True)),
                KernelCase("sync_diff_compact", size, _diff(size)),
                KernelCase("sync_scatter_apply", size, _scatter(size))]
    return out


def attention_cases(calls: dict[str, Callable]) -> list[KernelCase]:
    """The 12 attention (kernel, size) cases, each on its own platform: 12 lowerings.

    calls: one function per kernel of :data:`ATTENTION_PLATFORMS` ("splash", "flash",
      "cudnn"), ``fn(q [B, T, H, D], k [B, T, K, D], v [B, T, K, D], segment_ids [B, T] int32)
      -> [B, T, H, D]``: the library's wrappers (``jaxflow.models.attention_backends``)."""
    if set(calls) != set(ATTENTION_PLATFORMS):
        raise ValueError(f"attention_cases(calls) names {sorted(calls)}; valid: exactly "
                         f"{sorted(ATTENTION_PLATFORMS)}")
    out = []
    for size in ("test", "production"):
        for kernel, platforms in ATTENTION_PLATFORMS.items():
            for backward in (False, True):
                custom = CUDNN_ATTENTION_CALLS[:1 + backward] if kernel == "cudnn" else ()
                out.append(KernelCase(f"{kernel}_attention_{'bwd' if backward else 'fwd'}",
                                      size, _attention(kernel, calls[kernel], size, backward),
                                      platforms, custom))
    return out


# The full matrix of the compile sweep (``sweep_cases``): per-shard vocabularies where the LM
# splits V over its TP axis (151,936 / 4, 262,144 / 8), hidden widths of 4k-8k models, both
# dtypes; every embedding dim users run; the backward program holds the forward kernel too.
SWEEP = {
    "fused_logprobs": [dict(n=8192, d=d, vocab=v, k=100, dtype=dt)
                       for d in (4096, 8192) for v in (37_984, 151_936, 262_144)
                       for dt in (jnp.bfloat16, jnp.float32)],
    "embedding_bag": [dict(vocab=10_000_000, dim=dim, bags=16_384, bag_len=32)
                      for dim in (16, 32, 64, 96, 100, 128, 136, 256)]
    + [dict(vocab=10_000_000, dim=dim, bags=16_384, bag_len=32, dtype=jnp.bfloat16)
       for dim in (64, 128, 136)],
    # bags longer than a TPU program's id chunk (block_l 128; 257 once overflowed the DMA
    # semaphores' 2 KiB) and a Llama-3-405B head (d 16,384, V 128,256: past the measured rows)
    "long_bags": [dict(vocab=1_000_000, dim=128, bags=1024, bag_len=n) for n in (257, 4096)]
    + [dict(vocab=1_000_000, dim=128, bags=1024, bag_len=1000, dtype=jnp.bfloat16)],
    "wide_heads": [dict(n=8192, d=16_384, vocab=128_256, k=100, dtype=jnp.bfloat16)],
}


def _dtype_name(dt) -> str:
    return {"bfloat16": "bf16", "float32": "f32"}.get(jnp.dtype(dt).name, jnp.dtype(dt).name)


def sweep_cases() -> list[KernelCase]:
    """The compile sweep: fused log-probs forward + backward over ``SWEEP`` (d, V, dtype;
    the 405B-class ``wide_heads`` too), embedding bag forward and backward at every dim and
    dtype of ``SWEEP`` and at the ``long_bags`` lengths, sync at 64M
    elements (a bf16 dim-136 backward's temporaries exceed v5e's HBM: "does not fit")."""
    out = []
    for p in SWEEP["fused_logprobs"]:
        size = f"d{p['d']}_v{p['vocab']}_{_dtype_name(p['dtype'])}"
        out.append(KernelCase("fused_logprobs_bwd", size, _fused(size, True, p)))
    for p in SWEEP["wide_heads"]:
        size = f"d{p['d']}_v{p['vocab']}_{_dtype_name(p['dtype'])}"
        out.append(KernelCase("fused_logprobs_bwd", size, _fused(size, True, p)))
    for p in SWEEP["embedding_bag"]:
        size = f"dim{p['dim']}_{_dtype_name(p.get('dtype', jnp.float32))}"
        out += [KernelCase("embedding_bag_fwd", size, _bag(size, False, p)),
                KernelCase("embedding_bag_bwd", size, _bag(size, True, p))]
    for p in SWEEP["long_bags"]:
        size = f"len{p['bag_len']}_{_dtype_name(p.get('dtype', jnp.float32))}"
        out += [KernelCase("embedding_bag_fwd", size, _bag(size, False, p)),
                KernelCase("embedding_bag_bwd", size, _bag(size, True, p))]
    out += [KernelCase("sync_diff_compact", "production", _diff("production")),
            KernelCase("sync_scatter_apply", "production", _scatter("production"))]
    return out
