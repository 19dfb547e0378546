"""A study's report files. The driver returns its summary (a JSON-able dict) and the runner
writes it, after the conventions' keys, to ``summary.json`` (``jaxflow.run``); a study also
writes its result rows to ``results.json`` and its markdown tables to ``results.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxflow.experiment import RunContext

__all__ = ["write_results"]


def write_results(run: RunContext, results: Any, tables: Sequence[str]) -> str:
    """Writes ``results`` (JSON-able) to ``results.json`` and the markdown ``tables`` (joined
    by blank lines) to ``results.md``, logs them, and returns that text (process 0 writes and
    logs; every process returns the text)."""
    text = "\n\n".join(tables) + "\n"
    run.write_json("results.json", results)
    if run.is_primary:
        (run.out_dir / "results.md").write_text(text)
        run.info("results:\n" + text)
    return text
