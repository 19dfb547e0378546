"""SIGTERM a run N times at delays spread over [LO, HI] seconds; count the exit codes.

    python experiments/scripts/sigterm_loop.py --exp=nestpipe --n=20 --lo=5 --hi=70

Every stop should end with exit 143 and the runner's one line (a checkpoint and the resume
command, or why there is none); a negative code is a crash (-11: SIGSEGV). Prints one line per
run and the counts as JSON.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exp", default="nestpipe")
    ap.add_argument("--variant", default="quick")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--lo", type=float, default=5.0)
    ap.add_argument("--hi", type=float, default=70.0)
    args, extra = ap.parse_known_args()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    codes: collections.Counter = collections.Counter()
    for i in range(args.n):
        with tempfile.TemporaryDirectory(prefix="sigterm-") as tmp:
            t0 = time.time()
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxflow.run", f"--exp={args.exp}",
                 f"--variant={args.variant}", f"--out={tmp}/run", *extra],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            delay = args.lo + (args.hi - args.lo) * i / max(args.n - 1, 1)
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=600)
            codes[proc.returncode] += 1
            last = (err.strip().splitlines() or [""])[-1]
            print(f"{i} delay {delay:.1f}s rc {proc.returncode} ({time.time() - t0:.1f}s) | "
                  f"{last[-200:]}", flush=True)
    print(json.dumps({"runs": args.n, "exit_codes": {str(k): v for k, v in codes.items()},
                      "crashes": sum(v for k, v in codes.items() if k < 0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
