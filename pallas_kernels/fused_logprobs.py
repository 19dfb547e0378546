"""Fused LM-head log-probs: log-softmax gathers without materialising [N, V] logits.

Given hidden states h [N, d], the LM head W [d, V] and a temperature T, the logits are
``z = (h @ W) / T`` (f32 accumulation). The op returns

  target_logp   [N]     log_softmax(z)[n, targets[n]]
  topk_logp     [N, K]  log_softmax(z)[n, topk_indices[n, k]]      (given indices)
  own_topk_logp [N, K'] the K' largest log-probs of each row, descending  (no gradient)
  own_topk_idx  [N, K'] their vocabulary indices (int32; ties: lower index first)

``fused_logprobs_reference`` below materialises the logits and defines the semantics.
``fused_logprobs`` is the Pallas kernel: a grid over row blocks, and inside each program a
loop over vocab tiles of W with an online logsumexp, the gathers and a running top-K merge
(selection by max/where only, no sort). Its backward (``fused_logprobs_bwd.py``) recomputes
the logits tile by tile: dz = (scatter(g) - (sum g) * softmax(z)) / T.

The in-kernel vocab loop (rather than a vocab grid axis) follows the GPU Pallas attention
kernel: it keeps each output block owned by one program, so no cross-program accumulation.
On CPU the kernel only runs with ``interpret=True``; the CPU default path is the XLA one in
``jaxflow.rl.logprobs``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fused_logprobs_bwd

_NEG_INF = float("-inf")


class FusedLogprobsOutput(NamedTuple):
    """Outputs of the fused log-prob ops; absent parts are None."""

    target_logp: jax.Array  # [N] f32
    topk_logp: jax.Array | None  # [N, K] f32 at the given indices
    own_topk_logp: jax.Array | None  # [N, K'] f32, descending (stop-gradient)
    own_topk_indices: jax.Array | None  # [N, K'] int32


@dataclasses.dataclass(frozen=True)
class FusedLogprobsBlockSizes:
    """Rows per program (block_n) and vocab columns per inner-loop tile (block_v)."""

    block_n: int = 64
    block_v: int = 512

    @classmethod
    def get_default(cls) -> "FusedLogprobsBlockSizes":
        return cls()


def validate_inputs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None,
    own_topk: int,
    temperature: float,
) -> None:
    """Raises ValueError / TypeError naming the bad value (shared by every backend)."""
    if hidden.ndim < 2:
        raise ValueError(f"hidden must be [..., d], got shape {hidden.shape}")
    if head.ndim != 2:
        raise ValueError(f"head must be [d, V], got shape {head.shape}")
    if hidden.shape[-1] != head.shape[0]:
        raise ValueError(
            f"hidden's last dim {hidden.shape[-1]} must equal head's first dim {head.shape[0]} "
            f"(hidden {hidden.shape}, head {head.shape})"
        )
    for name, x in (("hidden", hidden), ("head", head)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if hidden.dtype != head.dtype:
        raise TypeError(f"hidden dtype {hidden.dtype} differs from head dtype {head.dtype}; cast one")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets shape {targets.shape} must equal hidden's leading shape {hidden.shape[:-1]}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if topk_indices is not None:
        if topk_indices.ndim != hidden.ndim or topk_indices.shape[:-1] != hidden.shape[:-1]:
            raise ValueError(
                f"topk_indices shape {topk_indices.shape} must be {hidden.shape[:-1]} + (K,)"
            )
        if not jnp.issubdtype(topk_indices.dtype, jnp.integer):
            raise TypeError(f"topk_indices must be integer, got dtype {topk_indices.dtype}")
    vocab = head.shape[1]
    if not isinstance(own_topk, int) or own_topk < 0 or own_topk > vocab:
        raise ValueError(f"own_topk must be an int in [0, V={vocab}], got {own_topk!r}")
    if not float(temperature) > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def fused_logprobs_reference(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
) -> FusedLogprobsOutput:
    """Pure-jnp semantics (materialises [N, V] logits). Shapes as in the module docstring."""
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)
    logits = jnp.dot(hidden, head, preferred_element_type=jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    topk_logp = None
    if topk_indices is not None:
        topk_logp = jnp.take_along_axis(logp, topk_indices.astype(jnp.int32), axis=-1)
    own_vals = own_idx = None
    if own_topk:
        own_vals, own_idx = jax.lax.top_k(jax.lax.stop_gradient(logp), own_topk)
        own_idx = own_idx.astype(jnp.int32)
    return FusedLogprobsOutput(target_logp, topk_logp, own_vals, own_idx)


# ----------------------------------------------------------------------------- kernel helpers


tile_logits = fused_logprobs_bwd.tile_logits


def _select_max(vals, ids, big):
    """Row max of vals and the smallest id attaining it; that entry is removed (-inf)."""
    best = jnp.max(vals, axis=1)
    hit = vals == best[:, None]
    best_id = jnp.min(jnp.where(hit, ids, big), axis=1)
    removed = jnp.where(hit & (ids == best_id[:, None]), _NEG_INF, vals)
    return best, best_id, removed


def merge_topk(carry_v, carry_i, z, cols, k):
    """Top-k of (carry, tile) by k rounds of max selection. Ties: lower vocab index first."""
    big = jnp.iinfo(jnp.int32).max
    kpos = jax.lax.broadcasted_iota(jnp.int32, carry_v.shape, 1)
    new_v = jnp.full_like(carry_v, _NEG_INF)
    new_i = jnp.zeros_like(carry_i)
    for j in range(k):
        a, a_id, a_rest = _select_max(carry_v, carry_i, big)
        b, b_id, b_rest = _select_max(z, cols, big)
        # The carry holds lower vocab indices than this tile, so it wins ties.
        take_a = (a > b) | ((a == b) & (a_id < b_id))
        carry_v = jnp.where(take_a[:, None], a_rest, carry_v)
        z = jnp.where(take_a[:, None], z, b_rest)
        new_v = jnp.where(kpos == j, jnp.where(take_a, a, b)[:, None], new_v)
        new_i = jnp.where(kpos == j, jnp.where(take_a, a_id, b_id)[:, None], new_i)
    return new_v, new_i


def gather_columns(z, cols, idx):
    """z[n, idx[n, k]] for idx inside this tile, else 0: [bn, K]."""
    out = []
    for j in range(idx.shape[1]):
        out.append(jnp.sum(jnp.where(cols == idx[:, j : j + 1], z, 0.0), axis=1))
    return jnp.stack(out, axis=1)


def _fwd_kernel(
    h_ref, w_ref, t_ref, k_ref,  # inputs
    lse_ref, tz_ref, kz_ref, ov_ref, oi_ref,  # outputs
    *, vocab, block_v, num_tiles, temperature, num_given, own_topk,
):
    h = h_ref[...]
    t = t_ref[...]
    kidx = k_ref[...]
    bn = h.shape[0]

    def body(i, carry):
        m, s, tz, kz, ov, oi = carry
        col0 = i * block_v
        w = w_ref[:, pl.ds(pl.multiple_of(col0, block_v), block_v)]
        z, cols = tile_logits(h, w, col0, vocab, temperature)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        tz = tz + jnp.sum(jnp.where(cols == t[:, None], z, 0.0), axis=1)
        if num_given:
            kz = kz + gather_columns(z, cols, kidx)
        if own_topk:
            ov, oi = merge_topk(ov, oi, z, cols, own_topk)
        return m_new, s, tz, kz, ov, oi

    init = (
        jnp.full((bn,), _NEG_INF, jnp.float32),
        jnp.zeros((bn,), jnp.float32),
        jnp.zeros((bn,), jnp.float32),
        jnp.zeros((bn, max(num_given, 1)), jnp.float32),
        jnp.full((bn, max(own_topk, 1)), _NEG_INF, jnp.float32),
        jnp.zeros((bn, max(own_topk, 1)), jnp.int32),
    )
    m, s, tz, kz, ov, oi = jax.lax.fori_loop(0, num_tiles, body, init)
    lse = m + jnp.log(s)
    lse_ref[...] = lse
    tz_ref[...] = tz - lse
    kz_ref[...] = kz - lse[:, None]
    ov_ref[...] = ov - lse[:, None]
    oi_ref[...] = oi


def _pad_to(x, axis, multiple, value=0):
    size = x.shape[axis]
    pad = (-size) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _fwd_call(h, w, t, kidx, own_topk, temperature, blocks, interpret):
    """Runs the forward kernel on padded operands. Returns lse and the log-prob outputs."""
    n, d = h.shape
    vocab = w.shape[1]
    bn, bv = blocks.block_n, min(blocks.block_v, pl.next_power_of_2(vocab))
    num_given = 0 if kidx is None else kidx.shape[1]
    kg, ko = max(num_given, 1), max(own_topk, 1)
    hp = _pad_to(h, 0, bn)
    wp = _pad_to(w, 1, bv)
    tp = _pad_to(t.astype(jnp.int32), 0, bn)
    kp = jnp.zeros((hp.shape[0], 1), jnp.int32) if kidx is None else _pad_to(kidx.astype(jnp.int32), 0, bn)
    np_ = hp.shape[0]
    kernel = functools.partial(
        _fwd_kernel, vocab=vocab, block_v=bv, num_tiles=wp.shape[1] // bv,
        temperature=float(temperature), num_given=num_given, own_topk=own_topk,
    )
    row = lambda i: (i,)  # noqa: E731
    row2 = lambda i: (i, 0)  # noqa: E731
    out_shape = (
        jax.ShapeDtypeStruct((np_,), jnp.float32),
        jax.ShapeDtypeStruct((np_,), jnp.float32),
        jax.ShapeDtypeStruct((np_, kg), jnp.float32),
        jax.ShapeDtypeStruct((np_, ko), jnp.float32),
        jax.ShapeDtypeStruct((np_, ko), jnp.int32),
    )
    lse, tlp, klp, ov, oi = pl.pallas_call(
        kernel,
        grid=(np_ // bn,),
        in_specs=[
            pl.BlockSpec((bn, d), row2),
            pl.BlockSpec((d, wp.shape[1]), lambda i: (0, 0)),
            pl.BlockSpec((bn,), row),
            pl.BlockSpec((bn, kp.shape[1]), row2),
        ],
        out_specs=[
            pl.BlockSpec((bn,), row),
            pl.BlockSpec((bn,), row),
            pl.BlockSpec((bn, kg), row2),
            pl.BlockSpec((bn, ko), row2),
            pl.BlockSpec((bn, ko), row2),
        ],
        out_shape=out_shape,
        interpret=interpret,
        name="fused_logprobs_fwd",
    )(hp, wp, tp, kp)
    return lse[:n], tlp[:n], klp[:n, :num_given], ov[:n, :own_topk], oi[:n, :own_topk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_logprobs_2d(h, w, t, kidx, own_topk, temperature, blocks, interpret):
    out, _ = _fused_fwd(h, w, t, kidx, own_topk, temperature, blocks, interpret)
    return out


def _fused_fwd(h, w, t, kidx, own_topk, temperature, blocks, interpret):
    lse, tlp, klp, ov, oi = _fwd_call(h, w, t, kidx, own_topk, temperature, blocks, interpret)
    return (tlp, klp, ov, oi), (h, w, t, kidx, lse)


def _fused_bwd(own_topk, temperature, blocks, interpret, res, cts):
    h, w, t, kidx, lse = res
    g_t, g_k, _, _ = cts  # own top-K outputs carry no gradient by contract
    dh, dw = fused_logprobs_bwd.fused_logprobs_backward(
        h, w, t, kidx, lse, g_t, g_k if kidx is not None else None,
        temperature=temperature, block_n=blocks.block_n, block_v=blocks.block_v,
        interpret=interpret,
    )
    zero_t = jnp.zeros(t.shape, jax.dtypes.float0)
    zero_k = None if kidx is None else jnp.zeros(kidx.shape, jax.dtypes.float0)
    return dh, dw, zero_t, zero_k


_fused_logprobs_2d.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(
    jax.jit, static_argnames=("own_topk", "temperature", "block_sizes", "interpret")
)
def fused_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    topk_indices: jax.Array | None = None,
    *,
    own_topk: int = 0,
    temperature: float = 1.0,
    block_sizes: FusedLogprobsBlockSizes | None = None,
    interpret: bool = False,
) -> FusedLogprobsOutput:
    """Pallas fused log-probs. hidden [..., d], head [d, V], targets [...] int,
    topk_indices [..., K] int or None; outputs shaped [...] / [..., K] (see module docstring).

    Differentiable in hidden and head (target_logp and topk_logp); own top-K is stop-gradient.
    """
    validate_inputs(hidden, head, targets, topk_indices, own_topk, temperature)
    blocks = block_sizes or FusedLogprobsBlockSizes.get_default()
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).astype(jnp.int32)
    kidx = None if topk_indices is None else topk_indices.reshape(h.shape[0], -1).astype(jnp.int32)
    tlp, klp, ov, oi = _fused_logprobs_2d(h, head, t, kidx, own_topk, float(temperature), blocks, interpret)
    ov, oi = jax.lax.stop_gradient(ov), jax.lax.stop_gradient(oi)
    return FusedLogprobsOutput(
        tlp.reshape(lead),
        None if kidx is None else klp.reshape(lead + (kidx.shape[1],)),
        ov.reshape(lead + (own_topk,)) if own_topk else None,
        oi.reshape(lead + (own_topk,)) if own_topk else None,
    )
