"""Log-probs from hidden states and the LM head without holding [B, T, V] logits.

``fused_logprobs(hidden, head, targets, topk_indices, own_topk=K, temperature=T)`` returns
the sampled tokens' log-probs, the log-probs at given top-K indices (pi_old's top-K for SIS)
and optionally the distribution's own top-K (values and indices; stored when old log-probs
are computed, no gradient). Logits are ``(hidden @ head) / T`` in f32 everywhere, so the
sampler and trainer apply the temperature identically.

Backends (``LogprobBackend``):
  xla        lax.scan over vocab tiles of the head with an online logsumexp, gathers and a
             running top-K merge; custom_vjp whose backward also scans the vocab tiles,
             recomputing softmax per tile. The CPU default. Peak extra memory ~ N * tile.
  pallas     ``pallas_kernels.fused_logprobs`` (GPU/TPU; on CPU only with interpret=True).
  reference  ``fused_logprobs_reference``: materialises the logits (the naive baseline).
  auto       (the default, also backend=None) pallas on GPU/TPU where the kernel's forward
             and gradient build for these shapes (compiled alone first, verdict cached per
             shape: ``pallas_kernels.dispatch``), else xla with one warning naming kernel,
             platform, shapes and reason. A forced ``"pallas"`` raises that message instead.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from pallas_kernels import dispatch
from pallas_kernels import fused_logprobs as pallas_fused
from pallas_kernels.dispatch import KernelUnavailable
from pallas_kernels.fused_logprobs import (
    FusedLogprobsBlockSizes,
    FusedLogprobsOutput,
    flatten_rows,
    fused_logprobs_reference,
    unflatten_rows,
    validate_inputs,
)

__all__ = [
    "FusedLogprobsOutput",
    "KernelUnavailable",
    "LogprobBackend",
    "fused_logprobs",
    "fused_logprobs_reference",
    "fused_logprobs_xla",
]

DEFAULT_VOCAB_TILE = 2048


class LogprobBackend(enum.Enum):
    """How token log-probs are computed: ``auto``, ``xla`` (chunked), ``pallas`` (the fused kernel) or ``reference``
    (full logits)."""
    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"
    REFERENCE = "reference"


# ------------------------------------------------------------------------------- XLA path


def _tiles(vocab: int, tile: int):
    """(number of full tiles, width of the remainder tile or 0)."""
    return vocab // tile, vocab % tile


def _gather_in_tile(z, idx, col0, width):
    """z[n, idx[n, k] - col0] where idx falls in [col0, col0 + width), else 0. idx [N, K]."""
    local = idx - col0
    inside = (local >= 0) & (local < width)
    vals = jnp.take_along_axis(z, jnp.clip(local, 0, width - 1), axis=1)
    return jnp.where(inside, vals, 0.0)


def _fwd_tile(carry, w_tile, col0, h, t, kidx, own_topk, temperature):
    m, s, tz, kz, ov, oi = carry
    width = w_tile.shape[1]
    z = jnp.dot(h, w_tile, preferred_element_type=jnp.float32) / temperature
    m_new = jnp.maximum(m, jnp.max(z, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
    tz = tz + _gather_in_tile(z, t[:, None], col0, width)[:, 0]
    if kidx is not None:
        kz = kz + _gather_in_tile(z, kidx, col0, width)
    if own_topk:
        v, i = jax.lax.top_k(z, min(own_topk, width))
        # Carry first: lax.top_k puts the lower position first on ties = lower vocab index.
        cat_v = jnp.concatenate([ov, v], axis=1)
        cat_i = jnp.concatenate([oi, i.astype(jnp.int32) + col0], axis=1)
        ov, pos = jax.lax.top_k(cat_v, own_topk)
        oi = jnp.take_along_axis(cat_i, pos, axis=1)
    return m_new, s, tz, kz, ov, oi


def _xla_forward(h, w, t, kidx, own_topk, temperature, tile):
    n = h.shape[0]
    vocab = w.shape[1]
    nfull, rem = _tiles(vocab, tile)
    step = functools.partial(
        _fwd_tile, h=h, t=t, kidx=kidx, own_topk=own_topk, temperature=temperature
    )
    carry = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
        None if kidx is None else jnp.zeros(kidx.shape, jnp.float32),
        jnp.full((n, own_topk), -jnp.inf, jnp.float32),
        jnp.zeros((n, own_topk), jnp.int32),
    )
    if nfull:

        def body(c, col0):
            w_tile = jax.lax.dynamic_slice_in_dim(w, col0, tile, axis=1)
            return step(c, w_tile, col0), None

        carry, _ = jax.lax.scan(body, carry, jnp.arange(nfull, dtype=jnp.int32) * tile)
    if rem:
        carry = step(carry, w[:, nfull * tile :], nfull * tile)
    m, s, tz, kz, ov, oi = carry
    lse = m + jnp.log(s)
    kz = None if kidx is None else kz - lse[:, None]
    return lse, tz - lse, kz, ov - lse[:, None], oi


def _bwd_tile(dh, w_tile, col0, h, idx, g, total, lse, temperature):
    """Adds this tile's dz @ w_tile^T to dh; returns (dh, h^T @ dz).

    idx [N, J] / g [N, J]: every (index, cotangent) pair of the one-hot terms (the target
    and the given top-K), added to dz in one flat scatter.
    """
    n = h.shape[0]
    width = w_tile.shape[1]
    z = jnp.dot(h, w_tile, preferred_element_type=jnp.float32) / temperature
    dz = -total[:, None] * jnp.exp(z - lse[:, None])
    local = idx - col0
    flat = jnp.arange(n, dtype=jnp.int32)[:, None] * width + local
    flat = jnp.where((local >= 0) & (local < width), flat, n * width)  # n * width: dropped
    dz = dz.reshape(-1).at[flat.reshape(-1)].add(g.reshape(-1), mode="drop").reshape(n, width)
    dz = dz / temperature
    dh = dh + jnp.dot(dz.astype(w_tile.dtype), w_tile.T, preferred_element_type=jnp.float32)
    dw_tile = jnp.dot(h.T, dz.astype(h.dtype), preferred_element_type=jnp.float32)
    return dh, dw_tile


def _xla_backward(h, w, t, kidx, lse, g_t, g_k, temperature, tile):
    d, vocab = w.shape
    nfull, rem = _tiles(vocab, tile)
    idx, g = t[:, None], g_t[:, None]
    if kidx is not None:
        idx, g = jnp.concatenate([idx, kidx], axis=1), jnp.concatenate([g, g_k], axis=1)
    step = functools.partial(
        _bwd_tile, h=h, idx=idx, g=g, total=jnp.sum(g, axis=1), lse=lse,
        temperature=temperature,
    )
    dh = jnp.zeros(h.shape, jnp.float32)
    dw = jnp.zeros((d, vocab), w.dtype)
    if nfull:

        def body(c, col0):
            dh, dw = c
            w_tile = jax.lax.dynamic_slice_in_dim(w, col0, tile, axis=1)
            dh, dw_tile = step(dh, w_tile, col0)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_tile.astype(w.dtype), col0, axis=1)
            return (dh, dw), None

        (dh, dw), _ = jax.lax.scan(body, (dh, dw), jnp.arange(nfull, dtype=jnp.int32) * tile)
    if rem:
        dh, dw_tile = step(dh, w[:, nfull * tile :], nfull * tile)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_tile.astype(w.dtype), nfull * tile, axis=1)
    return dh.astype(h.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _xla_fused_2d(h, w, t, kidx, own_topk, temperature, tile):
    return _xla_fused_fwd(h, w, t, kidx, own_topk, temperature, tile)[0]


def _xla_fused_fwd(h, w, t, kidx, own_topk, temperature, tile):
    lse, tlp, klp, ov, oi = _xla_forward(h, w, t, kidx, own_topk, temperature, tile)
    return (tlp, klp, ov, oi), (h, w, t, kidx, lse)


def _xla_fused_bwd(own_topk, temperature, tile, res, cts):
    h, w, t, kidx, lse = res
    g_t, g_k, _, _ = cts  # own top-K carries no gradient by contract
    dh, dw = _xla_backward(h, w, t, kidx, lse, g_t, g_k, temperature, tile)
    zero_t = jnp.zeros(t.shape, jax.dtypes.float0)
    zero_k = None if kidx is None else jnp.zeros(kidx.shape, jax.dtypes.float0)
    return dh, dw, zero_t, zero_k


_xla_fused_2d.defvjp(_xla_fused_fwd, _xla_fused_bwd)


def fused_logprobs_xla(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
    vocab_tile: int = DEFAULT_VOCAB_TILE,
) -> FusedLogprobsOutput:
    """The chunked XLA path (see module docstring); same contract as ``fused_logprobs``."""
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)
    h, t, k, lead = flatten_rows(hidden, targets, topk_indices)
    return unflatten_rows(_xla_rows(h, head, t, k, own_topk, temperature, vocab_tile), lead)


def _xla_rows(h, head, t, k, own_topk, temperature, vocab_tile) -> FusedLogprobsOutput:
    """The XLA path on validated rows (h [N, d], t [N], k [N, K] | None)."""
    if not isinstance(vocab_tile, int) or vocab_tile < 1:
        raise ValueError(f"vocab_tile must be a positive int, got {vocab_tile!r}")
    tile = min(vocab_tile, head.shape[1])
    if h.shape[0] * tile >= 2**31:  # the backward's flat int32 scatter index
        raise ValueError(
            f"rows * vocab_tile = {h.shape[0]} * {tile} must be < 2**31; lower vocab_tile or "
            "split the batch"
        )
    tlp, klp, ov, oi = _xla_fused_2d(h, head, t, k, own_topk, float(temperature), tile)
    return FusedLogprobsOutput(tlp, klp, jax.lax.stop_gradient(ov) if own_topk else None,
                               oi if own_topk else None)


# ------------------------------------------------------------------------------- dispatch


def _parse_backend(backend: LogprobBackend | str | None) -> LogprobBackend:
    if backend is None:
        return LogprobBackend.AUTO
    if isinstance(backend, LogprobBackend):
        return backend
    try:
        return LogprobBackend(backend)
    except ValueError:
        valid = ", ".join(repr(b.value) for b in LogprobBackend)
        raise ValueError(f"unknown log-prob backend {backend!r}; valid: {valid} or None") from None


def _kernel_call(block_sizes, interpret, own_topk, temperature):
    """The Pallas call on validated rows as this trace will run it: under a mesh context
    (``jax.set_mesh``), wrapped in a shard_map that splits the rows over every mesh axis (the
    head replicated; its gradient summed by shard_map's transpose), so no kernel is left for
    the automatic partitioner (which Mosaic TPU refuses)."""
    kw = dict(own_topk=own_topk, temperature=float(temperature), block_sizes=block_sizes,
              interpret=interpret)
    context, mesh = dispatch.partition_context()

    def local(h, w, t, k):
        return pallas_fused.fused_logprobs_rows(h, w, t, k, **kw)

    if context != "mesh":
        return local
    rows = P(tuple(mesh.axis_names))

    def sharded(h, w, t, k):
        n = t.shape[0]
        pad = (-n) % mesh.size
        h2 = jnp.pad(h, ((0, pad), (0, 0)))
        t2 = jnp.pad(t, (0, pad))
        k2 = None if k is None else jnp.pad(k, ((0, pad), (0, 0)))
        explicit = any(a == AxisType.Explicit for a in mesh.axis_types)
        if explicit:  # shard_map wants explicitly sharded inputs laid out as its in_specs
            h2, t2, w = jax.reshard(h2, rows), jax.reshard(t2, rows), jax.reshard(w, P())
            k2 = None if k2 is None else jax.reshard(k2, rows)
        out = jax.shard_map(local, in_specs=(rows, P(), rows, None if k is None else rows),
                            out_specs=FusedLogprobsOutput(
                                rows, None if k is None else rows,
                                rows if own_topk else None, rows if own_topk else None),
                            check_vma=False)(h2, w, t2, k2)
        if explicit:  # the padded rows are cut below; explicit row shards cannot be sliced
            out = jax.tree.map(lambda x: jax.reshard(x, P()), out)
        return jax.tree.map(lambda x: x[:n], out)

    return sharded


def use_pallas(hidden, head, targets, topk_indices, *, own_topk: int, temperature: float,
               mode: str, block_sizes: FusedLogprobsBlockSizes | None = None) -> bool:
    """Whether ``fused_logprobs`` runs the Pallas kernel (forward and backward) here.

    The verdict (``pallas_kernels.dispatch``) builds the kernel's forward and gradient for
    these shapes on this platform, as this trace would call it (``_kernel_call``); mode
    "auto" falls back to XLA with one warning, "pallas" raises ``KernelUnavailable``."""
    blocks = block_sizes or FusedLogprobsBlockSizes.get_default(
        d=head.shape[0], dtype=head.dtype,
        num_ids=1 + (0 if topk_indices is None else topk_indices.shape[-1]))
    call = _kernel_call(blocks, False, own_topk, temperature)

    def fwd_and_grad(h, w, t, *k):
        h, t, k, _ = flatten_rows(h, t, k[0] if k else None)

        def loss(h, w):
            out = call(h, w, t, k)
            total = jnp.sum(out.target_logp)
            return total if k is None else total + jnp.sum(out.topk_logp)

        return jax.grad(loss, argnums=(0, 1))(h, w)

    args = (hidden, head, targets) + (() if topk_indices is None else (topk_indices,))
    return dispatch.choose_kernel(
        "fused_logprobs", mode, fwd_and_grad, args, options=(own_topk, float(temperature), blocks),
        blocked=dispatch.auto_partition_problem(dispatch.backend_platform()))


def fused_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
    backend: LogprobBackend | str | None = None,
    vocab_tile: int = DEFAULT_VOCAB_TILE,
    block_sizes: FusedLogprobsBlockSizes | None = None,
    interpret: bool = False,
) -> FusedLogprobsOutput:
    """Log-probs of ``targets`` (and at ``topk_indices``) under softmax((hidden @ head) / T).

    Args:
      hidden: [B, T, d] (any leading shape) hidden states, same float dtype as ``head``.
      head: [d, V] LM head.
      targets: [B, T] int sampled token ids in [0, V) (ids outside it are not checked).
      topk_indices: optional [B, T, K] int indices (e.g. pi_old's top-K for SIS).
      own_topk: K' > 0 also returns the distribution's own top-K' (stop-gradient).
      temperature: logits are divided by it (> 0).
      backend: "auto" / None (the Pallas kernel on GPU/TPU where it builds for these
        shapes, else XLA with one warning), "xla", "pallas" (forced: raises
        ``KernelUnavailable`` where it does not build; with ``interpret=True`` it runs in
        interpret mode anywhere) or "reference".
      vocab_tile: vocab columns per step of the XLA path.
      block_sizes, interpret: Pallas kernel options.

    Returns:
      FusedLogprobsOutput(target_logp [B, T], topk_logp [B, T, K] | None,
      own_topk_logp [B, T, K'] | None, own_topk_indices [B, T, K'] int32 | None), all f32
      log-probs. Gradients flow to ``hidden`` and ``head`` through the first two.
    """
    choice = _parse_backend(backend)
    kwargs = dict(own_topk=own_topk, temperature=temperature)
    if choice is LogprobBackend.REFERENCE:  # validates its own inputs
        return fused_logprobs_reference(hidden, head, targets, topk_indices, **kwargs)
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)  # once
    run_kernel = choice is LogprobBackend.PALLAS and interpret
    if not run_kernel and choice is not LogprobBackend.XLA:
        run_kernel = use_pallas(hidden, head, targets, topk_indices, mode=choice.value,
                                block_sizes=block_sizes, **kwargs)
    h, t, k, lead = flatten_rows(hidden, targets, topk_indices)
    if run_kernel:
        out = _kernel_call(block_sizes, interpret, own_topk, temperature)(h, head, t, k)
    else:
        out = _xla_rows(h, head, t, k, own_topk, temperature, vocab_tile)
    return unflatten_rows(out, lead)
