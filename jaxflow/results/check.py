"""``render`` and ``--check``: the rendered pages as they should be, written or compared.

:func:`rendered` computes every page from the records and templates under a root (the index,
one docs page per experiment, the README's figures block, the docs navigation in
``mkdocs.yml``); :func:`render_all` writes them; :func:`check` lists every problem, one line
each: a page that differs from its render, a record whose digest does not match its content, a
template holding a literal figure or an unknown placeholder, a template or page that belongs to
no experiment.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

from jaxflow import provenance
from jaxflow.results import render
from jaxflow.results.record import RESULTS_DIR, digest_problem, read_records, record_run
from jaxflow.results.registry import MEASURED_PATHS
from jaxflow.results.template import literal_figures

_NO_TEMPLATE = "# {name}\n\n*No page text yet: write `experiments/pages/{name}.md`.*\n"


def _names(names: Sequence[str] | None) -> list[str]:
    return sorted(MEASURED_PATHS) if names is None else list(names)


def _template(root: pathlib.Path, name: str) -> str | None:
    path = root / render.PAGES_SRC / f"{name}.md"
    return path.read_text() if path.exists() else None


def rendered(root: pathlib.Path = provenance.REPO_ROOT, names: Sequence[str] | None = None
             ) -> tuple[dict[str, str], list[str]]:
    """({path relative to ``root``: its rendered text}, the templates' unknown placeholders as
    problem lines). ``names``: the experiments (default: the registry's)."""
    root, names = pathlib.Path(root), _names(names)
    records, stale = read_records(root), render.Staleness(root)
    files, problems = {}, []
    for name in names:
        template = _template(root, name) or _NO_TEMPLATE.format(name=name)
        files[f"{render.DOCS_PAGES}/{name}.md"], unknown = render.render_page(name, template, records, stale)
        problems += [f"{render.PAGES_SRC}/{name}.md: placeholder {{{{{u}}}}} names no figure of a record; "
                     f"valid: a headline name or key figure of {u.split('.')[0]}'s records" for u in unknown]
    files[render.INDEX] = render.render_index(names, records, stale)
    for rel, begin, end, block in (
            (render.README, render.README_BEGIN, render.README_END,
             render.render_readme_block(names, records, stale)),
            (render.MKDOCS, render.NAV_BEGIN, render.NAV_END, render.render_nav(names))):
        if (root / rel).exists():
            files[rel] = render.replace_block((root / rel).read_text(), begin, end, block, rel)
    return files, problems


def render_all(root: pathlib.Path = provenance.REPO_ROOT, names: Sequence[str] | None = None) -> list[str]:
    """Writes every rendered page under ``root`` (only those whose text changed); returns the
    paths written."""
    files, _ = rendered(root, names)
    written = []
    for rel, text in files.items():
        path = pathlib.Path(root) / rel
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(rel)
    return written


def check(root: pathlib.Path = provenance.REPO_ROOT, names: Sequence[str] | None = None) -> list[str]:
    """Every problem under ``root``, one line each (empty: pages, records and templates agree)."""
    root, names = pathlib.Path(root), _names(names)
    problems = []
    for experiment, recs in read_records(root).items():
        for path, rec in recs:
            rel = path.relative_to(root).as_posix()
            if (why := digest_problem(rec)) is not None:
                problems.append(f"{rel}: {why}")
            if rec.get("experiment") != experiment:
                problems.append(f"{rel}: experiment {rec.get('experiment')!r} in the folder of {experiment!r}; "
                                f"valid: {RESULTS_DIR}/<its experiment>/")
            if experiment not in names:
                problems.append(f"{rel}: no experiment {experiment!r}; valid: {', '.join(names)}")
    for name in names:
        template = _template(root, name)
        if template is None:
            problems.append(f"{render.PAGES_SRC}/{name}.md: missing; valid: a page text for every experiment")
            continue
        problems += [f"{render.PAGES_SRC}/{name}.md:{line}: literal figure {lit!r} outside a placeholder; "
                     f"valid: {{{{experiment.figure}}}} filled from a record, or inline code"
                     for line, lit in literal_figures(template)]
    for folder in (render.PAGES_SRC, render.DOCS_PAGES):
        problems += [f"{folder}/{p.name}: no experiment {p.stem!r}; valid: {', '.join(names)}"
                     for p in sorted((root / folder).glob("*.md")) if p.stem not in names]
    files, unknown = rendered(root, names)
    problems += unknown
    for rel, text in files.items():
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing; run python -m jaxflow.results render")
        elif path.read_text() != text:
            problems.append(f"{rel}: differs from its render (edited by hand, or a record or the "
                            f"measured code changed); run python -m jaxflow.results render")
    return problems


def record_and_render(run_dir, root: pathlib.Path | None = None) -> pathlib.Path:
    """Records the finished run in ``run_dir`` (:func:`jaxflow.results.record.record_run`),
    re-renders the pages, and returns the record's path (what ``--record`` does). ``root``:
    the repository (default :data:`jaxflow.provenance.REPO_ROOT`, read at the call)."""
    root = provenance.REPO_ROOT if root is None else root
    path = record_run(run_dir, root=root)
    render_all(root)
    return path
