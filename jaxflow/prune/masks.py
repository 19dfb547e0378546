"""Sparsity patterns and the masks that realise them.

A pattern is either unstructured (a float fraction in (0, 1): that share of a group of weights is
pruned) or N:M (a string ``"N:M"``: N of every M consecutive input weights of a row are pruned;
``"2:4"`` is the hardware-friendly case). Masks are boolean with True = pruned.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SparsityPattern:
    """Parsed sparsity: ``fraction`` always set; ``n``/``m`` > 0 only for N:M."""

    fraction: float
    n: int = 0
    m: int = 0

    @property
    def is_nm(self) -> bool:
        """Whether the pattern is N:M (else unstructured)."""
        return self.m > 0

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else f"{self.fraction:g}"


def parse_sparsity(sparsity: float | str | SparsityPattern) -> SparsityPattern:
    """``0.6`` -> unstructured 60%; ``"2:4"`` -> 2 of every 4 pruned; errors name the bad value."""
    if isinstance(sparsity, SparsityPattern):
        return sparsity
    if isinstance(sparsity, str):
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", sparsity)
        if match is None:
            try:
                return parse_sparsity(float(sparsity))
            except ValueError:
                raise ValueError(f"sparsity {sparsity!r}: expected a float in (0, 1) or 'N:M' "
                                 "such as '2:4'") from None
        n, m = int(match.group(1)), int(match.group(2))
        if not 0 < n < m:
            raise ValueError(f"sparsity {sparsity!r}: N:M needs 0 < N < M")
        return SparsityPattern(fraction=n / m, n=n, m=m)
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise ValueError(f"sparsity {sparsity!r}: expected a float in (0, 1) or 'N:M'")
    if not 0.0 < float(sparsity) < 1.0:
        raise ValueError(f"sparsity {sparsity!r}: an unstructured fraction must be in (0, 1)")
    return SparsityPattern(fraction=float(sparsity))


def prune_count(size: int, fraction: float) -> int:
    """How many of ``size`` weights an unstructured ``fraction`` prunes (round half up)."""
    return int(size * fraction + 0.5)


def lowest_k_mask(scores: jax.Array, k: int, axis: int | None = None) -> jax.Array:
    """True at the ``k`` lowest scores (over the whole array, or along ``axis``); exactly k.

    Ties are broken by position (stable sort), so the count is exact even with equal scores.
    """
    if axis is None:
        flat = scores.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        return jnp.zeros(flat.shape, bool).at[order[:k]].set(True).reshape(scores.shape)
    ranks = jnp.argsort(jnp.argsort(scores, axis=axis, stable=True), axis=axis, stable=True)
    return ranks < k


def nm_mask(scores: jax.Array, n: int, m: int) -> jax.Array:
    """True at the ``n`` lowest scores of every ``m`` consecutive columns of each row.

    scores: [rows, cols] with cols % m == 0.
    """
    rows, cols = scores.shape
    if cols % m:
        raise ValueError(f"N:M={n}:{m} needs the input dimension ({cols}) divisible by {m}")
    grouped = scores.reshape(rows, cols // m, m)
    return lowest_k_mask(grouped, n, axis=-1).reshape(rows, cols)

