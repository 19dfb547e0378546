"""Hand-written page text whose figures are placeholders filled from records.

A template (``experiments/pages/<experiment>.md``) says what an experiment does, how to run it
and what its figures mean; every figure in it is a placeholder ``{{experiment.figure}}`` (a
headline's ``name`` or a key figure of the newest records), filled by :func:`fill` with the
figure of every machine recorded; ``{{experiment.prefix*}}`` (``{{experiment.*}}``) fills every
figure whose name starts with ``prefix``, named, for figures whose names carry a setting
(``sis_vs_strongest[grpo, lag=4, ...]``). The rule that keeps prose from holding a stale number
(:func:`literal_figures`): outside placeholders, inline code and fenced code blocks, a number
with a decimal point (``0.89``), a number with an ``x`` suffix (``6x``, ``1.5x``) or a percentage
(``12%``) is a literal figure, and ``--check`` reports it. Counts and dates (``3 seeds``,
``2026-12-06``) are not figures.
"""

from __future__ import annotations

import re
from typing import Callable

PLACEHOLDER = re.compile(r"\{\{\s*([a-z0-9_]+)\.([A-Za-z0-9_.+/-]*\*|[A-Za-z0-9_.+/-]+?)\s*\}\}")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_LITERAL = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?x(?![\w])|\d+(?:\.\d+)?\s?%|\d+\.\d+)")


def _masked(text: str) -> str:
    """``text`` with code, placeholders and link targets blanked (same length, lines kept)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    for pattern in (_FENCE, _INLINE_CODE, PLACEHOLDER, _LINK_TARGET):
        text = pattern.sub(blank, text)
    return text


def literal_figures(text: str) -> list[tuple[int, str]]:
    """(line number, literal) of every figure written outside placeholders and code."""
    out = []
    for number, line in enumerate(_masked(text).splitlines(), 1):
        out += [(number, m.group(1)) for m in _LITERAL.finditer(line)]
    return out


def placeholders(text: str) -> list[tuple[str, str]]:
    """(experiment, figure) of every placeholder in ``text``, in order."""
    return [(m.group(1), m.group(2)) for m in PLACEHOLDER.finditer(_FENCE.sub("", text))]


def fill(text: str, lookup: Callable[[str, str], str | None]) -> tuple[str, list[str]]:
    """(``text`` with every placeholder outside fenced code replaced by ``lookup(experiment,
    figure)``, the placeholders ``lookup`` did not know). An unknown one renders as
    ``{{experiment.figure: unknown}}`` so the page shows it too."""
    unknown: list[str] = []

    def one(m: re.Match) -> str:
        got = lookup(m.group(1), m.group(2))
        if got is None:
            unknown.append(f"{m.group(1)}.{m.group(2)}")
            return f"`{{{{{m.group(1)}.{m.group(2)}: unknown}}}}`"
        return got

    parts, last = [], 0
    for fence in _FENCE.finditer(text):
        parts += [PLACEHOLDER.sub(one, text[last:fence.start()]), fence.group(0)]
        last = fence.end()
    parts.append(PLACEHOLDER.sub(one, text[last:]))
    return "".join(parts), unknown
