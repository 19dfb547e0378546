"""House layout: drivers in jaxflow/main, no import cycles between packages, quick runs as listed.

The import graph is read with ``ast`` (no module is imported), lazy imports inside functions
included. A node is a subpackage of ``jaxflow`` (``rl``, ``sync``, ...) or one of its top-level
modules (``jaxflow.mesh``, ``jaxflow.run``, ...).
"""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest

from jaxflow.config import experiments
from jaxflow.run import default_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxflow"
DRIVERS = "main"


def _node(module: str) -> str | None:
    """``jaxflow.rl.grpo`` -> ``rl``; ``jaxflow.mesh`` -> ``mesh``; non-jaxflow -> None."""
    parts = module.split(".")
    if parts[0] != "jaxflow" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_edges(pkg: pathlib.Path = PKG) -> list[tuple[str, str, str]]:
    """(importing module, imported module, source file) for every jaxflow import under ``pkg``."""
    edges = []
    for path in sorted(pkg.rglob("*.py")):
        mod = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import (the project uses absolute ones)"
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges += [(mod, t, str(path.relative_to(ROOT))) for t in targets
                      if t.startswith("jaxflow.")]
    return edges


def package_graph(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges:
        a, b = _node(src), _node(dst)
        if a and b and a != b and (PKG / b).exists() | (PKG / f"{b}.py").exists():
            graph.setdefault(a, set()).add(b)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_detects_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_packages():
    cycle = find_cycle(package_graph(import_edges()))
    assert cycle is None, f"import cycle between jaxflow packages: {' -> '.join(cycle)}"


def test_library_never_imports_a_driver():
    bad = [f"{f}: {src} imports {dst}" for src, dst, f in import_edges()
           if _node(dst) == DRIVERS and _node(src) != DRIVERS]
    assert not bad, "library modules importing experiment drivers:\n" + "\n".join(bad)


def test_every_entry_is_a_driver_and_every_driver_an_entry():
    entries = {name: spec.entry.split(":")[0] for name, spec in experiments().items()}
    outside = {n: e for n, e in entries.items() if not e.startswith(f"jaxflow.{DRIVERS}.")}
    assert not outside, f"experiment entries outside jaxflow/{DRIVERS}/: {outside}"
    drivers = {f"jaxflow.{DRIVERS}.{p.stem}" for p in (PKG / DRIVERS).glob("*.py")
               if not p.stem.startswith("_")}
    orphans = drivers - set(entries.values())
    assert not orphans, f"driver modules no experiment runs: {sorted(orphans)}"


def test_no_driver_left_in_library_packages():
    """A ``main(config, run)`` entry function belongs in jaxflow/main."""
    found = []
    for path in PKG.rglob("*.py"):
        if path.parent.name == DRIVERS:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main" and \
                    [a.arg for a in node.args.args][:2] == ["config", "run"]:
                found.append(str(path.relative_to(ROOT)))
    assert not found, f"experiment entry functions in library packages: {found}"


@pytest.mark.parametrize("name", sorted(experiments()))
def test_quick_variant_resolves_devices_and_mesh_on_one_cpu(name):
    """``--exp=NAME --variant=quick`` with no other flag: the fake-device count the runner would
    create on a 1-device CPU machine forms the config's mesh."""
    spec = experiments()[name]
    assert "quick" in spec.variants, f"{name} has no quick variant"
    config = spec.get_config("quick")
    args = argparse.Namespace(devices=None, coordinator=None, distributed_auto=False)
    n = default_devices(args, config) or 1
    mesh_cfg = getattr(config, "mesh", None)
    if mesh_cfg is not None and hasattr(mesh_cfg, "sizes"):
        sizes = mesh_cfg.sizes(n)  # raises MeshError when n devices cannot form it
        assert all(s >= 1 for s in sizes.values())
    wanted = getattr(config, "devices", None)
    if isinstance(wanted, int) and wanted > 1:
        assert n == wanted


def test_docs_cite_no_issue_numbers():
    import re

    pat = re.compile(r"\bissue\s+#?\d+", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("jaxflow", "configs", "pallas_kernels")
            for p in (ROOT / d).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    for md in (ROOT / "README.md", ROOT / "experiments" / "README.md"):
        hits += [f"{md.relative_to(ROOT)}:{i}" for i, line in
                 enumerate(md.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, f"'issue N' references (readers of the project have no issues): {hits}"
