"""What a compiled program communicates and which kernels it calls, read from its HLO text.

``summarize(compiled.as_text())`` reads the optimized, SPMD-partitioned module: every shape in
it is one device's, so collective bytes are per device.

* Collectives by kind (:data:`COLLECTIVES`; ``ragged-all-to-all`` counts as all-to-all): the
  synchronous op or its asynchronous ``-start`` counts once; its bytes are the size of the op's
  result (for an async pair, the ``-done``'s result: the gathered / reduced array, not the
  start's tuple with its operand and scratch).
* Pallas kernels: custom calls to Mosaic TPU (``tpu_custom_call``), Triton
  (``__gpu$xla.gpu.triton``) or Mosaic GPU, named by the ``.../NAME/pallas_call`` of their
  ``op_name`` metadata (the ``pallas_call(name=...)``), else the Triton backend config's
  ``name``, else the instruction's name; cuDNN calls (``__cudnn$...`` targets) are counted
  apart, by target.

Counts are per call of the program: an op inside a ``while`` body counts its loop's
``known_trip_count`` times, and both branches of a conditional count. XLA:TPU records no
``known_trip_count`` on its compiled loops: there the trip count is read from the loop itself
when it has the shape every ``lax.scan`` / ``fori_loop`` lowers to (the condition's root is
``counter < constant N`` and the counter enters the loop as a constant K: N - K trips); a loop
of any other shape counts once. The loops' trip counts are kept (``loop_trips``): XLA's cost analysis
counts each loop body once, so a program with loops has a compiler cost that is a lower
bound. An instruction may span several lines of the text (multi-line frontend attributes);
continuation lines are joined to it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ALIASES = {"ragged-all-to-all": "all-to-all"}
PALLAS_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2")
CUDNN_PREFIX = "__cudnn$"

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b(pred|token|[sucf]\d+|bf16|f8\w*|f4\w*)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
_REF = re.compile(r"%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_PALLAS_NAME = re.compile(r'op_name="[^"]*?/([\w.\-]+)/pallas_call"')
_BACKEND_NAME = re.compile(r'\bname = "([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: name, result shape text, opcode, operand names, the rest of the
    line (attributes), and the computation it belongs to."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str
    args: str = ""  # the text inside the opcode's parentheses (a constant's literal)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape text: ``bf16[1024,2048]{1,0:T(8,128)(2,1)}`` -> 4194304; a tuple
    sums its arrays (layouts, tiling and dynamic ``<=`` bounds are ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        size = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += size * _BYTES.get(dtype, int(re.sub(r"\D", "", dtype) or 8) / 8)
    return int(total)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]`` ("(" or "{")."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse(name: str, rest: str, computation: str) -> Instruction | None:
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    shape, tail = rest[:end], rest[end:]
    m = _OPCODE.match(tail)
    if m is None:
        return None
    open_at = m.end() - 1
    close = _balanced(tail, open_at)
    operands = tuple(_REF.findall(tail[open_at:close]))
    return Instruction(name, shape, m["op"], operands, tail[close:], computation,
                       tail[open_at + 1:close - 1])


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of the module, continuation lines joined, in text order."""
    lines: list[list[str]] = []  # [computation, name, rest]
    computation = ""
    for line in hlo_text.splitlines():
        if (m := _INSTRUCTION.match(line)) is not None:
            lines.append([computation, m["name"], m["rest"]])
        elif line[:1] not in ("", " ", "}", '"') and (c := _COMPUTATION.match(line)) is not None:
            computation = c["name"]  # a computation's header, "%name (...) -> ... {"
        elif lines and line.strip() not in ("", "}"):
            lines[-1][2] += "\n" + line  # a multi-line attribute of the last instruction
    out = []
    for comp, name, rest in lines:
        if (ins := _parse(name, rest, comp)) is not None:
            out.append(ins)
    return out


_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_GTE_INDEX = re.compile(r"\bindex=(\d+)")
_INT_LITERAL = re.compile(r"^-?\d+$")
_PASS_THROUGH = ("copy", "copy-start", "copy-done", "bitcast")


def _trip_count(loop: Instruction, by_name: dict[str, Instruction],
                roots: dict[str, Instruction]) -> int:
    """Executions of ``loop``'s body per execution of the loop: its ``known_trip_count``, else
    N - K when its condition's root is ``get-tuple-element(i) < constant(N)`` and element i of
    its initial tuple is ``constant(K)`` (the counter of a lowered scan / fori_loop, as XLA:TPU
    leaves it); 1 when neither can be read."""
    if (m := _TRIP.search(loop.attrs)) is not None:
        return int(m.group(1))
    cond = _CONDITION.search(loop.attrs)
    root = roots.get(cond.group(1)) if cond else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs \
            or len(root.operands) != 2:
        return 1
    counter, bound = (by_name.get(n) for n in root.operands)
    init = by_name.get(loop.operands[0]) if loop.operands else None
    if counter is None or bound is None or init is None or counter.opcode != "get-tuple-element" \
            or bound.opcode != "constant" or init.opcode != "tuple" \
            or (index := _GTE_INDEX.search(counter.attrs)) is None:
        return 1
    k = int(index.group(1))
    start = by_name.get(init.operands[k]) if k < len(init.operands) else None
    while start is not None and start.opcode in _PASS_THROUGH and start.operands:
        start = by_name.get(start.operands[0])  # XLA:TPU copies the counter's initial value
    if start is None or start.opcode != "constant" or not _INT_LITERAL.match(start.args.strip()) \
            or not _INT_LITERAL.match(bound.args.strip()):
        return 1
    return max(int(bound.args) - int(start.args), 1)


def _loop_trips(ins: list[Instruction]) -> dict[str, int]:
    """{while instruction name: trips} (:func:`_trip_count`)."""
    by_name = {i.name: i for i in ins}  # HLO instruction names are unique in a module
    roots: dict[str, Instruction] = {}
    for i in ins:
        roots[i.computation] = i  # the last instruction of a computation is its ROOT
    return {i.name: _trip_count(i, by_name, roots) for i in ins if i.opcode == "while"}


def _multipliers(ins: list[Instruction]) -> dict[str, int]:
    """Executions of each computation per call of the entry one (while bodies and conditions
    times their trip count, :func:`_trip_count`)."""
    computations = {i.computation for i in ins}
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    loop_trips = _loop_trips(ins)
    for i in ins:
        trip = 1
        if i.opcode == "while":
            trip = loop_trips[i.name]
        for callee in set(_REF.findall(i.attrs)):
            if callee in computations and callee != i.computation:
                calls[callee].append((i.computation, trip if i.opcode == "while" else 1))
    memo: dict[str, int] = {}

    def mult(c: str, seen: frozenset = frozenset()) -> int:
        if c in memo:
            return memo[c]
        if c not in calls or c in seen:  # the entry computation (or a malformed cycle)
            return 1
        memo[c] = sum(mult(caller, seen | {c}) * f for caller, f in calls[c])
        return memo[c]

    return {c: mult(c) for c in computations}


@dataclasses.dataclass(frozen=True)
class HloSummary:
    """collectives: {kind: {"count", "bytes"}} for every kind in :data:`COLLECTIVES` (bytes
    per device, per call); pallas_kernels: {kernel name: calls}; cudnn_calls: {custom-call
    target: calls}; loop_trips: the known trip count of every while loop that runs more than
    once per call (XLA's cost analysis counts a loop body once)."""

    collectives: dict
    pallas_kernels: dict
    cudnn_calls: dict
    loop_trips: tuple[int, ...] = ()  # each while loop's executions per call (trip > 1 only)

    @property
    def collective_bytes(self) -> int:
        return sum(v["bytes"] for v in self.collectives.values())

    @property
    def kernel_count(self) -> int:
        return sum(self.pallas_kernels.values())


def _kind(opcode: str) -> tuple[str | None, str]:
    """(collective kind or None, "" | "start" | "done") of an opcode."""
    base, phase = opcode, ""
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix):
            base, phase = opcode[: -len(suffix)], suffix[1:]
    base = _ALIASES.get(base, base)
    return (base if base in COLLECTIVES else None), phase


def _kernel_name(i: Instruction) -> str:
    for pattern in (_PALLAS_NAME, _BACKEND_NAME):
        if (m := pattern.search(i.attrs)) is not None:
            return m.group(1)
    return re.sub(r"\.\d+$", "", i.name)


def summarize(hlo_text: str) -> HloSummary:
    """Collectives and kernels of ``hlo_text`` (``compiled.as_text()``), per call."""
    ins = instructions(hlo_text)
    mult = _multipliers(ins)
    done_of = {i.operands[0]: i for i in ins if i.opcode.endswith("-done") and i.operands}
    collectives = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    pallas: dict[str, int] = defaultdict(int)
    cudnn: dict[str, int] = defaultdict(int)
    for i in ins:
        times = mult.get(i.computation, 1)
        kind, phase = _kind(i.opcode)
        if kind is not None and phase != "done":
            done = done_of.get(i.name) if phase == "start" else None
            size = shape_bytes(done.shape) if done is not None else shape_bytes(i.shape)
            collectives[kind]["count"] += times
            collectives[kind]["bytes"] += times * size
        if i.opcode == "custom-call" and (m := _TARGET.search(i.attrs)) is not None:
            target = m.group(1)
            if target in PALLAS_TARGETS:
                pallas[_kernel_name(i)] += times
            elif target.startswith(CUDNN_PREFIX):
                cudnn[target] += times
    trips = [t for t in _loop_trips(ins).values() if t > 1]
    return HloSummary(collectives, dict(sorted(pallas.items())), dict(sorted(cudnn.items())),
                      tuple(sorted(trips, reverse=True)))
