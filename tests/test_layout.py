"""House layout: drivers in jaxflow/main, no import cycles between packages, quick runs as listed,
modules under 500 lines, one train state, one training loop, the runner contract
(``jaxflow.contract``), no TYPE_CHECKING cycles, ruff clean.

The import graph is read with ``ast`` (no module is imported), lazy imports inside functions
included. A node is a subpackage of ``jaxflow`` (``rl``, ``sync``, ...) or one of its top-level
modules (``jaxflow.mesh``, ``jaxflow.run``, ...).
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

from jaxflow.config import experiments
from jaxflow.contract import check_experiment
from jaxflow.run import default_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxflow"
DRIVERS = "main"
PACKAGES = ("jaxflow", "pallas_kernels", "configs")
MAX_LINES = 500


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


def _imports(pkg: pathlib.Path):
    """(module, import node, the names it imports, path) for every import statement under
    ``pkg``, lazy ones inside functions included; ``from a import b`` imports ``a`` and ``a.b``."""
    for path in sorted(pkg.rglob("*.py")):
        mod = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield mod, node, [a.name for a in node.names], path
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module else []
                yield mod, node, names, path


def import_edges(pkg: pathlib.Path = PKG) -> list[tuple[str, str, str]]:
    """(importing module, imported module, source file) for every jaxflow import under ``pkg``."""
    edges = []
    for mod, node, targets, path in _imports(pkg):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the project uses absolute ones)"
        edges += [(mod, t, str(path.relative_to(ROOT))) for t in targets if t.startswith("jaxflow.")]
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


# --- The kernel floor: pallas_kernels imports no jaxflow, and its modules form no cycle ----------

KERNELS = ROOT / "pallas_kernels"


def kernel_import_edges(pkg: pathlib.Path = KERNELS) -> list[tuple[str, str, str]]:
    """(importing module, imported module, source file) for every import under ``pkg`` (lazy
    ones inside functions included); ``from pallas_kernels import x`` imports
    ``pallas_kernels.x``."""
    return [(mod, t, _rel(path)) for mod, _, targets, path in _imports(pkg) for t in targets]


def kernel_module_graph(edges) -> dict[str, set[str]]:
    """Module -> the other ``pallas_kernels`` modules it imports (names that are not modules,
    ``from pallas_kernels.x import Name``, count as an import of ``x``)."""
    modules = {_module_name(p) for p in KERNELS.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges:
        while dst and dst not in modules:
            dst = dst.rpartition(".")[0]
        if dst and dst != src and dst != "pallas_kernels":
            graph.setdefault(src, set()).add(dst)
    return graph


def test_kernel_floor_imports_no_jaxflow():
    bad = [f"{f}: {src} imports {dst}" for src, dst, f in kernel_import_edges()
           if dst == "jaxflow" or dst.startswith("jaxflow.")]
    assert not bad, ("pallas_kernels imports jaxflow (the kernel floor sits below the library: "
                     "let the library pass its functions in):\n" + "\n".join(bad))


def test_no_import_cycle_between_kernel_modules():
    graph = kernel_module_graph(kernel_import_edges())
    assert graph, "no imports between pallas_kernels modules found: the graph reader is broken"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between pallas_kernels modules: {' -> '.join(cycle)}"


def test_kernel_graph_reader_sees_lazy_imports_and_names(tmp_path, monkeypatch):
    pkg = tmp_path / "pallas_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pallas_kernels.b import Thing\n")
    (pkg / "b.py").write_text("def f():\n    from pallas_kernels import a\n    import jaxflow.mesh\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", pkg)
    edges = kernel_import_edges(pkg)
    assert find_cycle(kernel_module_graph(edges)) == ["pallas_kernels.a", "pallas_kernels.b",
                                                      "pallas_kernels.a"]
    assert ("pallas_kernels.b", "jaxflow.mesh", "pallas_kernels/b.py") in edges


# --- Drivers: thin, and composed of public library names only ------------------------------------

DRIVER_DIR = PKG / DRIVERS
MAX_DRIVER_LINES = 150

# Today's violations, each asserted to still hold (a stale entry fails: remove it once the
# driver is thin / untied). Helper modules (``jaxflow/main/_*.py``) are being moved into the
# library; they count as drivers until then.
#: Drivers over MAX_DRIVER_LINES lines.
DRIVERS_NOT_YET_THIN: frozenset[str] = frozenset()
#: (driver, the other jaxflow.main module it imports).
DRIVER_IMPORTS_NOT_YET_UNTIED: frozenset[tuple[str, str]] = frozenset()
#: (driver, the private name it uses: ``module._name`` or ``from module import _name``).
DRIVER_PRIVATE_NAMES_NOT_YET_GONE: frozenset[tuple[str, str]] = frozenset()
#: Helper modules in jaxflow/main that no experiment's ENTRY names.
HELPERS_NOT_YET_MOVED: frozenset[str] = frozenset()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def driver_imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(other ``jaxflow.main`` modules, private names) one driver uses, read with ``ast``.

    Private names: an imported name or a module-path part starting with one underscore
    (``from x import _y``, ``from x._y import z``), or ``x._y`` where ``x`` is a name an import
    bound (a module, or anything imported from one)."""
    tree = ast.parse(path.read_text(), str(path))
    drivers, private, bound = set(), set(), set()

    def see_module(module: str) -> None:
        parts = module.split(".")
        if parts[:2] == ["jaxflow", DRIVERS] and len(parts) > 2:
            drivers.add(parts[2])
        if any(_private(p) for p in parts):
            private.add(module)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                see_module(a.name)
                bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            see_module(node.module)
            for a in node.names:
                bound.add(a.asname or a.name)
                if node.module == f"jaxflow.{DRIVERS}":
                    drivers.add(a.name)
                if _private(a.name):
                    private.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                private.add(".".join([base.id, *reversed(chain)]))
    drivers.discard(path.stem)
    return drivers, private


def _drivers() -> list[pathlib.Path]:
    return sorted(p for p in DRIVER_DIR.glob("*.py") if p.name != "__init__.py")


def _check_allowlist(found: set, allowed: frozenset, what: str, name: str) -> None:
    new, stale = sorted(found - allowed), sorted(allowed - found)
    assert not new, f"{what}: {new}"
    assert not stale, f"{name} lists what no longer holds (remove it): {stale}"


def test_drivers_are_thin():
    """A driver is config -> system -> run_steps -> report: at most MAX_DRIVER_LINES lines."""
    long = {p.stem for p in _drivers() if len(p.read_text().splitlines()) > MAX_DRIVER_LINES}
    _check_allowlist(long, DRIVERS_NOT_YET_THIN, f"drivers over {MAX_DRIVER_LINES} lines (move "
                     "the library work into the library)", "DRIVERS_NOT_YET_THIN")


def test_no_driver_imports_another_driver_or_a_private_name():
    imports, private = set(), set()
    for p in _drivers():
        drivers, names = driver_imports(p)
        imports |= {(p.stem, d) for d in drivers}
        private |= {(p.stem, n) for n in names}
    _check_allowlist(imports, DRIVER_IMPORTS_NOT_YET_UNTIED, "drivers importing other drivers "
                     "(share code through a library module)", "DRIVER_IMPORTS_NOT_YET_UNTIED")
    _check_allowlist(private, DRIVER_PRIVATE_NAMES_NOT_YET_GONE, "drivers using private names "
                     "(make them public in the library)", "DRIVER_PRIVATE_NAMES_NOT_YET_GONE")


def test_jaxflow_main_holds_only_drivers():
    entries = {spec.entry.split(":")[0].rsplit(".", 1)[-1] for spec in experiments().values()}
    helpers = {p.stem for p in _drivers() if p.stem not in entries}
    _check_allowlist(helpers, HELPERS_NOT_YET_MOVED, "modules in jaxflow/main no experiment "
                     "runs (library code belongs in a library package)", "HELPERS_NOT_YET_MOVED")


def test_driver_reader_finds_cross_driver_imports_and_private_names(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import jax\nimport jaxflow.main.y\nfrom jaxflow.main import z, x\n"
                    "from jaxflow.rl import grpo, _hidden\nfrom jaxflow.main._helper import f\n"
                    "from jax._src import core\n\n\ndef g(self):\n"
                    "    return grpo._step, jax.tree._impl, self._ok, jax.__name__, f\n")
    drivers, private = driver_imports(path)
    assert drivers == {"y", "z", "_helper"}
    assert private == {"jaxflow.rl._hidden", "jaxflow.main._helper", "jax._src", "grpo._step",
                       "jax.tree._impl"}


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


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _calls(path: pathlib.Path):
    """(dotted name, line) of every call in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f, parts = node.func, []
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            yield ".".join(reversed(parts)), node.lineno


def _rel(path):
    return path.relative_to(ROOT).as_posix()


def test_no_module_over_500_lines():
    long = {_rel(p): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


def test_one_optimizer_step():
    """``optax.apply_updates`` only in TrainState.apply_gradients (and the f32-master
    transformation, which is itself an optax transformation TrainState applies)."""
    allowed = {"jaxflow/train/state.py", "jaxflow/train/mixed_precision.py"}
    found = [f"{_rel(p)}:{line}" for p in _modules() if _rel(p) not in allowed
             for name, line in _calls(p) if name.endswith("apply_updates")]
    assert not found, f"hand-written optimizer steps (use TrainState.apply_gradients): {found}"


def test_one_training_loop():
    """Resuming a run (cutting its metrics back to a checkpoint) happens in run_steps only, and
    no fault hook is read from the environment."""
    found = [f"{_rel(p)}:{line}" for p in _modules() if _rel(p) != "jaxflow/train/loop.py"
             for name, line in _calls(p) if name.endswith("truncate_metrics_after")]
    assert not found, f"resume loops outside jaxflow.train.loop.run_steps: {found}"
    hooks = [_rel(p) for p in _modules() if "KILL_AFTER" in p.read_text()]
    assert not hooks, f"environment-variable fault hooks (use Fault / --kill-after-checkpoint): {hooks}"


def test_one_rollout_engine():
    """One class named ``RolloutEngine`` (jaxflow.rollout's paged engine), and no second
    sampling loop in jaxflow.marl: it samples through jaxflow.rollout, never through the
    foundation's decoder or static sampler."""
    engines = [_rel(p) for p in _modules() for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.ClassDef) and node.name == "RolloutEngine"]
    assert engines == ["jaxflow/rollout/engine.py"], f"classes named RolloutEngine: {engines}"
    loops = {"make_decoder", "make_sampler", "sample", "draw_with_dist", "Decoder", "DecodeCarry"}
    marl = list(_imports(PKG / "marl"))
    found = [f"{_rel(path)}:{node.lineno} {n}" for _, node, names, path in marl for n in names
             if n.rpartition(".")[0] in ("jaxflow.models", "jaxflow.models.sampler")
             and n.rpartition(".")[2] in loops]
    assert not found, f"jaxflow.marl samples outside jaxflow.rollout (use AgentSampler): {found}"
    assert any(n == "jaxflow.rollout" for *_, names, _ in marl for n in names)  # the one engine


def test_runner_contract_is_the_protocol():
    """Every experiment keeps jaxflow.contract, and the runner reads configs / drivers only
    through it (no hasattr / getattr probing)."""
    problems = [p for spec in experiments().values() for p in check_experiment(spec)]
    assert not problems, problems
    probes = [f"{name}:{line}" for name in ("run.py", "run_meshes.py")
              for call, line in _calls(ROOT / "jaxflow" / name) if call in ("hasattr", "getattr")]
    assert not probes, f"duck-typed probes in the runner (use jaxflow.contract): {probes}"


def test_no_type_checking_import_cycles_and_one_meaning_of_sync():
    guarded = [_rel(p) for p in _modules() if "TYPE_CHECKING" in p.read_text()]
    assert not guarded, f"TYPE_CHECKING imports hide an import cycle: {guarded}"
    assert not (ROOT / "jaxflow" / "marl" / "pipeline" / "sync.py").exists(), \
        "marl/pipeline/sync.py: 'sync' is jaxflow.sync (weight sync); the barrier baseline is barrier.py"


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    probe = subprocess.run([*cmd, "--version"], capture_output=True, text=True)
    assert probe.returncode == 0, "ruff is missing: pip install -e '.[test]' installs it"
    res = subprocess.run([*cmd, "check", "--no-cache", *PACKAGES, "tests"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


# --- The public API: ``__all__`` in every package, a docstring on everything it names ----------

def _packages() -> list[str]:
    """Every package under jaxflow/ and pallas_kernels/ as a dotted name."""
    return sorted(_module_name(p) for d in ("jaxflow", "pallas_kernels") for p in (ROOT / d).rglob("__init__.py"))


def _submodule_doc(package: str, name: str) -> str | None:
    """The docstring of ``package.name`` read from its source (no import), or None if no such file."""
    base = ROOT.joinpath(*package.split("."), name)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    return None


def _own_doc(obj) -> str:
    """``obj``'s own docstring: not one inherited from a base class (``str``'s for a str enum), not a
    dataclass's or namedtuple's generated ``Name(field, ...)`` signature, not ``partial``'s."""
    import functools
    import re

    if isinstance(obj, functools.partial):
        obj = obj.func
    if isinstance(obj, type):
        doc = (obj.__dict__.get("__doc__") or "").strip()
        if re.fullmatch(re.escape(obj.__name__) + r"\([^\n]*\)", doc):
            return ""
        return doc
    return (getattr(obj, "__doc__", None) or "").strip()


def _members(cls) -> list[tuple[str, object]]:
    """The public methods and properties ``cls`` defines itself (inherited ones are the base's)."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        if callable(value) and getattr(value, "__qualname__", "").startswith(cls.__qualname__ + "."):
            found.append((name, value))
    return found


def undocumented_public_objects(packages) -> tuple[list[str], int]:
    """(names of the public objects without a docstring of their own, how many objects were checked).

    Public objects: what each package's ``__all__`` names (modules, classes, enums, functions; data
    such as ``ALGOS`` tuples cannot carry a docstring), and the public methods and properties of
    those classes."""
    import importlib
    import inspect

    missing, seen = [], set()
    for package in packages:
        module = importlib.import_module(package)
        for name in module.__all__:
            qual, obj = f"{package}.{name}", getattr(module, name, None)
            if obj is None or inspect.ismodule(obj):  # a submodule, imported or not: read its source
                doc = _submodule_doc(package, name)
                if not (doc if doc is not None else _own_doc(obj)):
                    missing.append(qual)
                continue
            if not (inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj) and hasattr(obj, "__wrapped__")):
                continue  # data
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if not _own_doc(obj):
                missing.append(qual)
            if inspect.isclass(obj):
                missing += [f"{qual}.{m}" for m, fn in _members(obj) if not _own_doc(fn)]
    return missing, len(seen)


def test_every_package_has_all_and_it_resolves():
    import importlib

    without = [p for p in _packages() if not hasattr(importlib.import_module(p), "__all__")]
    assert not without, f"packages without __all__ (help() would list their imports as API): {without}"
    unresolved = [f"{p}.{n}" for p in _packages() for n in importlib.import_module(p).__all__
                  if not hasattr(importlib.import_module(p), n) and _submodule_doc(p, n) is None]
    assert not unresolved, f"__all__ names nothing of that name: {unresolved}"


def test_every_public_object_has_a_docstring():
    missing, checked = undocumented_public_objects(_packages())
    assert checked > 300, checked
    assert not missing, f"public objects without a docstring of their own ({len(missing)}): {missing}"


def test_docstring_check_catches_inherited_and_generated_docstrings():
    import dataclasses
    import enum

    class Mode(str, enum.Enum):
        A = "a"

    @dataclasses.dataclass(frozen=True)
    class Config:
        x: int = 1

    class Documented(str, enum.Enum):
        """A documented enum."""

    assert _own_doc(Mode) == "" and _own_doc(Config) == "" and _own_doc(Documented) == "A documented enum."


def test_top_level_docstring_and_all_name_every_subpackage_and_module():
    """``jaxflow`` (its docstring and ``__all__``), ``jaxflow.main`` and ``pallas_kernels`` (their
    ``__all__``) name every subpackage / public module they hold."""
    import jaxflow
    import jaxflow.main
    import pallas_kernels

    def children(pkg: pathlib.Path) -> set[str]:
        return {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")} | \
            {p.parent.name for p in pkg.glob("*/__init__.py")}

    for module, path in ((jaxflow, PKG), (jaxflow.main, PKG / DRIVERS), (pallas_kernels, ROOT / "pallas_kernels")):
        absent = sorted(children(path) - set(module.__all__))
        assert not absent, f"{module.__name__}.__all__ lacks {absent}"
    unnamed = sorted(c for c in children(PKG) if f"jaxflow.{c} " not in jaxflow.__doc__)
    assert not unnamed, f"the jaxflow docstring does not name {unnamed}"


def test_docstring_check_names_what_lacks_one(tmp_path, monkeypatch):
    pkg = tmp_path / "docless_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""A package."""\nimport enum\n\n__all__ = ["f", "g", "C", "Mode", "LIMIT"]\nLIMIT = 3\n\n\n'
        'def f():\n    return 1\n\n\ndef g():\n    """Documented."""\n\n\n'
        'class C:\n    """Documented."""\n\n    def m(self):\n        return 1\n\n    @property\n'
        '    def p(self):\n        """Documented."""\n\n\nclass Mode(str, enum.Enum):\n    A = "a"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    missing, checked = undocumented_public_objects(["docless_pkg"])
    assert sorted(missing) == ["docless_pkg.C.m", "docless_pkg.Mode", "docless_pkg.f"] and checked == 4
