"""Executes the example notebooks with nbclient and prints each one's wall time.

    python examples/run_examples.py                      # every notebook this interpreter can run
    python examples/run_examples.py examples/01_*.ipynb  # only these
    .venv-aot/bin/python examples/run_examples.py examples/07_compile_only_tpu.ipynb

The kernel is this interpreter (``sys.executable -m ipykernel_launcher``, through a kernelspec
written to a temporary ``JUPYTER_PATH`` directory, so an installed ``python3`` kernelspec
pointing elsewhere is not used). Notebooks run in ``examples/`` and are never written back
(the committed ones stay output-free). The compile-only notebook (``NEEDS_LIBTPU``) runs only
where ``libtpu`` is installed and is reported as skipped elsewhere (``--no-skip`` runs it
anyway: its first cell then says it was skipped and the rest do nothing). Exit status: 0 when every
notebook ran without an error, 1 otherwise (each failure's cell error printed), 2 for a
notebook path that does not exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
#: Notebooks that compile for TPU: run only where libtpu is importable (the aot environment).
NEEDS_LIBTPU = ("07_compile_only_tpu.ipynb",)
CELL_TIMEOUT_S = 600


def have_libtpu() -> bool:
    """Whether ``libtpu`` is installed for this interpreter (the notebook's own test)."""
    return importlib.util.find_spec("libtpu") is not None


def use_this_interpreter(tmp: str) -> None:
    """Points the ``python3`` kernelspec at ``sys.executable`` (first in ``JUPYTER_PATH``)."""
    spec_dir = pathlib.Path(tmp, "kernels", "python3")
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python 3 ({sys.executable})", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (tmp, os.environ.get("JUPYTER_PATH")) if p)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_notebook(path: pathlib.Path, executed_dir: pathlib.Path | None = None
                 ) -> tuple[float, float, str | None]:
    """Executes ``path`` in a fresh kernel: (wall seconds, the kernel's CPU seconds, None or
    the error text). With ``executed_dir`` the executed notebook (outputs included) is
    written there as well. CPU seconds are those of the finished kernel process (this
    process's reaped children), less sensitive to a busy machine than wall time."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(path.parent)}})
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    error = None
    try:
        client.execute()
    except CellExecutionError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - a dead kernel or a timeout is this notebook's failure
        error = f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - start
    cpu = _children_cpu_s() - cpu_start  # the kernel was shut down (and reaped) by execute()
    if executed_dir is not None:
        executed_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, executed_dir / path.name)
    return seconds, cpu, error


def main(argv: list[str] | None = None) -> int:
    """Runs the notebooks named (default: every ``examples/NN_*.ipynb``); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebook paths (default: every examples/NN_*.ipynb)")
    parser.add_argument("--executed-dir", type=pathlib.Path,
                        help="also write each executed notebook (with outputs) into this directory")
    parser.add_argument("--no-skip", action="store_true",
                        help="run the libtpu notebooks here too (checks that they skip cleanly)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    libtpu = have_libtpu()
    failed, skipped, total = [], [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        use_this_interpreter(tmp)
        for path in paths:
            if path.name in NEEDS_LIBTPU and not libtpu and not args.no_skip:
                print(f"{path.name:<36} skipped (libtpu is not installed for {sys.executable})", flush=True)
                skipped.append(path.name)
                continue
            seconds, cpu, error = run_notebook(path, args.executed_dir)
            total += seconds
            print(f"{path.name:<36} {seconds:6.1f} s wall {cpu:6.1f} s CPU  {'FAILED' if error else 'ok'}",
                  flush=True)
            if error:
                failed.append(path.name)
                print(error[-6000:], file=sys.stderr, flush=True)
    print(f"{len(paths) - len(skipped)} notebooks run in {total:.1f} s, {len(skipped)} skipped; "
          f"failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
