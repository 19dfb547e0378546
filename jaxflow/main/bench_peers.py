"""The ``bench_peers`` experiment: jaxflow and its peers on the same work, alternated rounds.

Every case's arms (``jaxflow.bench.peers.cases``) start as processes of their own, build the
work from the same array files, warm up, then take turns for ``rounds`` rounds of ``steps``
steps (forward order in even rounds, reversed in odd ones). Per case: each arm's rate, CPU
seconds per unit and peak memory, and per peer arm the paired wall / throughput / CPU ratios
with their range over the rounds; the load average before and after; the arms that could not
run and why. ``headlines``: per case, jaxflow's rate over the strongest peer arm's.
"""

from __future__ import annotations

import os
import tempfile

from jaxflow.bench.peers.cases import build_cases, headlines, logits_check, summarize_case
from jaxflow.bench.peers.harness import run_alternated
from jaxflow.experiment import RunContext

__all__ = ["main"]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _line(name: str, case: dict) -> str:
    parts = []
    for arm, r in case["ratios"].items():
        t, c = r["throughput"], r["cpu"]
        parts.append(f"vs {arm}: {t['median']:.3g}x {case['arms']['jaxflow']['unit']}/s "
                     f"[{t['low']:.3g}, {t['high']:.3g}], CPU {c['median']:.3g}x [{c['low']:.3g}, {c['high']:.3g}]")
    return f"{name}: " + ("; ".join(parts) or "no jaxflow-peer pair measured")


def main(config, run: RunContext) -> dict:
    """Runs every case of ``config.cases``; the summary keys are the module docstring's."""
    peers = config.peers
    pythons = {"torchrec": peers.torchrec_python, "tunix": peers.tunix_python, "trl": peers.trl_python}
    load_before = _load()
    cases, not_run = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as work:
        specs, skipped = build_cases(config, work, pythons)
        for name, arms in specs.items():
            log_dir = os.path.join(str(run.out_dir), "arms", name) if run.is_primary else work
            os.makedirs(log_dir, exist_ok=True)
            run.info(f"{name}: arms {', '.join(a.name for a in arms)}; {config.rounds} rounds x {config.steps} steps")

            def on_round(r, replies, name=name):
                run.log(r, {f"{name}/{arm}_{k}": float(v[k]) for arm, v in replies.items()
                            for k in ("wall_s", "cpu_s", "units")})

            results, infos, failed = run_alternated(arms, config.rounds, config.steps, log_dir,
                                                    timeout_s=config.arm_timeout_s, on_round=on_round,
                                                    admit=logits_check(arms))
            cases[name] = summarize_case(results, infos)
            not_run[name] = {**skipped.get(name, {}), **failed}
            run.info(_line(name, cases[name]))
            for arm, reason in not_run[name].items():
                run.info(f"{name}: {arm} not run: {reason}")
    return {"cases": cases, "not_run": {k: v for k, v in not_run.items() if v},
            "rounds": config.rounds, "steps_per_round": config.steps,
            "pairs_note": f"{config.rounds} alternated rounds per arm" + (" (quick: fewer than 10)"
                                                                          if config.rounds < 10 else ""),
            "load_before": load_before, "load_after": _load(), "cpu_count": os.cpu_count(),
            "headlines": headlines(cases)}
