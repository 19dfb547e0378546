"""A soak of the two-job flagship: the rollout job is SIGKILLed 30 s after each restart has served
its first rollout, restarted at once, again and again, for at most 20 minutes; then the trainer's
figures are compared with an undisturbed two-job run's.

    python experiments/scripts/soak_two_job.py                          # 300 rollouts, <= 20 min
    python experiments/scripts/soak_two_job.py --rollouts 30 --kill-after 10 --bound 600
    python experiments/scripts/soak_two_job.py --reuse-undisturbed     # the soak again, same reference

What runs (all on 127.0.0.1, one fake CPU device per job, ``JAXFLOW_JOB_SECRET`` set for both
jobs): ``python -m jaxflow.run --exp=flagship --variant=quick`` with small rollouts (4 prompts x
4 samples) as a trainer job (``remote.role=trainer``) and a rollout job (``remote.role=rollout``).
First the undisturbed pair (it also trains the warm start both pairs share through
``cache_root``), then the soaked pair. The soak watches the trainer's ``metrics.jsonl`` (one row
per rollout): once a rollout job (the first, or a restart) has served its first rollout, it waits
``--kill-after`` seconds, SIGKILLs that job and starts a new one on the same address. The trainer
waits up to ``remote.timeout_s`` for a lost job and catches the new one up from a full payload.
When the bound expires, the kill loop stops and the last rollout job is left to finish the run.

The report: each kill (time, rows the trainer had written), whether both trainers exited 0, and
the figures compared: every metrics row's non-timing values and the summary's headline figures.
A difference is printed as ``rollout r: key soaked=... undisturbed=...`` with the restart that
preceded that rollout (the rollout job that served it, the rows already written when it started),
so a difference can be traced to the catch-up after a particular kill. Exit 0 when the trainer
finished and every figure is equal, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: metric names that are timings (they differ run to run); as tests/test_flagship_remote.py
TIMING = ("seconds", "time", "per_s", "deliver", "throughput", "timing_s/", "perf/")
SUMMARY_KEYS = ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "sync_ratio_vs_dense",
                "sync_bit_exact")


def _small(rollouts: int, cache: pathlib.Path) -> list[str]:
    return ["--exp=flagship", "--variant=quick", "--devices=1", "--set", f"rollouts={rollouts}",
            "--set", f"eval.every={rollouts}", "--set", "eval.prompts=16", "--set", "eval.samples=2",
            "--set", "rl.prompts_per_rollout=4", "--set", "rl.group_size=4",
            "--set", "pretrain.train.steps=120", "--set", "pretrain.train.eval_examples=16",
            "--set", f"cache_root={cache}", "--no-tensorboard"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row being written
            break
    return rows


class Pair:
    """A trainer job and its rollout job (restartable), logs under ``root``."""

    def __init__(self, root: pathlib.Path, name: str, small: list[str], timeout_s: float, env: dict):
        self.root, self.name, self.env = root, name, env
        port = _free_port()
        self.rollout_args = [*small, "--set", "remote.role=rollout", "--set", f"remote.listen=127.0.0.1:{port}",
                             "--set", f"remote.timeout_s={timeout_s}"]
        trainer_args = [*small, "--set", "remote.role=trainer", "--set", f"remote.rollout=127.0.0.1:{port}",
                        "--set", f"remote.timeout_s={timeout_s}"]
        self.trainer_dir = root / f"{name}_trainer"
        self.trainer = self._start(trainer_args, self.trainer_dir, "trainer")
        self.incarnation = 0
        self.rollout = self._start(self.rollout_args, root / f"{name}_rollout0", "rollout0")

    @classmethod
    def finished(cls, root: pathlib.Path, name: str) -> "Pair":
        """A pair that ran before (its trainer's rows only)."""
        pair = cls.__new__(cls)
        pair.root, pair.name, pair.trainer_dir = root, name, root / f"{name}_trainer"
        return pair

    def _start(self, args: list[str], out: pathlib.Path, log: str) -> subprocess.Popen:
        with open(self.root / f"{self.name}_{log}.log", "w") as f:
            return subprocess.Popen([sys.executable, "-m", "jaxflow.run", *args, f"--out={out}"],
                                    cwd=ROOT, env=self.env, stdout=f, stderr=subprocess.STDOUT)

    def restart_rollout(self) -> None:
        self.rollout.kill()
        self.rollout.wait()
        self.incarnation += 1
        self.rollout = self._start(self.rollout_args, self.root / f"{self.name}_rollout{self.incarnation}",
                                   f"rollout{self.incarnation}")

    def listening(self) -> bool:
        """The current rollout job has said it listens (its ``rollout process 0: control`` line)."""
        log = self.root / f"{self.name}_rollout{self.incarnation}.log"
        return log.exists() and "rollout process 0: control" in log.read_text(errors="replace")

    def rows(self) -> list[dict]:
        return _rows(self.trainer_dir / "metrics.jsonl")

    def finish(self, timeout_s: float) -> tuple[int | None, int | None]:
        """Waits for the trainer, then up to 60 s for the rollout job (the trainer's DONE ends
        it); kills what is left."""
        deadline = time.monotonic() + timeout_s
        while self.trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        if self.trainer.poll() is None:
            self.trainer.kill()
        try:
            self.rollout.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.rollout.kill()
        return self.trainer.wait(), self.rollout.wait()


def _figures(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def soak(pair: Pair, *, rollouts: int, kill_after_s: float, bound_s: float, log) -> list[dict]:
    """The kill loop; returns the kills: ``{"t": s, "rows": n, "incarnation": i,
    "first_served_row": r}`` (rows: what the trainer had written at the kill). A job is not
    killed once the trainer has all ``rollouts`` rows (it is then finishing the run)."""
    start, kills = time.monotonic(), []
    # The trainer asks for one rollout at a time, so after a kill it writes at most one row of a
    # rollout the killed job had delivered. The new job has served its first rollout once a row
    # is written after it listens and after that row: rows > rows_at_kill + 1, or rows >
    # rows_at_listen when the old row came before the new job listened.
    rows_at_kill, rows_at_listen = -1, None  # (the first job: any row is its own)
    while pair.trainer.poll() is None and time.monotonic() - start < bound_s:
        n = len(pair.rows())
        if rows_at_listen is None and pair.listening():
            rows_at_listen = n
        threshold = None if rows_at_listen is None else (
            rows_at_listen if rows_at_listen > rows_at_kill else rows_at_kill + 1)
        if threshold is not None and n > threshold:  # the current job served its first rollout
            served_at = time.monotonic()
            log(f"  rollout job {pair.incarnation} served its first rollout (trainer rows: {n}); "
                f"killing it in {kill_after_s:g} s")
            while (pair.trainer.poll() is None and time.monotonic() - served_at < kill_after_s
                   and time.monotonic() - start < bound_s):
                time.sleep(0.5)
            if (pair.trainer.poll() is not None or time.monotonic() - start >= bound_s
                    or len(pair.rows()) >= rollouts):
                break
            kills.append({"t": round(time.monotonic() - start, 1), "rows": len(pair.rows()),
                          "incarnation": pair.incarnation, "first_served_row": n})
            log(f"  t={kills[-1]['t']} s: SIGKILL rollout job {pair.incarnation} "
                f"(trainer rows: {kills[-1]['rows']}); restarting it")
            pair.restart_rollout()
            rows_at_kill, rows_at_listen = len(pair.rows()), None
        elif pair.rollout.poll() is not None and pair.trainer.poll() is None:
            log(f"  rollout job {pair.incarnation} exited by itself ({pair.rollout.returncode}); "
                "restarting it")
            pair.restart_rollout()
            rows_at_kill, rows_at_listen = len(pair.rows()), None
        time.sleep(0.5)
    return kills


def compare(soaked: list[dict], undisturbed: list[dict], kills: list[dict]) -> list[str]:
    """Lines naming every differing figure, each traced to the restart before its rollout."""
    lines = []
    a, b = _figures(soaked), _figures(undisturbed)
    if len(a) != len(b):
        lines.append(f"rows: soaked {len(a)}, undisturbed {len(b)}")
    for i, (ra, rb) in enumerate(zip(a, b)):
        keys = sorted(set(ra) | set(rb))
        diff = [k for k in keys if ra.get(k) != rb.get(k)]
        if not diff:
            continue
        before = [k for k in kills if k["rows"] <= i]
        cause = (f"served by rollout job {before[-1]['incarnation'] + 1}, started after the kill at "
                 f"t={before[-1]['t']} s with {before[-1]['rows']} rows written"
                 if before else "served by the first rollout job (before any kill)")
        for k in diff:
            lines.append(f"rollout {i + 1}: {k} soaked={ra.get(k)!r} undisturbed={rb.get(k)!r} ({cause})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=300)
    p.add_argument("--kill-after", type=float, default=30.0, help="seconds after a job's first rollout")
    p.add_argument("--bound", type=float, default=1200.0, help="seconds the kill loop may last")
    p.add_argument("--timeout", type=float, default=300.0, help="remote.timeout_s of both jobs")
    p.add_argument("--out", default=str(ROOT / "runs" / "soak_two_job"))
    p.add_argument("--reuse-undisturbed", action="store_true",
                   help="keep --out's finished undisturbed pair (and warm start); rerun the soak only")
    args = p.parse_args(argv)
    root = pathlib.Path(args.out).resolve()
    reuse = args.reuse_undisturbed and (root / "undisturbed_trainer" / "summary.json").exists()
    if reuse:
        for old in root.glob("soaked_*"):
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
               JAXFLOW_JOB_SECRET=os.urandom(16).hex())
    small = _small(args.rollouts, root / "cache")
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {msg}", flush=True)

    if reuse:
        ref = Pair.finished(root, "undisturbed")
        ref_codes = (0, 0)
        log(f"undisturbed pair: reused from {root}")
    else:
        log(f"undisturbed pair ({args.rollouts} rollouts) -> {root}")
        ref = Pair(root, "undisturbed", small, args.timeout, env)
        ref_codes = ref.finish(timeout_s=args.bound)
    log(f"undisturbed pair: trainer rc={ref_codes[0]}, rollout rc={ref_codes[1]}, rows={len(ref.rows())}")
    log(f"soaked pair: SIGKILL each rollout job {args.kill_after:g} s after its first rollout, "
        f"for at most {args.bound:g} s")
    pair = Pair(root, "soaked", small, args.timeout, env)
    kills = soak(pair, rollouts=args.rollouts, kill_after_s=args.kill_after, bound_s=args.bound, log=log)
    codes = pair.finish(timeout_s=args.timeout + 600)
    log(f"soaked pair: {len(kills)} kill(s); trainer rc={codes[0]}, last rollout job rc={codes[1]}, "
        f"rows={len(pair.rows())}")
    lines = compare(pair.rows(), ref.rows(), kills)
    summaries = []
    for d in (pair.trainer_dir, ref.trainer_dir):
        f = d / "summary.json"
        summaries.append(json.loads(f.read_text()) if f.exists() else {})
    for key in SUMMARY_KEYS:
        if summaries[0].get(key) != summaries[1].get(key):
            lines.append(f"summary {key}: soaked={summaries[0].get(key)!r} "
                         f"undisturbed={summaries[1].get(key)!r}")
    (root / "soak.json").write_text(json.dumps({"kills": kills, "codes": codes, "ref_codes": ref_codes,
                                                "differences": lines}, indent=1))
    ok = codes[0] == 0 and ref_codes[0] == 0 and not lines and ref.rows() != []
    if lines:
        print("differences (soaked vs undisturbed):")
        print("\n".join("  " + line for line in lines))
    print(f"soak: {len(kills)} kill(s), trainer rc={codes[0]}, "
          f"{'figures equal to the undisturbed run' if ok else 'NOT clean'} "
          f"({len(pair.rows())} rows compared; wall {time.monotonic() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
