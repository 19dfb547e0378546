"""The wire form of a parameter tree: bf16 casts, where a tree lives, its end-to-end digest.

Rollout replicas run the trainer's params cast to bf16 (the wire dtype). ``to_bf16`` makes
that cast as host numpy, ``device_tree`` puts a tree's leaves on the device for the on-device
sync path, ``resolve_path`` picks "host" or "device" for a tree, and ``tree_digest`` is the
bit-exact fingerprint every sync route is checked against.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from jaxflow.sync import bits
from jaxflow.sync.diff import tree_layout

PATHS = ("auto", "host", "device")


def to_bf16(params: Any, *, copy: bool = True) -> Any:
    """Host numpy copy of ``params`` with every floating leaf cast to bf16 (what rollout runs).
    ``copy=False``: numpy leaves that need no cast are returned as they are."""
    def cast(x):
        if not copy and isinstance(x, np.ndarray) and (
                x.dtype == bits.BF16 or not np.issubdtype(x.dtype, np.floating)):
            return x
        x = np.asarray(jax.device_get(x))
        return x.astype(bits.BF16) if np.issubdtype(x.dtype, np.floating) else x.copy()
    return jax.tree.map(cast, params)


def device_tree(params: Any) -> Any:
    """``params`` with every leaf a jax Array (host leaves put on the default device; a dtype
    the device cannot hold, e.g. int64 without x64, is an error: use path="host")."""
    def put(x):
        if isinstance(x, jax.Array):
            return x
        host = np.asarray(x)
        out = jax.numpy.asarray(host)
        if out.dtype != host.dtype:
            raise ValueError(f"a {host.dtype} leaf becomes {out.dtype} on the device: the "
                             "device sync path needs device dtypes (use path='host')")
        return out
    return jax.tree.map(put, params)


def tree_digest(params: Any) -> str:
    """blake2b-128 hex over every leaf's name, dtype, shape and raw bytes (bit patterns): equal
    iff the trees are bit-identical. The project's one parameter digest (sync end-to-end checks,
    the ``params_checksum`` of run summaries, resume tests). Leaves spread over several
    processes are gathered first (every process gets the same digest)."""
    from jaxflow.distributed import to_host

    h = hashlib.blake2b(digest_size=16)
    treedef, leaves, specs = tree_layout(params)
    h.update(treedef.encode())
    for spec, leaf in zip(specs, leaves):
        h.update(f"{spec.name}|{spec.dtype}|{spec.shape}".encode())
        if not getattr(leaf, "is_fully_addressable", True):
            leaf = to_host(leaf)
        h.update(bits.host_array(leaf).tobytes())
    return h.hexdigest()


def on_accelerator(params: Any) -> bool:
    """True when the first jax Array leaf of ``params`` lives on a GPU/TPU (False for host
    numpy trees and CPU devices)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            return next(iter(leaf.sharding.device_set)).platform != "cpu"
    return False


def resolve_path(path: str, params: Any) -> str:
    """"host" or "device" for a sender / replica of ``path`` holding ``params``: "auto" is
    "device" when the leaves live on an accelerator (GPU/TPU), else the host numpy path."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}; valid: {PATHS}")
    if path == "auto":
        return "device" if on_accelerator(params) else "host"
    return path
