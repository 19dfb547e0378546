"""The entropy bound of a sync: how few bytes any lossless codec could use.

Fixed definition: per bf16 tensor log2 C(n, k) bits for the positions, plus k times
the order-0 empirical entropy of the values written as signed differences of the bf16 bit
patterns (new - old, as integers), the value histogram pooled over the whole tree.
"""

from __future__ import annotations

import math

import numpy as np

from jaxflow.sync import bits
from jaxflow.sync.diff import LeafDiff
from jaxflow.sync.payload import LeafSpec


def log2_binomial(n: int, k: int) -> float:
    if k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got n={n} k={k}")
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def empirical_entropy_bits(values: np.ndarray) -> float:
    """Order-0 entropy (bits per symbol) of an integer array."""
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(p * np.log2(p)).sum())


def entropy_bound_bytes(specs: tuple[LeafSpec, ...], diffs: list[LeafDiff]) -> float:
    """The bound in bytes for the bf16 leaves of a diff (non-bf16 leaves are not counted)."""
    position_bits = 0.0
    deltas = []
    for spec, diff in zip(specs, diffs):
        if spec.dtype != bits.BF16.name:
            continue
        position_bits += log2_binomial(spec.size, diff.count)
        deltas.append(diff.new_bits.astype(np.int32) - diff.old_bits.astype(np.int32))
    pooled = np.concatenate(deltas) if deltas else np.zeros(0, np.int32)
    return (position_bits + pooled.size * empirical_entropy_bits(pooled)) / 8.0
