"""The harness side of ``bench_peers``: arm processes spoken to over
:mod:`jaxflow.bench.peers.arm_protocol`, alternated rounds, per-round ratios with their ranges,
the interpreters that are missing, and the summary's headlines.

Every arm (jaxflow's included) is a process of its own that builds its case once, warms up, and
then runs ``steps`` timed steps per round when asked; round ``r`` visits the arms in the listed
order when ``r`` is even and in reverse when odd, so drift in the machine's load falls on every
arm alike. A pair is one round of the jaxflow arm and one of a peer arm.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import statistics
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxflow.bench.peers.arm_protocol import decode

__all__ = ["ArmSpec", "ArmProcess", "ArmError", "missing_interpreter", "run_alternated", "pair_ratios",
           "ratio_range", "case_headline", "case_cpu_headline"]


class ArmError(RuntimeError):
    """An arm process failed: it exited, replied an error, or did not answer in time."""


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """One arm of a case.

    Attributes:
      name: the arm's id in the summary (``"torchrec_fused"``).
      peer: whose code it runs (``"jaxflow"``, ``"torchrec"``, ``"tunix"``, ``"trl"``).
      command: the argv that starts it (the interpreter, then its harness script or ``-m``).
      case: the JSON case sent as the first message (shapes, array files, steps of warm-up).
    """

    name: str
    peer: str
    command: tuple[str, ...]
    case: Mapping[str, Any]


class ArmProcess:
    """A running arm: :meth:`start` sends the case and waits for ``ready``; :meth:`run_round`
    asks for one round of timed steps; :meth:`stop` ends it. stderr goes to ``log_path``."""

    def __init__(self, spec: ArmSpec, log_path: str, timeout_s: float = 600.0,
                 env: Mapping[str, str] | None = None):
        self.spec, self.log_path, self.timeout_s = spec, log_path, timeout_s
        self.env = dict(os.environ if env is None else env)
        self.info: dict = {}
        self._proc: subprocess.Popen | None = None
        self._messages: queue.Queue = queue.Queue()

    def _read(self):
        for line in self._proc.stdout:
            message = decode(line)
            if message is not None:
                self._messages.put(message)
        self._messages.put(None)  # the process closed its stdout

    def _send(self, message: dict):
        import json

        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def _reply(self) -> dict:
        try:
            message = self._messages.get(timeout=self.timeout_s)
        except queue.Empty:
            raise ArmError(f"arm {self.spec.name} did not answer in {self.timeout_s:.0f} s") from None
        if message is None:
            raise ArmError(f"arm {self.spec.name} exited (status {self._proc.wait()}): {self.stderr_tail()}")
        if "error" in message:
            raise ArmError(f"arm {self.spec.name}: {message['error']}")
        return message

    def stderr_tail(self, lines: int = 3) -> str:
        """The last lines of the arm's stderr log, joined by ' | '."""
        try:
            with open(self.log_path, errors="replace") as f:
                tail = [x.strip() for x in f.read().splitlines() if x.strip()][-lines:]
        except OSError:
            return ""
        return " | ".join(tail)

    def start(self) -> dict:
        """Starts the process, sends the case, returns the arm's ``info`` once it is ready."""
        self._log = open(self.log_path, "w")
        try:
            self._proc = subprocess.Popen(list(self.spec.command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, text=True, env=self.env)
        except OSError as e:
            raise ArmError(f"arm {self.spec.name}: cannot start {self.spec.command[0]}: {e}") from None
        threading.Thread(target=self._read, daemon=True).start()
        self._send({"case": dict(self.spec.case)})
        self.info = self._reply().get("info", {})
        return self.info

    def run_round(self, index: int, steps: int) -> dict:
        """One round of ``steps`` timed steps: the arm's reply (wall_s, cpu_s, units, ...)."""
        self._send({"round": index, "steps": steps})
        return self._reply()

    def stop(self):
        """Asks the arm to exit and waits for it (kills it after 30 s)."""
        if self._proc is None:
            return
        try:
            if self._proc.poll() is None:
                self._send({"stop": True})
            self._proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def missing_interpreter(python: str) -> str | None:
    """Why ``python`` cannot run a peer arm (one line), or None when it is an executable file."""
    if not python:
        return "no interpreter configured"
    if not os.path.isfile(python):
        return f"no interpreter at {python} (bash scripts/peer_venvs.sh creates it)"
    if not os.access(python, os.X_OK):
        return f"{python} is not executable"
    return None


def run_alternated(specs: Sequence[ArmSpec], rounds: int, steps: int, log_dir: str,
                   timeout_s: float = 600.0, on_round: Callable[[int, dict], None] | None = None,
                   env: Mapping[str, str] | None = None,
                   admit: Callable[[dict], Mapping[str, str]] | None = None) -> tuple[dict, dict, dict]:
    """Starts every arm (one after the other), then ``rounds`` rounds of ``steps`` steps each,
    visiting the arms forward in even rounds and backward in odd ones, then stops them.
    ``admit({arm: info})`` runs once every arm is ready, before any timing: it returns
    ``{arm: reason}`` of the arms to leave out (e.g. a model whose logits differ from ours).

    Returns ``(results, infos, not_run)``: ``{arm: [round reply, ...]}`` and ``{arm: info}`` of
    the arms that ran every round, ``{arm: reason}`` of those that failed to start or mid-way
    (a failed arm is stopped and left out; the others go on). ``on_round(r, {arm: reply})``
    is called after each round."""
    live: dict[str, ArmProcess] = {}
    not_run: dict[str, str] = {}
    try:
        for spec in specs:
            arm = ArmProcess(spec, os.path.join(log_dir, f"arm_{spec.name}.log"), timeout_s, env)
            try:
                arm.start()
                live[spec.name] = arm
            except ArmError as e:
                not_run[spec.name] = str(e)
                arm.stop()
        for name, reason in (admit({k: a.info for k, a in live.items()}) if admit else {}).items():
            not_run[name] = reason
            live.pop(name).stop()
        results: dict[str, list] = {name: [] for name in live}
        for r in range(rounds):
            order = list(live) if r % 2 == 0 else list(reversed(live))
            replies = {}
            for name in order:
                try:
                    replies[name] = live[name].run_round(r, steps)
                except ArmError as e:
                    not_run[name] = f"failed in round {r}: {e}"
                    live.pop(name).stop()
                    results.pop(name)
            for name, reply in replies.items():
                if name in results:
                    results[name].append(reply)
            if on_round is not None:
                on_round(r, {k: v for k, v in replies.items() if k in results})
        return results, {k: a.info for k, a in live.items()}, not_run
    finally:
        for arm in live.values():
            arm.stop()


def ratio_range(values: Sequence[float]) -> dict:
    """``{"median", "low", "high", "n"}`` of per-pair ratios."""
    return {"median": float(statistics.median(values)), "low": float(min(values)), "high": float(max(values)),
            "n": len(values)}


def pair_ratios(ours: Sequence[Mapping], theirs: Sequence[Mapping]) -> dict:
    """Per-round ratios of two arms' replies on the same work, paired by round: ``throughput``
    (our units/s over theirs: > 1 is faster), ``wall`` (our wall seconds per unit over theirs:
    < 1 is faster) and ``cpu`` (our CPU seconds per unit over theirs: < 1 uses less CPU), each
    as :func:`ratio_range`."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"pair_ratios: {len(ours)} rounds against {len(theirs)}; valid: the same number, >= 1")
    thr = [(a["units"] / a["wall_s"]) / (b["units"] / b["wall_s"]) for a, b in zip(ours, theirs)]
    cpu = [(a["cpu_s"] / a["units"]) / (b["cpu_s"] / b["units"]) for a, b in zip(ours, theirs)]
    return {"throughput": ratio_range(thr), "wall": ratio_range([1.0 / t for t in thr]), "cpu": ratio_range(cpu)}


def case_headline(case: str, metric: str, ours: str, rates: Mapping[str, float], ratios: Mapping[str, dict],
                  target: float = 1.0) -> dict | None:
    """The case's headline in the shared schema: our arm's rate over the strongest peer arm's
    (the highest median rate among the peer arms measured), with the range of the alternated
    pairs; None when no peer arm ran."""
    peers = {k: v for k, v in rates.items() if k != ours}
    if ours not in rates or not peers:
        return None
    best = max(peers, key=lambda k: peers[k])
    r = ratios[best]["throughput"]
    return {"name": f"{case}_vs_strongest_peer", "metric": metric, "algorithm": ours, "baseline": best,
            "baseline_rule": f"highest median {metric.split(' ratio')[0]} of the peer arms measured in this run: "
                             + ", ".join(peers),
            "baselines": {k: float(v) for k, v in peers.items()}, "value": r["median"], "unit": "x",
            "higher_is_better": True,
            "spread": {"kind": "pairs", "n": r["n"], "low": r["low"], "high": r["high"],
                       "interval": "range of alternated pairs"},
            "target": target, "target_text": f">= {target:g}x the strongest peer", "met": bool(r["median"] >= target)}


def case_cpu_headline(case: str, unit: str, ours: str, cpu_per_unit: Mapping[str, float], ratios: Mapping[str, dict],
                      baseline: str, target: float = 1.0) -> dict:
    """The case's CPU headline in the shared schema: our CPU seconds per ``unit`` over
    ``baseline``'s (the peer arm of :func:`case_headline`; lower is better), with the range of
    the alternated pairs."""
    r = ratios[baseline]["cpu"]
    peers = {k: float(v) for k, v in cpu_per_unit.items() if k != ours}
    return {"name": f"{case}_cpu_vs_strongest_peer", "metric": f"CPU seconds per {unit} ratio (jaxflow / peer)",
            "algorithm": ours, "baseline": baseline,
            "baseline_rule": "the peer arm of the throughput headline (highest median rate of the peer arms measured "
                             "in this run: " + ", ".join(peers) + ")",
            "baselines": peers, "value": r["median"], "unit": "x", "higher_is_better": False,
            "spread": {"kind": "pairs", "n": r["n"], "low": r["low"], "high": r["high"],
                       "interval": "range of alternated pairs"},
            "target": target, "target_text": f"<= {target:g}x the peer's CPU seconds",
            "met": bool(r["median"] <= target)}
