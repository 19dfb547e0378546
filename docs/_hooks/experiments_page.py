"""mkdocs hook: the experiments page is ``experiments/README.md`` itself, read at build time.

``docs/experiments.md`` holds one marker line, ``<!-- include: experiments/README.md -->``; this
hook replaces it with the README's text. The README's relative links are written from
``experiments/``: a link into ``docs/`` is rewritten to the docs page, a link to a file in
``experiments/`` (the plots) to that file, which ``on_files`` adds to the site under
``experiments/``. Any other relative link is left as written, so ``mkdocs build --strict`` fails
on it like on any broken reference.
"""

from __future__ import annotations

import pathlib
import posixpath
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- include: (\S+) -->")
# inline links and images: [text](target) / ![alt](target), target without spaces
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _rewrite(target: str, source_dir: str) -> str:
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
        return target  # URL, anchor or absolute path
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(source_dir, path))
    if resolved.startswith("docs/"):
        resolved = resolved[len("docs/"):]
    return resolved + (f"#{anchor}" if anchor else "")


def on_files(files, config):
    """Add the files under experiments/ that the README links to (its plots) to the site."""
    text = (ROOT / "experiments" / "README.md").read_text()
    for _, target, _ in LINK.findall(text):
        resolved = _rewrite(target, "experiments")
        if resolved.startswith("experiments/") and (ROOT / resolved).is_file() \
                and files.get_file_from_path(resolved) is None:
            files.append(File.generated(config, resolved, abs_src_path=str(ROOT / resolved)))
    return files


def on_page_markdown(markdown, page, config, files):
    """Replace an include marker by the named file's text, its relative links made docs-relative."""
    def include(match):
        rel = match.group(1)
        text = (ROOT / rel).read_text()
        source_dir = posixpath.dirname(rel)
        return LINK.sub(lambda m: m.group(1) + _rewrite(m.group(2), source_dir) + m.group(3), text)

    return MARKER.sub(include, markdown)
