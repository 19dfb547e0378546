"""Prefix trie of valid semantic IDs as dense arrays, for constrained decoding under jit.

Node 0 is the root; ``children[node, code]`` is the child reached by emitting ``code`` (-1 when
no valid item continues that way) and ``leaf_item[node]`` is the item a depth-L node spells
(-1 elsewhere). A decoding step is then two gathers: the mask ``children[node] >= 0`` over the
W codes and the next node ``children[node, code]`` (vectorised over batch and beams). Memory is
(1 + number of distinct prefixes) x W int32, at most (1 + N L) W.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trie:
    """children int32[n_nodes, W], leaf_item int32[n_nodes], depth int32[n_nodes] (a pytree)."""

    children: jax.Array
    leaf_item: jax.Array
    depth: jax.Array

    @property
    def width(self) -> int:
        """Children slots per node (``W``)."""
        return self.children.shape[1]


def build_trie(codes, width: int, *, pad_nodes: int | None = None) -> Trie:
    """The trie of the code tuples ``codes`` int[N, L] (row = item index), codes in [0, width).

    ``pad_nodes`` pads the tables with unreachable nodes to that many rows, so tries of
    different catalogues share one compiled decoder (1 + N L rows always suffice).

    Raises:
      ValueError: a code outside [0, width), or two items with the same tuple (the item a
        decoded tuple names would be ambiguous).
    """
    codes = np.asarray(codes, np.int64)
    if codes.ndim != 2 or codes.shape[0] < 1 or codes.shape[1] < 1:
        raise ValueError(f"codes shape {codes.shape}: need [N >= 1 items, L >= 1 levels]")
    if codes.min() < 0 or codes.max() >= width:
        bad = int(codes.min()) if codes.min() < 0 else int(codes.max())
        raise ValueError(f"code {bad} outside [0, width={width})")
    uniq, counts = np.unique(codes, axis=0, return_counts=True)
    if counts.max() > 1:
        raise ValueError(f"code tuple {tuple(int(c) for c in uniq[np.argmax(counts)])} is shared "
                         f"by {int(counts.max())} items; semantic IDs must be unique")
    n, levels = codes.shape
    node_of, offset = [], 1
    for d in range(levels):  # node id of every item's length-(d+1) prefix
        prefixes, inv = np.unique(codes[:, :d + 1], axis=0, return_inverse=True)
        node_of.append(offset + inv.reshape(-1))
        offset += len(prefixes)
    children = np.full((offset, width), -1, np.int64)
    depth = np.zeros(offset, np.int64)
    parent = np.zeros(n, np.int64)
    for d in range(levels):
        children[parent, codes[:, d]] = node_of[d]
        depth[node_of[d]] = d + 1
        parent = node_of[d]
    leaf = np.full(offset, -1, np.int64)
    leaf[parent] = np.arange(n)
    if pad_nodes is not None:
        if pad_nodes < offset:
            raise ValueError(f"pad_nodes={pad_nodes} < the trie's {offset} nodes")
        extra = pad_nodes - offset
        children = np.concatenate([children, np.full((extra, width), -1, np.int64)])
        leaf = np.concatenate([leaf, np.full(extra, -1, np.int64)])
        depth = np.concatenate([depth, np.full(extra, -1, np.int64)])
    return Trie(children=jnp.asarray(children, jnp.int32), leaf_item=jnp.asarray(leaf, jnp.int32),
                depth=jnp.asarray(depth, jnp.int32))


def allowed_codes(trie: Trie, node: jax.Array) -> jax.Array:
    """bool[..., W]: codes that continue a valid item from trie nodes ``node`` int32[...]."""
    return trie.children[node] >= 0


def step(trie: Trie, node: jax.Array, code: jax.Array) -> jax.Array:
    """Next nodes int32[...] after emitting ``code`` at ``node`` (-1 where invalid)."""
    return jnp.take_along_axis(trie.children[jnp.maximum(node, 0)], code[..., None], -1)[..., 0]


def item_of(trie: Trie, codes: jax.Array) -> jax.Array:
    """int32[...]: item index spelled by ``codes`` int[..., L], -1 for an invalid tuple."""
    node = jnp.zeros(codes.shape[:-1], jnp.int32)
    for level in range(codes.shape[-1]):
        nxt = step(trie, node, codes[..., level].astype(jnp.int32))
        node = jnp.where(node >= 0, nxt, -1)
    return jnp.where(node >= 0, trie.leaf_item[jnp.maximum(node, 0)], -1)
