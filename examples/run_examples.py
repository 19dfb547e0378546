"""Executes the example notebooks with nbclient and prints each one's wall time.

    python examples/run_examples.py                      # every notebook this interpreter can run
    python examples/run_examples.py examples/01_*.ipynb  # only these
    .venv-aot/bin/python examples/run_examples.py examples/07_compile_only_tpu.ipynb

The kernel is this interpreter (``sys.executable -m ipykernel_launcher``, through a kernelspec
written to a temporary ``JUPYTER_PATH`` directory, so an installed ``python3`` kernelspec
pointing elsewhere is not used). Notebooks run in ``examples/`` and are never written back
(the committed ones stay output-free). The compile-only notebook (``NEEDS_LIBTPU``) runs only
where ``libtpu`` imports and is reported as skipped elsewhere. Exit status: 0 when every
notebook ran without an error, 1 otherwise (each failure's cell error printed), 2 for a
notebook path that does not exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
#: Notebooks that compile for TPU: run only where libtpu is importable (the aot environment).
NEEDS_LIBTPU = ("07_compile_only_tpu.ipynb",)
CELL_TIMEOUT_S = 600


def have_libtpu() -> bool:
    """Whether ``libtpu`` is importable in this interpreter."""
    return importlib.util.find_spec("libtpu") is not None


def use_this_interpreter(tmp: str) -> None:
    """Points the ``python3`` kernelspec at ``sys.executable`` (first in ``JUPYTER_PATH``)."""
    spec_dir = pathlib.Path(tmp, "kernels", "python3")
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python 3 ({sys.executable})", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (tmp, os.environ.get("JUPYTER_PATH")) if p)


def run_notebook(path: pathlib.Path) -> tuple[float, str | None]:
    """Executes ``path`` in a fresh kernel; (wall seconds, None or the error text)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as err:
        return time.perf_counter() - start, str(err)
    except Exception as err:  # noqa: BLE001 - a dead kernel or a timeout is this notebook's failure
        return time.perf_counter() - start, f"{type(err).__name__}: {err}"
    return time.perf_counter() - start, None


def main(argv: list[str] | None = None) -> int:
    """Runs the notebooks named (default: every ``examples/NN_*.ipynb``); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebook paths (default: every examples/NN_*.ipynb)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    libtpu = have_libtpu()
    failed, total = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        use_this_interpreter(tmp)
        for path in paths:
            if path.name in NEEDS_LIBTPU and not libtpu:
                print(f"{path.name:<36} skipped (libtpu does not import in {sys.executable})", flush=True)
                continue
            seconds, error = run_notebook(path)
            total += seconds
            print(f"{path.name:<36} {seconds:7.1f} s  {'FAILED' if error else 'ok'}", flush=True)
            if error:
                failed.append(path.name)
                print(error[-6000:], file=sys.stderr, flush=True)
    print(f"{len(paths)} notebooks, {total:.1f} s executing; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
