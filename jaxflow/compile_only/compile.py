"""Compiling an experiment's programs for abstract chips: two at a time, nothing executed.

Each :class:`~jaxflow.compile_only.program.Program` is lowered under ``jax.set_mesh(mesh)``
(the mesh context is per thread, so each worker enters it) and ``.compile()``d by the target's
real compiler; the result becomes the program's report entry
(:func:`jaxflow.compile_only.report.program_entry`), with the kernels whose ``auto`` dispatch
fell back to XLA while the program was traced (``pallas_kernels.dispatch.recording_fallbacks``).

jax's persistent compilation cache (``jax_compilation_cache_dir``) is switched on for the
compiles (:func:`persistent_cache`). With jax 0.10.2 it does not help deviceless targets: the
TPU and GPU executables are written, but reading one back fails ("PjRtCompiler must be
constructed with a Client to call DeserializeLoadedExecutable"; jax warns and compiles
again). The report counts hits, misses and such unreadable entries, so a jax that can read
them shows it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import time
import warnings

import jax

from jaxflow.compile_only import hlo as hlo_lib
from jaxflow.compile_only.report import Memory, cost_of, program_entry
from pallas_kernels import dispatch, targets

#: Compiles at a time by default (each holds one core and host memory: an 8B-class training
#: step for 64 TPU chips up to ~10 GiB, so two of them fit a 24 GiB host only just).
MAX_PARALLEL = 2
#: Environment variable overriding :data:`MAX_PARALLEL` (e.g. 1 on a small host).
WORKERS_ENV = "JAXFLOW_COMPILE_WORKERS"


def parallel_compiles() -> int:
    """Compiles at a time: ``$JAXFLOW_COMPILE_WORKERS`` (an integer >= 1), else
    :data:`MAX_PARALLEL`.

    Raises:
      ValueError: the variable is set to something else (names it and what is valid).
    """
    text = os.environ.get(WORKERS_ENV, "").strip()
    if not text:
        return MAX_PARALLEL
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{WORKERS_ENV}={text!r}; valid: an integer >= 1 (compiles at a time)")
    return int(text)
CACHE_ENV = "JAXFLOW_COMPILATION_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "jaxflow", "xla")
_UNREADABLE = "Error reading persistent compilation cache entry"


def cache_dir() -> str:
    """``$JAXFLOW_COMPILATION_CACHE``, else ``~/.cache/jaxflow/xla`` (user expanded)."""
    return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


@contextlib.contextmanager
def persistent_cache(path: str):
    """jax's persistent compilation cache in ``path`` while the block runs (the previous
    setting restored after); yields a Counter of jax's ``/jax/compilation_cache/*`` events
    (``cache_hits``, ``cache_misses``, ...)."""
    from jax.experimental.compilation_cache import compilation_cache

    events: collections.Counter = collections.Counter()

    def listen(event: str, **_):
        if event.startswith("/jax/compilation_cache/"):
            events[event.rsplit("/", 1)[-1]] += 1

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()  # a cache checked earlier in this process re-reads the dir
    jax.monitoring.register_event_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def _error_text(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: " + " ".join(lines[:4])[:2000] if lines else type(err).__name__


def compile_program(program, chip: targets.Chip) -> dict:
    """Lowers and compiles ``program`` for ``chip`` and returns its report entry; a compile
    the compiler refuses is an entry with ``status`` "does_not_fit" (RESOURCE_EXHAUSTED: HBM)
    or "failed", never an exception."""
    if program.compiled is not None:  # compiled ahead (program.compile_ahead)
        return _entry_of(program, chip, program.compiled, program.seconds, program.fallbacks)
    start = time.perf_counter()
    lowered_at = None
    fallbacks: list[dict] = []
    try:
        with jax.set_mesh(program.mesh), dispatch.recording_fallbacks() as fallbacks:
            lowered = program.fn.lower(*program.args, **program.kwargs)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
    except Exception as err:  # noqa: BLE001 - the compiler's refusal is the result
        now = time.perf_counter()
        seconds = {"lower": (lowered_at or now) - start,
                   "compile": now - lowered_at if lowered_at else 0.0}
        text = _error_text(err)
        kind = targets.error_kind(str(err)) if lowered_at else "lowering"
        return program_entry(program, chip, error=text, error_kind=kind, seconds=seconds,
                             fallbacks=fallbacks)
    done = time.perf_counter()
    return _entry_of(program, chip, compiled,
                     {"lower": lowered_at - start, "compile": done - lowered_at}, fallbacks)


def _entry_of(program, chip: targets.Chip, compiled, seconds: dict, fallbacks) -> dict:
    return program_entry(program, chip, memory=Memory.of(compiled), cost=cost_of(compiled),
                         hlo=hlo_lib.summarize(compiled.as_text()), seconds=seconds,
                         fallbacks=fallbacks)


def compile_all(programs, chip: targets.Chip, *, workers: int | None = None
                ) -> tuple[list[dict], list[str], int]:
    """Every program compiled, ``workers`` (default :func:`parallel_compiles`) at a time:
    (entries in program order, the warnings raised meanwhile as text, how many of them were
    unreadable persistent-cache entries - those are counted, not listed)."""
    workers = parallel_compiles() if workers is None else workers
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=_UNREADABLE)  # each one counted
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            entries = list(pool.map(lambda p: compile_program(p, chip), programs))
    notes, unreadable = [], 0
    for w in caught:
        text = " ".join(str(w.message).split())
        if text.startswith(_UNREADABLE):
            unreadable += 1
        else:
            notes.append(f"{w.category.__name__}: {text[:500]}")
    return entries, list(dict.fromkeys(notes)), unreadable
