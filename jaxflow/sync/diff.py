"""Bit-pattern diff of a parameter tree: what changed between the receiver's snapshot and the
trainer's fresh bf16 cast.

``diff_tree(old, new)`` yields one ``LeafDiff`` per leaf: for bf16 leaves the sorted flat
positions whose bit patterns differ plus the old and new patterns there; every leaf also keeps
its full new contents (a host view, no copy) for the dense codec and for non-bf16 leaves,
which are carried whole and exactly whenever any bit changed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jaxflow.sync import bits, host_kernels
from jaxflow.sync.payload import LeafSpec


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """Changes of one leaf.

    Attributes:
      positions: int64[k] sorted flat positions (in the logical, unsharded leaf) whose bits
        differ; for non-bf16 leaves, the positions of differing elements.
      old_bits, new_bits: uint16[k] bf16 bit patterns at ``positions`` (empty for non-bf16);
        either may be None when the producer (the on-device sender) sent only what the
        codec needs.
      full_new: the whole new leaf as a flat host array (any dtype), or None when the producer
        (e.g. ChangeTracker) did not gather it.
      deltas: uint16[k] new - old (mod 2**16), when the producer sent those instead of bits.
      load_full: fetches ``full_new`` on demand (the on-device sender's dense fallback).
    """

    positions: np.ndarray
    old_bits: np.ndarray | None
    new_bits: np.ndarray | None
    full_new: np.ndarray | None
    deltas: np.ndarray | None = None
    load_full: Callable[[], np.ndarray] | None = dataclasses.field(default=None, compare=False)

    @property
    def count(self) -> int:
        return int(self.positions.size)

    def value_deltas(self) -> np.ndarray:
        """uint16[k]: new - old bit patterns (mod 2**16) at ``positions`` (what the entropy
        and mask sections code), given or computed from ``old_bits`` / ``new_bits``."""
        if self.deltas is not None:
            return self.deltas
        return (self.new_bits.astype(np.uint16) - self.old_bits.astype(np.uint16)
                ).astype(np.uint16)

    def full(self) -> np.ndarray | None:
        """The whole new leaf (flat), fetched by ``load_full`` when not carried."""
        if self.full_new is None and self.load_full is not None:
            return self.load_full()
        return self.full_new


def leaf_name(path) -> str:
    return jax.tree_util.keystr(path)


def tree_layout(tree) -> tuple[str, list, tuple[LeafSpec, ...]]:
    """(treedef string, leaves, LeafSpecs) of a parameter tree.

    The names and specs depend only on the structure, shapes and dtypes, so they are kept
    per layout (a trainer publishes the same layout every step; the key-path walk and the
    ``keystr`` of every leaf then run once instead of on every publish and apply)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    key = (treedef, tuple((np.shape(leaf), np.dtype(_dtype(leaf)).name) for leaf in leaves))
    try:
        hit = _LAYOUTS.get(key)
    except (TypeError, ValueError):  # node metadata that cannot be hashed or compared
        key, hit = None, None
    if hit is None:
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        specs = tuple(LeafSpec(leaf_name(path), np.dtype(_dtype(leaf)).name,
                               tuple(int(d) for d in np.shape(leaf)))
                      for path, leaf in flat)
        hit = (str(treedef), specs)
        if key is not None:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.pop(next(iter(_LAYOUTS)))
            _LAYOUTS[key] = hit
    return hit[0], leaves, hit[1]


_LAYOUTS: dict = {}
_MAX_LAYOUTS = 64


def _dtype(leaf):
    return leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def check_same_layout(old_specs, new_specs, old_treedef: str, new_treedef: str) -> None:
    if old_treedef != new_treedef:
        raise ValueError(f"old and new trees differ in structure: {old_treedef} vs {new_treedef}")
    for o, n in zip(old_specs, new_specs):
        if o != n:
            raise ValueError(f"leaf {o.name}: old is {o.dtype}{list(o.shape)}, "
                             f"new is {n.dtype}{list(n.shape)}")


def diff_leaf(old, new, *, scratch: dict | None = None) -> LeafDiff:
    """The LeafDiff of one leaf (host arrays or jax Arrays, pulled to the host). bf16 leaves
    take the compiled one-pass kernel (``host_kernels``) when it is available and at most
    about 1/16 of the leaf changed, else the numpy path;
    both give the same positions and bits. ``scratch``: buffers kept between calls."""
    scratch = {} if scratch is None else scratch
    old_h, new_h = bits.host_array(old), bits.host_array(new)
    old_b, new_b = bits.as_bits(old_h), bits.as_bits(new_h)
    flat_new = new_h.reshape(-1)
    if bits.is_bf16(new_h.dtype):
        if host_kernels.available():
            found = host_kernels.diff_bf16(old_b, new_b, scratch=scratch.setdefault("out", [None]))
            if found is not None:
                return LeafDiff(*found, flat_new)
        pos, old_at, new_at = bits.diff_bits(old_b, new_b, scratch=scratch.setdefault("mask", [None]))
        return LeafDiff(pos, old_at, new_at, flat_new)
    pos, _, _ = bits.diff_bits(old_b, new_b, scratch=scratch.setdefault("mask", [None]))
    empty = np.zeros(0, np.uint16)
    return LeafDiff(pos, empty, empty, flat_new)


def diff_tree(old_tree, new_tree, *, scratch: dict | None = None
              ) -> tuple[str, tuple[LeafSpec, ...], list[LeafDiff]]:
    """Diffs two trees of identical structure, shapes and dtypes (ValueError otherwise).
    ``scratch``: a caller-owned dict keeping the diff's buffers between calls (the numpy
    compare's mask, the compiled kernel's output buffers)."""
    old_def, old_leaves, old_specs = tree_layout(old_tree)
    new_def, new_leaves, new_specs = tree_layout(new_tree)
    check_same_layout(old_specs, new_specs, old_def, new_def)
    scratch = {} if scratch is None else scratch
    return new_def, new_specs, [diff_leaf(o, n, scratch=scratch)
                                for o, n in zip(old_leaves, new_leaves)]
