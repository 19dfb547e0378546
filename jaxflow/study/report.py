"""A study's report files. The driver returns its summary (a JSON-able dict) and the runner
writes it, after the conventions' keys and the experiment's headline figures
(:func:`with_headlines`, ``summary["headlines"]``), to ``summary.json`` (``jaxflow.run``); a
study also writes its result rows to ``results.json`` and its markdown tables to ``results.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxflow.experiment import RunContext
from jaxflow.study.headline import Headline, HeadlineBuilder

__all__ = ["write_results", "headline_builder", "with_headlines"]


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


def headline_builder(target: str) -> HeadlineBuilder:
    """The builder a config module's ``HEADLINES`` names (``"package.module:function"``);
    ValueError (one line) when it does not name a function."""
    module_name, _, fn_name = target.partition(":")
    fn = getattr(importlib.import_module(module_name), fn_name, None) if module_name and fn_name else None
    if not callable(fn):
        raise ValueError(f"HEADLINES={target!r}: not a function; valid: 'package.module:function'")
    return fn


def with_headlines(summary: Mapping[str, Any], builder: "HeadlineBuilder | str", *,
                   log: Callable[[str], None] | None = None) -> dict:
    """``summary`` with ``"headlines"``: the :class:`Headline` list of ``builder`` (a function
    or the ``"package.module:function"`` a config's ``HEADLINES`` names; ``""``: the summary
    unchanged) as the contract's dicts; ``log`` gets each headline's line. A builder that fails
    on the summary leaves ``"headlines": []`` and ``"headlines_error"`` (the error in one line)
    so the run's figures are still written."""
    if not builder:
        return dict(summary)
    fn = headline_builder(builder) if isinstance(builder, str) else builder
    try:
        heads = list(fn(summary))
    except Exception as e:  # noqa: BLE001 (a finished run's figures are written whatever the builder does)
        error = f"{type(e).__name__}: {e}"
        if log is not None:
            log(f"no headlines: the builder failed ({error})")
        return {**summary, "headlines": [], "headlines_error": error}
    bad = [h for h in heads if not isinstance(h, Headline)]
    if bad:
        raise TypeError(f"a headline builder returned {type(bad[0]).__name__}; valid: jaxflow.study.Headline")
    for h in heads if log is not None else ():
        log("headline " + h.line())
    return {**summary, "headlines": [h.to_json() for h in heads]}
