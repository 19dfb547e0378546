"""The compile-record matrix: every resolved ``full`` variant
(:data:`jaxflow.compile_only.variants.RESOLVED`) x every target of :data:`TARGETS`, one row each,
rendered as the markdown table of ``experiments/compile_reports/README.md``.

A cell is, in this order:
  exit 2     the layout rule (:func:`jaxflow.compile_only.cli.resolve_layout`, pure, nothing
             compiled) refuses the target: the one line the runner prints before compiling;
  current    ``NAME-full-TARGET.json`` (``compile_report.json`` of ``python -m jaxflow.run
             --exp=NAME --variant=full --compile-only --target=TARGET``, ':' -> '-') has the
             current format (top-level ``compile_seconds``) and its ``layout`` is the rule's
             line today (up to the HBM estimate's figures): its figures, read, never estimated;
  stale      the same, but the rule lays the variant out otherwise now (figures shown, both
             layout lines quoted);
  failed     a current-format report in which programs failed to compile (status "failed"):
             what it has, and the first error;
  old        the report predates that format (no ``compile_seconds``) and the layout rule;
  missing    no report.

  python -m jaxflow.compile_only.matrix            # print the table
  python -m jaxflow.compile_only.matrix --write    # write experiments/compile_reports/README.md
  python -m jaxflow.compile_only.matrix --check    # exit 1 when the README differs

Runs in the plain environment (the rule needs no libtpu or CUDA plugin); the commits' dates come
from ``git`` (the repository's history; "" where it does not know the commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import re
import subprocess
import sys
from typing import Sequence

from jaxflow.provenance import REPO_ROOT

#: The matrix's targets, spelled as ``--target`` takes them.
TARGETS = ("tpu-v5p:4x4x4", "tpu-v6e:16x16", "gpu-h100x8", "gpu-h200x8")
REPORTS = REPO_ROOT / "experiments" / "compile_reports"
README = REPORTS / "README.md"
GIB = 2 ** 30
PROG = "python -m jaxflow.run"

HEADER = """# Compile records: every full variant x target

Written by `python -m jaxflow.compile_only.matrix --write` from the `*-full-*.json` reports
here (`python -m jaxflow.run --exp=NAME --variant=full --compile-only --target=T --out DIR`,
`DIR/compile_report.json` copied as `NAME-full-T.json`, ':' -> '-'); `--check` (and
tests/test_compile_matrix.py) fails when this file differs from the reports.

Status: **current** (the report has per-program compile seconds and the efficiency figures),
**stale** (the same, but the report's `layout` is not the rule's layout today), **failed**
(programs of the report failed to compile: the first error, cut at 300 characters),
**exit 2** (the layout rule refuses the target before compiling; the line the runner prints),
**old** (a report from before the per-target layout rule and compile seconds; to be compiled
again), **missing** (no report).
Columns of a current report: HBM, the largest program's `memory.total_bytes` per device over
the chip's capacity (GiB; "not ok" names programs whose status is not ok); compile s, the
slowest program's lower + compile and the sum over programs (two compile at a time, so the sum
can exceed wall s, the whole run; seconds on the compiling host, this repository's 2-core
machine unless a report says otherwise); wall s, with the host's 1-minute load at the start and
the end where the report records it (the end's includes the run's own compiles); Pallas calls,
the Pallas kernel calls in the compiled HLO over all programs; fallbacks, the report's
kernel fall-backs; MFU, the roofline MFU bound and MFU estimate of the step program (the first
train program named `*step`, else the first with the figures); commit, the code compiled (its
date: the commit's, from git).
"""


def report_path(name: str, target: str, reports: pathlib.Path = REPORTS) -> pathlib.Path:
    """``reports/NAME-full-TARGET.json`` (':' in the target -> '-')."""
    return reports / f"{name}-full-{target.replace(':', '-')}.json"


@dataclasses.dataclass(frozen=True)
class _Cell:
    """What :func:`jaxflow.compile_only.cli.resolve_layout` reads of a run's plan."""

    name: str
    variant: str
    config: object
    overrides: tuple = ()


def rule(name: str, target: str, config=None) -> tuple[str | None, str]:
    """What ``python -m jaxflow.run --exp=NAME --variant=full --compile-only --target=TARGET``
    decides before compiling, by the layout rule of :mod:`jaxflow.compile_only.resolve` on
    ``config`` (default: ``configs.NAME.get_config("full")``): (the line it prints when it
    exits 2 because no layout fits, or None; the layout line it records in the report's
    ``layout``, or "" when it exits 2). Pure: nothing compiled."""
    from jaxflow.compile_only.cli import CompileOnlyUsageError, resolve_layout
    from jaxflow.compile_only.target import parse_target
    from jaxflow.errors import one_line

    if config is None:
        config = importlib.import_module(f"configs.{name}").get_config("full")
    try:
        _, layout = resolve_layout(_Cell(name, "full", config), parse_target(target))
    except CompileOnlyUsageError as e:
        return f"{PROG}: error: {one_line(e)}", ""
    return None, layout


def _step_program(programs: list[dict]) -> dict | None:
    with_mfu = [p for p in programs if p.get("roofline_mfu_bound") is not None]
    steps = [p for p in with_mfu if p.get("kind") == "train" and p["name"].endswith("step")]
    return (steps or with_mfu or [None])[0]


def _seconds(s: dict) -> float:
    return float(s.get("lower") or 0.0) + float(s.get("compile") or 0.0)


def current_figures(report: dict) -> dict:
    """The matrix's figures of one current-format compile report (a ``compile_report.json``
    dict): ``hbm_gib`` (the largest program's ``memory.total_bytes`` / GiB), ``capacity_gib``,
    ``hbm_program``, ``not_ok`` (programs whose status is not "ok"), ``slowest`` ((program,
    lower + compile seconds)), ``total_seconds`` (sum over ``compile_seconds``),
    ``wall_seconds``, ``load`` (the host's 1-minute load at start and end, or None),
    ``pallas_calls`` (sum of ``kernels.pallas_count``), ``fallbacks``
    (``len(kernel_fallbacks)``), ``step`` (the step program's name or None), ``mfu_bound``,
    ``mfu_estimate``, ``commit``."""
    programs = report.get("programs", [])
    with_memory = [p for p in programs if (p.get("memory") or {}).get("total_bytes") is not None]
    largest = max(with_memory, key=lambda p: p["memory"]["total_bytes"], default=None)
    capacity = report.get("chip", {}).get("hbm_bytes")
    if capacity is None and largest is not None:
        capacity = largest["memory"].get("capacity_bytes")
    seconds = report.get("compile_seconds") or {}
    slowest = max(seconds.items(), key=lambda kv: _seconds(kv[1]), default=None)
    step = _step_program(programs)
    return {
        "hbm_gib": None if largest is None else largest["memory"]["total_bytes"] / GIB,
        "capacity_gib": None if capacity is None else capacity / GIB,
        "hbm_program": None if largest is None else largest["name"],
        "not_ok": [f"{p['name']} ({p.get('status')})" for p in programs
                   if p.get("status") != "ok"],
        "slowest": None if slowest is None else (slowest[0], _seconds(slowest[1])),
        "total_seconds": sum(_seconds(s) for s in seconds.values()),
        "wall_seconds": report.get("wall_seconds"),
        "load": (report.get("host") or {}).get("load_1min"),
        "pallas_calls": sum((p.get("kernels") or {}).get("pallas_count", 0) for p in programs),
        "fallbacks": len(report.get("kernel_fallbacks") or []),
        "step": None if step is None else step["name"],
        "mfu_bound": None if step is None else step.get("roofline_mfu_bound"),
        "mfu_estimate": None if step is None else step.get("mfu_estimate"),
        "commit": report.get("git_commit") or "",
    }


def is_current(report: dict) -> bool:
    """Whether ``report`` has the current format (top-level per-program ``compile_seconds``)."""
    return "compile_seconds" in report


@dataclasses.dataclass(frozen=True)
class Row:
    """One matrix cell: ``status`` ("current", "stale", "failed", "exit 2", "old", "missing"),
    ``figures`` (:func:`current_figures`: current, stale, failed), ``text`` (the exit-2 line,
    the old report's note, how a stale report's layout differs, or the first compile error),
    ``commit`` (the report's, "" when none)."""

    name: str
    target: str
    status: str
    figures: dict | None = None
    text: str = ""
    commit: str = ""


def layout_decision(line: str) -> str:
    """A layout line without its trailing HBM estimate ("... rollout 32 (model 1) (estimates:
    ...)" -> "... rollout 32 (model 1)"): what the programs are compiled for. A report whose
    layout differs from the rule's only in the estimate's figures compiled the same programs."""
    return re.sub(r" \(estimates?: .*\)$", "", line)


def matrix_row(name: str, target: str, *, report: dict | None,
               rule: tuple[str | None, str]) -> Row:
    """The :class:`Row` of ``name`` x ``target`` from its report (None: no file) and the
    layout rule's (exit-2 line or None, layout line) (:func:`rule`); the order is the module
    docstring's. A current report whose ``layout`` is not the rule's line today (up to the
    estimate's figures: :func:`layout_decision`) is "stale"."""
    exit2, layout = rule
    commit = (report or {}).get("git_commit") or ""
    if exit2 is not None:
        note = f" (a report of commit {commit[:8]} predates the rule)" if report else ""
        return Row(name, target, "exit 2", text=exit2 + note, commit=commit)
    if report is None:
        return Row(name, target, "missing")
    if is_current(report):
        failed = [p for p in report.get("programs", []) if p.get("status") == "failed"]
        if failed:
            first = " ".join(str(failed[0].get("error", "")).split())[:300]
            return Row(name, target, "failed", figures=current_figures(report), commit=commit,
                       text=f"{len(failed)} program(s) failed to compile; "
                            f"{failed[0]['name']}: {first}")
        same = layout_decision(report.get("layout") or "") == layout_decision(layout)
        return Row(name, target, "current" if same else "stale", figures=current_figures(report),
                   commit=commit, text="" if same else f"the rule lays it out otherwise now: "
                   f"{layout}; the report: {report.get('layout')}")
    return Row(name, target, "old", commit=commit,
               text=f"old report (commit {commit[:8]}, no compile seconds)")


def collect(names: Sequence[str] | None = None, targets: Sequence[str] = TARGETS,
            reports: pathlib.Path = REPORTS) -> list[Row]:
    """A :class:`Row` per experiment of ``names`` (default: every resolved one) x target."""
    from jaxflow.compile_only.variants import RESOLVED

    rows = []
    for name in names or list(RESOLVED):
        config = importlib.import_module(f"configs.{name}").get_config("full")
        for target in targets:
            path = report_path(name, target, reports)
            report = json.loads(path.read_text()) if path.exists() else None
            rows.append(matrix_row(name, target, report=report,
                                   rule=rule(name, target, config)))
    return rows


def commit_dates(commits, root: pathlib.Path = REPO_ROOT) -> dict[str, str]:
    """{commit: its committer date YYYY-MM-DD} for the commits git knows in ``root``."""
    commits = sorted({c for c in commits if c})
    if not commits:
        return {}
    try:
        out = subprocess.run(["git", "log", "--no-walk=unsorted", "--format=%H %cs", *commits],
                             cwd=root, capture_output=True, text=True, check=False)
    except OSError:
        return {}
    if out.returncode != 0:  # an unknown commit fails the batch: ask one at a time
        return {k: v for c in commits for k, v in commit_dates([c], root).items()} \
            if len(commits) > 1 else {}
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def _num(x, digits=1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "" if x is None else f"{x:.1%}"


def _load(load) -> str:
    return "" if not load else f" (load {load[0]:.1f} -> {load[1]:.1f})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: Sequence[Row], dates: dict[str, str] | None = None) -> str:
    """The markdown of ``rows`` (:data:`HEADER`, a summary line, one table row per cell);
    ``dates``: {commit: date} (:func:`commit_dates`)."""
    dates = dates or {}
    counts = {s: sum(r.status == s for r in rows)
              for s in ("current", "stale", "failed", "exit 2", "old", "missing")}
    lines = [HEADER, "Cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", "",
             "| experiment | target | status | HBM GiB (largest program) | compile s slowest "
             "(program) / total | wall s | Pallas calls | fallbacks | MFU bound / estimate "
             "(program) | commit (date) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        commit = f"{r.commit[:8]} ({dates[r.commit]})" if r.commit in dates else r.commit[:8]
        if r.figures is None:
            lines.append(f"| {r.name} | {r.target} | {r.status} | {_cell(r.text)} | | | | | | "
                         f"{commit if r.status == 'old' else ''} |")
            continue
        f = r.figures
        hbm = (f"{_num(f['hbm_gib'])} / {_num(f['capacity_gib'])} ({f['hbm_program']})"
               if f["hbm_gib"] is not None else "")
        if f["not_ok"]:
            hbm += ("; " if hbm else "") + "not ok: " + ", ".join(f["not_ok"])
        if r.text:  # stale or failed
            hbm += "; " + r.text
        slow = f"{_num(f['slowest'][1])} ({f['slowest'][0]})" if f["slowest"] else ""
        mfu = (f"{_pct(f['mfu_bound'])} / {_pct(f['mfu_estimate'])} ({f['step']})"
               if f["step"] else "none (no train program has them)")
        lines.append(f"| {r.name} | {r.target} | {r.status} | {_cell(hbm)} | {_cell(slow)} / "
                     f"{_num(f['total_seconds'])} | {_num(f['wall_seconds'], 0)}{_load(f['load'])} | "
                     f"{f['pallas_calls']} | {f['fallbacks']} | {_cell(mfu)} | {commit} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``--write`` the README, ``--check`` it (exit 1 on drift), else print the table."""
    parser = argparse.ArgumentParser(prog="python -m jaxflow.compile_only.matrix",
                                     description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {README}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the README differs")
    args = parser.parse_args(argv)
    rows = collect()
    text = render(rows, commit_dates(r.commit for r in rows))
    if args.write:
        README.write_text(text)
        print(f"wrote {README}")
    elif args.check:
        if not README.exists() or README.read_text() != text:
            print(f"{README} differs from the reports; run python -m "
                  "jaxflow.compile_only.matrix --write", file=sys.stderr)
            return 1
        print(f"{README} matches the reports")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
