"""Which Pallas kernels a traced program calls, and how often: counted in its jaxpr.

A lowered module outlines identical ``shard_map`` bodies into one function called once per
layer, so counting custom calls in StableHLO text undercounts; the jaxpr of ``jit(f).trace(...)``
keeps every call site (the backward pass included, since a train step's jaxpr is the
differentiated program). Counting needs only a trace (no compiler): about a second for a
2-layer 8B-wide step.
"""

from __future__ import annotations

import collections
from typing import Any

from jax.extend import core as jcore


def _sub_jaxprs(params: dict):
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def kernel_name(eqn) -> str:
    """A ``pallas_call`` equation's kernel name: its ``name`` parameter, else the kernel
    function's name ("_flash_attention_kernel")."""
    name = eqn.params.get("name")
    if name:
        return str(name)
    info = getattr(eqn.params.get("jaxpr"), "debug_info", None)
    src = getattr(info, "func_src_info", None) or "pallas_call"
    return src.split(" at ")[0]


def pallas_calls(jaxpr: Any) -> collections.Counter:
    """{kernel name: call sites} over ``jaxpr`` (a Jaxpr / ClosedJaxpr, or a
    ``jax.stages.Traced``), sub-jaxprs included (scan / cond / shard_map / custom_vjp bodies:
    a call inside a scan body counts once)."""
    if hasattr(jaxpr, "jaxpr") and not isinstance(jaxpr, jcore.Jaxpr):
        jaxpr = jaxpr.jaxpr
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    out: collections.Counter = collections.Counter()
    stack = [jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive.name == "pallas_call":
                out[kernel_name(eqn)] += 1
            else:
                stack.extend(_sub_jaxprs(eqn.params))
    return out
