"""The FIGA loss: token-weighted likelihood on revised responses, unlikelihood on bad tokens.

FIGA ("Beyond Imitation: Leveraging Fine-grained Quality Signals for Alignment", ICLR 2024).
Rows of a batch are revisions or originals (the reference code interleaves them (revised,
original, revised, ...)); ``marks`` come from :func:`jaxflow.align.marking.figa_marks`. With
``NLL_t = -logp_t`` per token::

    "figa" (the paper's main method):
      revised row:   w_t = alpha  where mark_t = +1,  gamma elsewhere
      original row:  w_t = -beta  where mark_t = -1 and neg_nll_min <= NLL_t <= neg_nll_max
                            (the model still likes the bad token), 0 elsewhere
    "constant" (the reference code's constant-weight ablation):
      every row:     w_t = constant_marked where mark_t = +1, constant_other elsewhere

    loss = sum_t w_t NLL_t / #{t : w_t != 0}     ("figa")
    loss = sum_t w_t NLL_t / #{unmasked t}       ("constant", as the reference code)

A negative weight is gradient *ascent* on that token's NLL. The keep window is detached (a
comparison), so the gradient is ``-w_t grad logp_t / count``. Defaults: alpha 1, beta 0.5,
gamma 0, keep window NLL <= 0.6, constant weights 1 / -0.5 (the reference code's
``cook_ratio`` / ``cook_ratio2``).

Note on the keep window: the FIGA reference code's current version (``modeling_llama.py``,
"contra" branch) keeps a negative mark where ``NLL <= 0.6`` (p >= ~0.55), as the paper note
states and as the default here. Its first commit kept ``0.6 <= NLL <= 1.0`` instead (it zeroed
the mark where ``NLL < 0.6 or NLL > 1.0``); ``FigaConfig(neg_nll_min=0.6, neg_nll_max=1.0)``
reproduces that older window. The constant
variant here does not give the original's end-of-sequence token weight ``constant_marked`` as
the reference code's masks do (its marks follow the paper: originals carry only -1 / 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.config_domains import FINITE, NON_NEGATIVE, domains
from jaxflow.rl.masks import as_bool_mask

WEIGHTINGS = ("figa", "constant")


@domains(alpha=FINITE, beta=FINITE, gamma=FINITE, neg_nll_min=NON_NEGATIVE, neg_nll_max=NON_NEGATIVE,
         constant_marked=FINITE, constant_other=FINITE)
@dataclasses.dataclass(frozen=True)
class FigaConfig:
    """FIGA's constants (frozen, hashable: a valid static jit argument).

    Attributes:
      weighting: "figa" (the paper's main method) or "constant" (the reference ablation).
      alpha: weight of positive (+1) revised tokens. 1.0.
      beta: negative original tokens get weight -beta where kept. 0.5.
      gamma: weight of the other revised tokens. 0.0.
      neg_nll_min, neg_nll_max: a negative token is kept where its NLL lies in this closed
        window. 0.0 and 0.6.
      constant_marked, constant_other: the "constant" weights of +1-marked tokens and of every
        other unmasked token. 1.0 and -0.5.
    """

    weighting: str = "figa"
    alpha: float = 1.0
    beta: float = 0.5
    gamma: float = 0.0
    neg_nll_min: float = 0.0
    neg_nll_max: float = 0.6
    constant_marked: float = 1.0
    constant_other: float = -0.5

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {self.weighting!r}; valid: {WEIGHTINGS}")
        if not 0 <= self.neg_nll_min <= self.neg_nll_max:
            raise ValueError(f"need 0 <= neg_nll_min <= neg_nll_max, got neg_nll_min="
                             f"{self.neg_nll_min!r}, neg_nll_max={self.neg_nll_max!r}")


def _validate(logp, marks, mask, revised) -> None:
    if not hasattr(logp, "ndim") or logp.ndim != 2:
        raise ValueError(f"logp must be a [B, T] array, got shape {getattr(logp, 'shape', None)}")
    if not jnp.issubdtype(logp.dtype, jnp.floating):
        raise ValueError(f"logp must be floating point, got dtype {logp.dtype}")
    for name, x in (("marks", marks), ("mask", mask)):
        if not hasattr(x, "shape") or tuple(x.shape) != tuple(logp.shape):
            raise ValueError(f"{name} shape {getattr(x, 'shape', None)} does not match logp "
                             f"shape {logp.shape} [B, T]")
    as_bool_mask(mask)  # dtype check: bool or numeric
    if not jnp.issubdtype(marks.dtype, jnp.integer):
        raise ValueError(f"marks must be integers in {{-1, 0, 1}}, got dtype {marks.dtype}")
    if not hasattr(revised, "shape") or tuple(revised.shape) != tuple(logp.shape[:1]):
        raise ValueError(f"revised shape {getattr(revised, 'shape', None)} must be [B] = "
                         f"{logp.shape[:1]} (True for revision rows, False for originals)")
    if not isinstance(marks, jax.core.Tracer) and getattr(marks, "is_fully_addressable", True):
        # numpy, not jnp: concrete marks captured by a jitted caller must not become tracers here
        host = np.asarray(marks)
        lo, hi = (int(host.min()), int(host.max())) if host.size else (0, 0)
        if lo < -1 or hi > 1:
            raise ValueError(f"marks must lie in {{-1, 0, 1}}, got range [{lo}, {hi}]")


def figa_token_weights(nll: jax.Array, marks: jax.Array, mask: jax.Array, revised: jax.Array,
                       *, config: FigaConfig) -> jax.Array:
    """[B, T] weights w_t (see the module doc); 0 where masked (``mask`` [B, T] bool or
    numeric, nonzero = True); no gradient."""
    nll = jax.lax.stop_gradient(nll)
    keep = as_bool_mask(mask)
    rev = revised.astype(bool)[:, None]
    dtype = jnp.promote_types(nll.dtype, jnp.float32)
    if config.weighting == "constant":
        w = jnp.where(marks == 1, config.constant_marked, config.constant_other)
    else:
        kept_negative = (marks == -1) & (nll >= config.neg_nll_min) & (nll <= config.neg_nll_max)
        w_rev = jnp.where(marks == 1, config.alpha, config.gamma)
        w_orig = jnp.where(kept_negative, -config.beta, 0.0)
        w = jnp.where(rev, w_rev, w_orig)
    return jnp.where(keep, w, 0.0).astype(dtype)


def figa_loss(logp: jax.Array, marks: jax.Array, mask: jax.Array, revised: jax.Array, *,
              config: FigaConfig = FigaConfig()) -> tuple[jax.Array, dict[str, Any]]:
    """The FIGA loss (to minimise) and diagnostics.

    Args:
      logp: [B, T] log-probs of each row's response tokens (differentiated).
      marks: [B, T] int, +1 / -1 / 0 from :func:`jaxflow.align.marking.figa_marks`.
      mask: [B, T] the response tokens, bool or any numeric dtype: nonzero = True, never a
        weight (:func:`jaxflow.rl.masks.as_bool_mask`); masked entries may hold anything.
      revised: [B] bool, True for revision rows, False for original rows.
      config: a :class:`FigaConfig`.

    Returns:
      ``(loss, metrics)``: loss a scalar (0 when no token has a nonzero weight), metrics
      ``positive_tokens`` (revision tokens marked +1), ``negative_tokens`` (original tokens
      marked -1), ``negative_kept`` (of those, inside the keep window), ``weighted_tokens``
      (the denominator).

    Raises:
      ValueError: shapes that do not match, non-integer marks or marks outside {-1, 0, 1}.
    """
    _validate(logp, marks, mask, revised)
    keep = as_bool_mask(mask)
    dtype = jnp.promote_types(logp.dtype, jnp.float32)
    nll = jnp.where(keep, -logp.astype(dtype), jnp.zeros((), dtype))
    w = figa_token_weights(nll, marks, keep, revised, config=config)
    if config.weighting == "constant":
        count = jnp.sum(keep)
    else:
        count = jnp.sum(w != 0)
    loss = jnp.sum(w * nll) / jnp.maximum(count, 1).astype(dtype)
    rev = revised.astype(bool)[:, None]
    negative = keep & ~rev & (marks == -1)
    metrics = {
        "positive_tokens": jnp.sum(keep & rev & (marks == 1)),
        "negative_tokens": jnp.sum(negative),
        "negative_kept": jnp.sum(negative & (w != 0)) if config.weighting == "figa"
        else jnp.sum(negative),
        "weighted_tokens": count,
    }
    return loss, metrics
