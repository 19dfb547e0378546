"""The arm side of ``bench_peers``' protocol, standard library only: a peer's harness script
(run by the peer's own interpreter, which has no jaxflow) imports it from its own folder.

Lines on stdin, one JSON object each; replies on stdout as ``@@arm <json>`` lines (anything
else a library prints goes to stderr, and the harness ignores unprefixed lines):
  1. ``{"case": {...}}`` -> the arm builds the case, runs its warm-up steps and replies
     ``{"ready": true, "info": {...}}`` (``info["first_loss"]`` etc.), or ``{"error": "..."}``.
  2. ``{"round": i, "steps": n}`` -> ``n`` timed steps: ``{"round": i, "wall_s", "cpu_s"
     (this process's user + system seconds, every thread), "steps", "units" (samples or tokens
     the steps did), "unit", "max_rss_bytes" (peak resident memory of the process), "last"
     (the last step's own figures, e.g. its loss)}``.
  3. ``{"stop": true}`` -> the arm exits 0.
Arrays travel as raw little-endian files named in the case (``{"path", "dtype", "shape"}``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import traceback

__all__ = ["PREFIX", "encode", "decode", "read_raw", "serve"]

#: every protocol line on stdout starts with this
PREFIX = "@@arm "


def encode(message: dict) -> str:
    """One protocol line (with its newline) carrying ``message``."""
    return PREFIX + json.dumps(message) + "\n"


def decode(line: str) -> dict | None:
    """The message of a protocol line, or None for any other line (a library's print)."""
    if not line.startswith(PREFIX):
        return None
    return json.loads(line[len(PREFIX):])


def read_raw(spec: dict) -> tuple[bytes, str, tuple[int, ...]]:
    """(bytes, dtype name, shape) of an array file the case names: ``{"path", "dtype", "shape"}``."""
    with open(spec["path"], "rb") as f:
        data = f.read()
    return data, spec["dtype"], tuple(spec["shape"])


def serve(setup, stdin=None, stdout=None) -> int:
    """Runs the protocol: ``setup(case) -> (step, info)`` builds the case and warms up;
    ``step() -> {"units": float, ...}`` runs one complete step (results ready) and returns its
    own figures. Returns the exit status (1 when setup failed, after replying the error)."""
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not interleave with the protocol

    def send(message):
        out.write(encode(message))
        out.flush()

    try:
        case = json.loads(stdin.readline())["case"]
        step, info = setup(case)
    except Exception as e:  # the harness reports it as "could not run"; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        send({"error": f"{type(e).__name__}: {e}".splitlines()[0][:400]})
        return 1
    send({"ready": True, "info": info})
    for line in stdin:
        message = json.loads(line)
        if message.get("stop"):
            break
        n = int(message["steps"])
        units, last = 0.0, {}
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            last = step()
            units += float(last["units"])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        send({"round": message["round"], "wall_s": wall, "cpu_s": cpu, "steps": n, "units": units,
              "unit": last.get("unit", "samples"), "max_rss_bytes": rss,
              "last": {k: v for k, v in last.items() if k not in ("units", "unit")}})
    return 0
