"""Helpers for tests that run ``python -m jaxflow.run`` in a subprocess."""

import contextlib
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: A model small enough that lm_pretrain compiles and steps in seconds on one core.
TINY_LM = [
    "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
    "--set", "model.n_kv_heads=2", "--set", "model.d_ff=64", "--set", "train.batch_size=8",
    "--set", "train.seq_len=32", "--set", "train.eval_examples=16",
]


def cli_env(**extra: str) -> dict:
    """The environment of a ``python -m jaxflow.run`` child: this one without XLA_FLAGS (the
    child sets its own device count), the repository first on PYTHONPATH, the CPU platform
    unless one is set; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra)
    return env


def compile_cache_env(folder) -> dict:
    """``env_extra`` for ``run_cli``: the children share jax's persistent compilation cache in
    ``folder`` (every program cached), so a killed run's resume and a second run of the same
    programs load them instead of compiling again (a tiny run: ~17 CPU-s -> ~7)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(folder),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@contextlib.contextmanager
def persistent_compile_cache(folder):
    """The in-process twin of :func:`compile_cache_env`: while the block runs, jax caches every
    program it compiles in ``folder`` (previous settings restored after), so a program built
    again by a new ``jax.jit`` of the same function (the same HLO) is loaded, not compiled."""
    import jax

    from jaxflow.compile_only.compile import persistent_cache

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        with persistent_cache(str(folder)):
            yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args, *, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    env = cli_env(**(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "jaxflow.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(capsys, argv) -> str:
    """Runs the CLI in-process on ``argv``; asserts exit 2 with one stderr line and no traceback;
    returns that line."""
    from jaxflow import run as runner

    code = runner.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err[-2000:])
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err
