"""Pages rendered from records: the experiments index, one docs page per experiment, the
README's figures block and the docs navigation.

Every figure on these pages comes from a record (:mod:`jaxflow.results.record`); the prose
comes from a template (:mod:`jaxflow.results.template`). A record is *stale* when the content
hash of its measured paths in the tree being rendered differs from the one it recorded
(:class:`Staleness`); stale records stay on the pages, marked. Figures are shown per machine
(XLA:CPU's rounding differs across CPUs), each with its spread where the run measured one.
"""

from __future__ import annotations

import pathlib
import re
from typing import Mapping, Sequence

from jaxflow import provenance
from jaxflow.results.template import fill

INDEX = "experiments/README.md"
PAGES_SRC = "experiments/pages"
DOCS_PAGES = "docs/experiments"
README = "README.md"
MKDOCS = "mkdocs.yml"
README_BEGIN = "<!-- results: begin (python -m jaxflow.results render; do not edit by hand) -->"
README_END = "<!-- results: end -->"
NAV_BEGIN = "  # results nav: begin (python -m jaxflow.results render)"
NAV_END = "  # results nav: end"
GENERATED = ("<!-- Rendered by `python -m jaxflow.results render` from {sources}; edit those, "
             "not this file (`python -m jaxflow.results --check` compares). -->")
NO_RECORD = "no record at HEAD yet"


class Staleness:
    """``stale(record)``: True when the record's ``measured_hash`` differs from the hash of its
    measured paths under ``root`` now (hashes cached per path list)."""

    def __init__(self, root: pathlib.Path = provenance.REPO_ROOT):
        self.root = pathlib.Path(root)
        self._cache: dict[tuple[str, ...], str] = {}

    def __call__(self, record: Mapping) -> bool:
        paths = tuple(record.get("measured_paths") or ())
        if paths not in self._cache:
            self._cache[paths] = provenance.measured_hash(paths, self.root)
        return self._cache[paths] != record.get("measured_hash")


def number(value) -> str:
    """A figure as text: 3 significant digits (thousands grouped above 1,000)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def with_unit(value, unit: str | None) -> str:
    """``6.02x`` for unit ``x`` (``1.44x tensor bytes`` for ``x tensor bytes``); ``0.895 accuracy``
    for other units; the bare number without one."""
    if unit == "x" or (unit or "").startswith("x "):
        return f"{number(value)}{unit}"
    return f"{number(value)} {unit}" if unit else number(value)


def has_spread(spread: Mapping | None) -> bool:
    """Whether ``spread`` spans more than one seed / round / pair (one gives no interval)."""
    return bool(spread) and int(spread.get("n") or 0) > 1


def spread_text(spread: Mapping | None, unit: str | None = None) -> str:
    """``low-high (interval, n=N)`` or ``one run`` when the run measured no spread (or one
    seed / round / pair)."""
    if not has_spread(spread):
        return "one run, no spread" if not spread else f"one {str(spread.get('kind', 'runs'))[:-1]} only, no spread"
    return (f"{with_unit(spread['low'], unit)} to {with_unit(spread['high'], unit)} "
            f"({spread.get('interval', spread.get('kind', ''))}, n={spread.get('n')})")


def figures(record: Mapping) -> list[dict]:
    """The record's figures as headline-shaped dicts: its headlines, or its key figures."""
    if record.get("headlines"):
        return list(record["headlines"])
    return [{"name": k, "value": v, "unit": None, "spread": None, "baseline": None,
             "target_text": "", "met": None} for k, v in (record.get("key_figures") or {}).items()]


def _note(fig: Mapping) -> str:
    """`` (the headline's own note)``, e.g. a simulator's stale calibration, or nothing."""
    return f" {fig['note']}" if fig.get("note") else ""


def _met(value) -> str:
    return {True: "yes", False: "**no**"}.get(value, "n/a")


def newest_per_machine(records: Sequence[tuple[pathlib.Path, dict]]) -> list[tuple[pathlib.Path, dict]]:
    """The newest record of each machine (records oldest first), newest machine first."""
    newest: dict[str, tuple[pathlib.Path, dict]] = {}
    for path, rec in records:
        newest[rec["machine"]["short"]] = (path, rec)
    return sorted(newest.values(), key=lambda pr: str(pr[1].get("date")), reverse=True)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _baseline(fig: Mapping) -> str:
    if not fig.get("baseline"):
        return "none measured" if fig.get("baselines") == {} else "n/a"
    return f"{fig['baseline']} (strongest of {', '.join(fig.get('baselines') or [fig['baseline']])})"


def _commit(rec: Mapping) -> str:
    return (f"`{rec['commit'][:8]}`" if rec.get("commit") else "unknown") + (" (dirty)" if rec.get("dirty") else "")


def _stale_word(rec: Mapping, stale: Staleness) -> str:
    return "**stale**" if stale(rec) else "current"


def lookup_figure(records: Mapping[str, list], stale: Staleness):
    """The template lookup: ``(experiment, figure)`` -> the figure of each machine's newest record
    (machine named, stale marked), or None when no record of the experiment has that figure. A
    figure ``prefix*`` gives every figure whose name starts with ``prefix``, each named."""
    def value(fig: Mapping) -> str:
        spread = f" [{number(fig['spread']['low'])}, {number(fig['spread']['high'])}]" \
            if has_spread(fig.get("spread")) else ""
        return f"{with_unit(fig['value'], fig.get('unit'))}{spread}{_note(fig)}"

    def lookup(experiment: str, name: str) -> str | None:
        recs = records.get(experiment)
        if not recs:
            return f"({NO_RECORD})" if experiment else None
        out = []
        for _, rec in newest_per_machine(recs):
            note = f"{rec['machine']['short']}, {rec['variant']}" + (", stale" if stale(rec) else "")
            if name.endswith("*"):
                figs = [f for f in figures(rec) if str(f["name"]).startswith(name[:-1])]
                if figs:
                    out.append(", ".join(f"`{f['name']}` {value(f)}" for f in figs) + f" ({note})")
                continue
            fig = next((f for f in figures(rec) if f["name"] == name), None)
            if fig is not None:
                out.append(f"{value(fig)} ({note})")
        return "; ".join(out) or None
    return lookup


def render_page(name: str, template: str, records: Mapping[str, list], stale: Staleness) -> tuple[str, list[str]]:
    """(the docs page of experiment ``name``, the template's unknown placeholders)."""
    body, unknown = fill(template.strip() + "\n", lookup_figure(records, stale))
    recs = records.get(name, [])
    out = [GENERATED.format(sources=f"`{PAGES_SRC}/{name}.md` and `experiments/results/{name}/`"), "",
           body.rstrip(), "", "## Newest record per machine", ""]
    newest = newest_per_machine(recs)
    if not newest:
        out.append(f"*{NO_RECORD}*: run it with `--record` (`python -m jaxflow.run --exp={name} "
                   f"--variant=quick --record`).")
    else:
        rows = []
        for _, rec in newest:
            load = rec.get("load") or {}
            for fig in figures(rec):
                rows.append([rec["machine"]["short"], rec["variant"], fig["name"],
                             with_unit(fig["value"], fig.get("unit")) + _note(fig),
                             spread_text(fig.get("spread"), fig.get("unit")),
                             _baseline(fig), fig.get("target_text") or "n/a", _met(fig.get("met")),
                             f"{load.get('start_1min')} / {load.get('end_1min')}",
                             _commit(rec),
                             str(rec.get("date")), _stale_word(rec, stale)])
        out.append(_table(["machine", "variant", "figure", "value", "spread", "strongest baseline",
                           "target", "met", "load start / end", "commit", "date", "code"], rows))
        for _, rec in newest:
            if rec.get("headlines_note"):
                out += ["", f"`{rec['machine']['short']}`: {rec['headlines_note']}."]
                break
        machines = sorted({rec["machine"]["short"] for _, rec in newest})
        out += ["", "Machines: " + "; ".join(
            f"`{m}` = {next(r for _, r in newest if r['machine']['short'] == m)['machine']['cpu_model']}, "
            f"{next(r for _, r in newest if r['machine']['short'] == m)['machine']['cores']} cores"
            for m in machines) + ". Figures differ across machines (XLA:CPU rounding), so each is shown."]
    older = [pr for pr in recs if pr not in newest]
    if older:
        rows = []
        for path, rec in reversed(older):
            fig = (figures(rec) or [{"name": "-", "value": "-"}])[0]
            rows.append([str(rec.get("date")), rec["machine"]["short"], rec["variant"], fig["name"],
                         with_unit(fig["value"], fig.get("unit")), _commit(rec),
                         _stale_word(rec, stale), f"`{path.name}`"])
        out += ["", "## History", "", _table(["date", "machine", "variant", "figure", "value", "commit",
                                               "code", "record"], rows)]
    return "\n".join(out) + "\n", unknown


def _headline_cells(name: str, records: Mapping[str, list], stale: Staleness) -> list[str]:
    recs = records.get(name, [])
    if not recs:
        return [NO_RECORD, "", "", "", "", ""]
    current = [pr for pr in recs if not stale(pr[1])]
    _, rec = (current or recs)[-1]
    figs = figures(rec)
    fig = figs[0] if figs else {"name": "-", "value": "-"}
    base = f" vs {fig['baseline']}" if fig.get("baseline") else ""
    head = f"{fig['name']}: {with_unit(fig['value'], fig.get('unit'))}{base}"
    if has_spread(fig.get("spread")):
        head += f" [{number(fig['spread']['low'])}, {number(fig['spread']['high'])}]"
    head += _note(fig)
    if not rec.get("headlines"):
        head += " (key figure; no headline declared)"
    machines = len(newest_per_machine(recs))
    machine = rec["machine"]["short"] + (f" (+{machines - 1} more)" if machines > 1 else "")
    return [head, fig.get("target_text") or "n/a", _met(fig.get("met")), machine,
            str(rec.get("date"))[:10], _stale_word(rec, stale)]


def render_index(names: Sequence[str], records: Mapping[str, list], stale: Staleness) -> str:
    """``experiments/README.md``: one row per experiment, linking its docs page."""
    rows = [[f"[{n}](../{DOCS_PAGES}/{n}.md)", *_headline_cells(n, records, stale)] for n in names]
    return "\n".join([
        GENERATED.format(sources=f"`{PAGES_SRC}/` and `experiments/results/`"), "",
        "# Experiment results", "",
        "Every figure here is read from a record in `experiments/results/` (a run recorded with "
        "`python -m jaxflow.run --exp=NAME --variant=quick --record`, or "
        "`python -m jaxflow.results record RUN_DIR`): its machine, load, commit and the content hash "
        "of the code it measured. A record whose measured code has changed since is marked "
        "**stale**. Each experiment's page shows the newest record of every machine and the older "
        "ones; what the figures mean and how to run each experiment is on its page. How figures are "
        "measured: `experiments/CONVENTIONS.md`.", "",
        _table(["experiment", "headline (newest current record)", "target", "met", "machine", "date", "code"],
               rows), ""])


def render_readme_block(names: Sequence[str], records: Mapping[str, list], stale: Staleness) -> str:
    """The README's figures block (between its markers): the experiments that have a record."""
    rows = [[f"[{n}](docs/experiments/{n}.md)", *_headline_cells(n, records, stale)]
            for n in names if records.get(n)]
    missing = [n for n in names if not records.get(n)]
    text = [README_BEGIN, "",
            _table(["experiment", "headline", "target", "met", "machine", "date", "code"], rows)
            if rows else f"*{NO_RECORD} for any experiment.*"]
    if missing and rows:
        text += ["", f"{NO_RECORD}: {', '.join(f'`{n}`' for n in missing)} "
                     "([experiments/README.md](experiments/README.md))."]
    return "\n".join(text + ["", README_END])


def render_nav(names: Sequence[str]) -> str:
    """The mkdocs nav block (between its markers) listing the index and every experiment page."""
    lines = [NAV_BEGIN, "  - Experiments:", "      - Index: experiments.md"]
    lines += [f"      - {n}: experiments/{n}.md" for n in names]
    return "\n".join(lines + [NAV_END])


def replace_block(text: str, begin: str, end: str, block: str, where: str) -> str:
    """``text`` with the lines from ``begin`` to ``end`` (inclusive) replaced by ``block``;
    ResultsError when the markers are absent."""
    from jaxflow.results.registry import ResultsError

    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ResultsError(f"{where}: no '{begin}' ... '{end}' block; valid: a file holding both markers")
    return pattern.sub(lambda _: block, text, count=1)
