"""Segment attention by backend: one switch for the LM, the VLM backbone and the ViT encoder.

``attention(q, k, v, segment_ids, backend=..., causal=True)`` computes packed-sequence
self-attention: token t attends to the tokens s of its own segment, s <= t when ``causal``
(the LM; the default) and every one of them otherwise (the ViT encoder's bidirectional
attention within an image); segment 0 is padding (a real token never attends to it). GQA:
k / v carry K heads, each serving H/K query heads. Backends (``ATTENTION_BACKENDS``):

  xla     ``jaxflow.models.attention.dot_product_attention`` with :func:`segment_mask`:
          the reference (a materialised [B, T, T] mask and f32 [B, H, T, T] scores). The CPU
          default.
  splash  TPU: the upstream splash attention kernel
          (``jax.experimental.pallas.ops.tpu.splash_attention``, Mosaic TPU), causal mask (or
          a full one, non-causal) + segment ids, vmapped over the batch. GQA natively: the
          grouped ``make_splash_mha`` form reads each K/V head for its H/K query heads
          (nothing repeated).
  flash   GPU: the upstream Pallas flash attention ``jax.experimental.pallas.ops.gpu.attention
          .mha`` (Triton: it passes ``plgpu.CompilerParams``), ``causal=`` + segment ids. The
          kernel indexes K/V by the query head, so GQA repeats K/V H/K times (materialised).
  cudnn   GPU: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN flash
          attention; bf16 / f16 only, head dim a multiple of 8, <= 128 before Hopper and
          <= 256 from Hopper on). GQA natively. The public API has no segment ids, so packed
          segments enter as a boolean [B, 1, T, T] mask (cuDNN turns it into a bf16 bias, and
          its backward writes the bias gradient: O(B T^2) bytes, one head) with
          ``is_causal=True`` so that cuDNN skips the blocks above the diagonal. Non-causal,
          the mask is "same segment" alone (``is_causal=False``): padding queries attend to
          the padding keys, so no row is fully masked.
  auto    per platform (``resolve_attention_backend``): CPU -> xla; TPU -> splash; GPU ->
          cudnn for bf16 / f16, then flash; each candidate only where its forward and gradient
          build for these shapes (``pallas_kernels.dispatch.choose_kernel``: compiled alone
          first, verdict cached per shape). Where none does: one warning per kernel and shape,
          then xla. Never raises for a kernel that does not build.

A kernel named explicitly off its platform is a ValueError naming it and what is valid there;
on its platform, a kernel that does not build raises ``KernelUnavailable`` (the verdict's
reason). ``interpret=True`` runs the Pallas kernels (splash, flash) in Pallas interpret mode
on any platform, without a verdict (tests, CPU); cuDNN has no interpret mode.

Padding queries (segment 0) attend to (earlier, when causal) padding keys in the kernels and to
nothing in the reference (zeros); their outputs are finite and meaningless in every backend,
and no real token sees them, so real outputs and their gradients agree. Non-causal, a padding
query always sees at least itself in the kernels (segment 0 == 0), so no kernel meets a fully
masked row (NaN softmax, or NaN gradients through an unused output).

Under a mesh context (``jax.set_mesh``; jaxflow's steps are built with ``jaxflow.mesh.jit_on``)
the Pallas kernels run per shard in a ``shard_map`` (Mosaic TPU refuses automatic
partitioning; Triton would run replicated): rows over the data axes and, under tensor
parallelism, heads over the "model" axis, where the projections already put them
(:func:`shard_layout`); without a context on several devices, ``auto`` does not pick splash
(one warning).
cuDNN attention carries its own partitioning rules.

Flash attention: Dao et al. 2022 / Dao 2023 (FlashAttention-2); splash attention is JAX's
block-sparse TPU variant of it.
"""

from __future__ import annotations

import enum
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxflow.models.attention import dot_product_attention, segment_causal_mask
from pallas_kernels import dispatch
from pallas_kernels.dispatch import KernelUnavailable

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "KernelUnavailable",
    "attention",
    "cudnn_attention",
    "flash_attention",
    "resolve_attention_backend",
    "segment_mask",
    "shard_layout",
    "splash_attention",
    "xla_attention",
]


class AttentionBackend(enum.Enum):
    AUTO = "auto"
    XLA = "xla"
    SPLASH = "splash"
    FLASH = "flash"
    CUDNN = "cudnn"


ATTENTION_BACKENDS = tuple(b.value for b in AttentionBackend)
# Where each kernel runs ("gpu" / "tpu", as ``dispatch.backend_platform`` names platforms).
KERNEL_PLATFORM = {"splash": "tpu", "flash": "gpu", "cudnn": "gpu"}
# auto's candidates per platform, in order of preference.
AUTO_CANDIDATES = {"tpu": ("splash",), "gpu": ("cudnn", "flash")}
# Names under which the dispatch verdicts and warnings report each kernel.
KERNEL_NAMES = {"splash": "splash_attention", "flash": "flash_attention",
                "cudnn": "cudnn_attention"}
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FLASH_BLOCK = 64  # q / k tile of the Triton kernel, forward and backward (T padded to it)
SPLASH_LANES = 128  # splash tiles are multiples of 128 tokens (T padded to it)
SPLASH_BLOCKS = (512, 256, 128)  # largest one dividing the padded length is used


def _platform_name(platform: str) -> str:
    return "gpu" if platform in ("gpu", "cuda") else platform


def resolve_attention_backend(name: str | AttentionBackend, platform: str) -> str:
    """Validates a backend name for ``platform`` ("cpu", "gpu" / "cuda", "tpu").

    Returns "xla", a kernel name ("splash", "flash", "cudnn"), or "auto" on GPU / TPU (decided
    per shape by ``attention``); "auto" on a platform without kernels resolves to "xla".
    Raises ValueError for an unknown name, or a kernel forced off its platform.
    """
    value = name.value if isinstance(name, AttentionBackend) else name
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
    platform = _platform_name(platform)
    if value == "auto":
        return "auto" if platform in AUTO_CANDIDATES else "xla"
    needs = KERNEL_PLATFORM.get(value)
    if needs is not None and needs != platform:
        here = ("auto", "xla") + AUTO_CANDIDATES.get(platform, ())
        raise ValueError(f"attention backend {value!r} runs on {needs} only, but the JAX backend "
                         f"is {platform!r}; valid here: {', '.join(here)}")
    return value


def _check_shapes(q, k, v, segment_ids) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"attention needs q [B, T, H, D] and k, v [B, T, K, D]; got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}")
    b, t, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"attention: k/v {k.shape} must be [B={b}, T={t}, K, D={d}] with K "
                         f"dividing H={h}")
    if segment_ids.shape != (b, t) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"attention: segment_ids must be int [B={b}, T={t}]; got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")


def _pad_tokens(x: jax.Array, pad: int) -> jax.Array:
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)  # extra tokens: segment 0 (padding)


# -- the backends, each on validated [B, T, H, D] / [B, T, K, D] / [B, T] arguments -----------


def segment_mask(segment_ids: jax.Array, *, causal: bool = True) -> jax.Array:
    """The reference's mask: [B, T] int (0 = padding) -> [B, T, T] bool, True where query t
    may attend to key s: same segment, key not padding, and s <= t when ``causal``
    (``segment_causal_mask``). Padding queries attend to nothing (the reference gives them
    zeros)."""
    if causal:
        return segment_causal_mask(segment_ids)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & (segment_ids != 0)[:, None, :]


def xla_attention(q, k, v, segment_ids, *, causal: bool = True,
                  interpret: bool = False) -> jax.Array:
    """The reference: masked einsum attention under :func:`segment_mask` (``interpret`` is
    ignored). [B, T, H, D]."""
    del interpret
    return dot_product_attention(q, k, v, segment_mask(segment_ids, causal=causal))


def _splash_kernel(t: int, heads: int, block: int, interpret: bool, causal: bool = True):
    # Built per trace: the kernel holds its mask tables as jax arrays, and arrays kept from
    # one trace would enter the next as constants (jax caches the host-side mask processing).
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    head_mask = sa.CausalMask((t, t)) if causal else sa.FullMask((t, t))
    mask = sa.MultiHeadMask([head_mask] * heads)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def splash_attention(q, k, v, segment_ids, *, causal: bool = True,
                     interpret: bool = False) -> jax.Array:
    """TPU splash attention (causal or full mask, segment ids, grouped K/V heads): [B, T, H, D].

    T is padded with padding tokens to a multiple of 128; the tile is the largest of 512 /
    256 / 128 tokens dividing the padded length. Queries are scaled by D^-0.5 (in f32) before
    the kernel, which applies no scale of its own."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    t, h, d = q.shape[1:]
    tp = -(-t // SPLASH_LANES) * SPLASH_LANES
    block = next(s for s in SPLASH_BLOCKS if tp % s == 0)
    pad = tp - t
    q, k, v = (_pad_tokens(x, pad) for x in (q, k, v))
    seg = _pad_tokens(segment_ids.astype(jnp.int32), pad)
    kernel = _splash_kernel(tp, h, block, bool(interpret), bool(causal))
    qh = jnp.swapaxes((q.astype(jnp.float32) * d**-0.5).astype(q.dtype), 1, 2)  # [B, H, T, D]
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, D]
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=s)))(
        qh, kh, vh, seg)
    return jnp.swapaxes(out, 1, 2)[:, :t].astype(q.dtype)


def flash_attention(q, k, v, segment_ids, *, causal: bool = True,
                    interpret: bool = False) -> jax.Array:
    """GPU Pallas (Triton) flash attention, causal or not, with segment ids: [B, T, H, D].

    K/V are repeated to H heads (the kernel reads K/V at the query's head); T is padded
    with padding tokens to a multiple of ``FLASH_BLOCK``."""
    from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha

    t, h, d = q.shape[1:]
    groups = h // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    pad = (-t) % FLASH_BLOCK
    q, k, v = (_pad_tokens(x, pad) for x in (q, k, v))
    seg = _pad_tokens(segment_ids.astype(jnp.int32), pad)
    b = FLASH_BLOCK
    sizes = BlockSizes(block_q=b, block_k=b, block_q_dkv=b, block_kv_dkv=b, block_q_dq=b,
                       block_kv_dq=b)
    out = mha(q, k, v, seg, sm_scale=d**-0.5, causal=bool(causal), block_sizes=sizes,
              interpret=interpret)
    return out[:, :t]


def cudnn_attention(q, k, v, segment_ids, *, causal: bool = True,
                    interpret: bool = False) -> jax.Array:
    """cuDNN flash attention through ``jax.nn.dot_product_attention``: [B, T, H, D].

    Segments as a boolean [B, 1, T, T] mask (see the module docstring; non-causal: same
    segment only, padding queries seeing the padding keys); bf16 / f16 only. ``interpret``
    must be False (cuDNN has no interpret mode)."""
    if interpret:
        raise ValueError("attention backend 'cudnn' has no interpret mode (interpret=True "
                         "applies to the Pallas kernels: splash, flash)")
    if causal:
        mask = segment_causal_mask(segment_ids)[:, None]
    else:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=bool(causal),
                                        implementation="cudnn")


_CALLS = {"xla": xla_attention, "splash": splash_attention, "flash": flash_attention,
          "cudnn": cudnn_attention}


#: The mesh axis tensor parallelism shards attention heads over (``jaxflow.mesh.DEFAULT_RULES``:
#: "heads" and "kv_heads" -> "model").
HEAD_AXIS = "model"


def shard_layout(mesh, heads: int, kv_heads: int) -> tuple[tuple[str, ...], str | None]:
    """(row axes, head axis) of the per-shard kernel call under ``mesh``: heads over
    :data:`HEAD_AXIS` when the mesh has it (size > 1) and it divides both head counts (each
    device keeps the query heads of its own K/V heads, as the TP projections left them),
    rows over every other axis; otherwise rows over every axis and no head axis."""
    tp = mesh.shape.get(HEAD_AXIS, 1)
    if tp > 1 and heads % tp == 0 and kv_heads % tp == 0:
        return tuple(a for a in mesh.axis_names if a != HEAD_AXIS), HEAD_AXIS
    return tuple(mesh.axis_names), None


def _kernel_call(name: str, interpret: bool, causal: bool = True):
    """``name``'s call as this trace runs it: Pallas kernels under a mesh context go into a
    shard_map over the mesh (:func:`shard_layout`: rows over the data axes, padded with padding
    rows to their size, and heads over the tensor-parallel axis)."""
    call = functools.partial(_CALLS[name], interpret=interpret, causal=causal)
    context, mesh = dispatch.partition_context()
    if name not in ("splash", "flash") or context != "mesh":
        return call

    def sharded(q, k, v, seg):
        row_axes, head_axis = shard_layout(mesh, q.shape[2], k.shape[2])
        rows = row_axes or None
        heads = P(rows, None, head_axis, None)
        b = q.shape[0]
        pad = (-b) % math.prod(mesh.shape[a] for a in row_axes)
        q, k, v, seg = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, seg))
        specs = (heads, heads, heads, P(rows, None))
        explicit = any(a == AxisType.Explicit for a in mesh.axis_types)
        if explicit:  # shard_map wants explicitly sharded inputs laid out as its in_specs
            q, k, v, seg = (jax.reshard(x, s) for x, s in zip((q, k, v, seg), specs))
        out = jax.shard_map(call, in_specs=specs, out_specs=heads, check_vma=False)(
            q, k, v, seg)
        if explicit:  # the padded rows are cut below; explicit row shards cannot be sliced
            out = jax.reshard(out, P())
        return out[:b]

    return sharded


def _static_problem(name: str, q) -> str | None:
    """A reason known without building (auto skips such a candidate without a warning)."""
    if name == "cudnn" and jnp.dtype(q.dtype) not in CUDNN_DTYPES:
        return f"cuDNN attention takes bfloat16 / float16, not {jnp.dtype(q.dtype)}"
    if name == "splash":
        return dispatch.auto_partition_problem(dispatch.backend_platform())
    return None


def _uses_kernel(name: str, mode: str, q, k, v, segment_ids, causal: bool = True) -> bool:
    """The dispatch decision for kernel ``name`` (mode "auto": warn and False where it does
    not build; "pallas": raise KernelUnavailable)."""
    call = _kernel_call(name, False, causal)

    def fwd_and_grad(q, k, v, seg):
        return jax.grad(lambda q, k, v: jnp.sum(call(q, k, v, seg).astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    context, mesh = dispatch.partition_context()
    options = (context, None if mesh is None else tuple(mesh.shape.items()))
    if not causal:  # another kernel (mask): its own verdict; causal keys stay as they were
        options += ("non-causal",)
    return dispatch.choose_kernel(KERNEL_NAMES[name], mode, fwd_and_grad,
                                  (q, k, v, jax.ShapeDtypeStruct(jnp.shape(segment_ids), jnp.int32)),
                                  options=options,
                                  blocked=_static_problem(name, q))


def choose_attention_backend(q, k, v, segment_ids, *, backend: str | AttentionBackend = "auto",
                             causal: bool = True) -> str:
    """The backend ``attention`` runs for these arguments here: "xla" or a kernel name.

    Forced kernels are checked (ValueError off their platform, KernelUnavailable where they
    do not build); "auto" tries the platform's candidates in order (see the module docstring).
    """
    _check_shapes(q, k, v, segment_ids)
    platform = _platform_name(dispatch.backend_platform())
    resolved = resolve_attention_backend(backend, platform)
    if resolved == "xla":
        return "xla"
    if resolved != "auto":
        _uses_kernel(resolved, "pallas", q, k, v, segment_ids, causal)
        return resolved
    for name in AUTO_CANDIDATES[platform]:
        if name == "cudnn" and _static_problem(name, q):
            continue  # a documented dtype limit, not a failure: no warning
        if _uses_kernel(name, "auto", q, k, v, segment_ids, causal):
            return name
    return "xla"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
              backend: str | AttentionBackend = "auto", interpret: bool = False,
              causal: bool = True) -> jax.Array:
    """Self-attention within segments, causal or bidirectional, by backend (see the module
    docstring).

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k: [B, T, K, D] keys, K divides H (grouped-query attention).
      v: [B, T, K, D] values.
      segment_ids: [B, T] int; token t attends to the tokens s with the same id (s <= t when
        ``causal``); 0 = padding.
      backend: one of ``ATTENTION_BACKENDS``.
      interpret: with backend "splash" or "flash", run that Pallas kernel in interpret mode,
        on any platform and without a build verdict (other backends ignore it).
      causal: True (the default): key s <= query t only; False: every key of the segment.

    Returns:
      [B, T, H, D] in q.dtype. Rows of padding queries are finite but meaningless.
    """
    value = backend.value if isinstance(backend, AttentionBackend) else backend
    if interpret and value in ("splash", "flash"):
        _check_shapes(q, k, v, segment_ids)
        return _kernel_call(value, True, causal)(q, k, v, segment_ids.astype(jnp.int32))
    name = choose_attention_backend(q, k, v, segment_ids, backend=value, causal=causal)
    return _kernel_call(name, False, causal)(q, k, v, segment_ids).astype(q.dtype)


def catalog_cases() -> list:
    """The kernel backends (splash, flash, cudnn) as ``pallas_kernels.catalog`` cases at test
    and production sizes, forward and forward + gradient, each on its platform: what the
    lowering and compile gates export (``catalog.attention_cases`` with these wrappers; the
    catalog itself imports nothing of jaxflow)."""
    from pallas_kernels import catalog

    return catalog.attention_cases({"splash": splash_attention, "flash": flash_attention,
                                    "cudnn": cudnn_attention})
