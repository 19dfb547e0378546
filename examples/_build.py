"""Writes the example notebooks from their sources in ``examples/_src/`` (outputs stripped).

Each source is a Python file in the "percent" format: ``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell whose lines are comments (``# `` stripped). Header lines
before the first cell marker (a ruff directive, ``# title: ...``) are not emitted. The
notebooks are generated, never edited by hand:

    python examples/_build.py            # (re)write examples/*.ipynb
    python examples/_build.py --check    # exit 1 if a notebook differs from its source
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "_src"
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """[(kind, source)] of a percent-format file, kind "code" or "markdown"."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            kind, lines = cells[-1]
            if kind == "markdown":
                if line and not line.startswith("#"):
                    raise ValueError(f"markdown cell line is not a comment: {line!r}")
                line = line[2:] if line.startswith("# ") else line.lstrip("#")
            lines.append(line)
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def build_notebook(source: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook of one source file: deterministic cell ids, no outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    for i, (kind, text) in enumerate(parse_cells(source.read_text())):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text, id=f"cell-{i:02d}"))
    nbformat.validate(nb)
    return nb


def notebook_text(source: pathlib.Path) -> str:
    """The .ipynb text written for ``source``."""
    return nbformat.writes(build_notebook(source)) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Writes (or with ``--check`` compares) every notebook; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        target = HERE / (source.stem + ".ipynb")
        text = notebook_text(source)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print(f"notebooks out of date with examples/_src (run python examples/_build.py): {stale}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
