"""The ``flexmarl_scale`` experiment's figures: the cluster simulator's node sweep
(:func:`jaxflow.marl.simulate.run_scale`) tabulated as speedups and utilisation beside the
FlexMARL paper's headline figures, the sensitivity to each measured cost, and one plot.

:func:`scale_summary` is the experiment's summary (keys per node count, as strings);
:func:`paper_checks` compares the best predicted figures with the paper's (neither enters the
fit); :func:`sensitivity` scales one measured cost at a time; :func:`plot_scale` draws the
speedup and utilisation curves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jaxflow.marl.simulate import COST_KEYS, run_scale
from jaxflow.study.headline import paper_check, paper_check_line

__all__ = ["PAPER", "paper_checks", "sensitivity", "scale_summary", "plot_scale"]

PAPER = {"speedup": 7.3, "utilisation_ratio": 5.6,
         "source": "FlexMARL, arXiv 2602.09578: up to 7.3x speedup and 5.6x hardware "
                   "utilisation vs existing frameworks (abstract; setup not given in our notes)"}


def paper_checks(speed: dict[str, float], ratio: dict[str, float], rel_tol: float) -> dict:
    """The paper's headline figures (neither enters the fit) against the best the model
    predicts over the node counts ("up to"): ``relative_error`` = predicted / paper - 1, the
    tolerance ``rel_tol`` and ``within_tolerance`` = |relative_error| <= ``rel_tol``."""
    out = {}
    for name, paper, predicted in (("speedup_up_to", PAPER["speedup"], max(speed.values())),
                                   ("utilisation_ratio_up_to", PAPER["utilisation_ratio"],
                                    max(ratio.values()))):
        out[name] = paper_check(paper, predicted, rel_tol)
    return out


def sensitivity(config: Any, measured: Any) -> dict:
    """Each measured per-parameter cost x each of ``config.sensitivity_factors``: the strict
    speedup vs sync and the utilisation ratio at the largest node count (sync and strict only)."""
    top = str(config.nodes[-1])
    out = {}
    for key in COST_KEYS:
        out[key] = {}
        for f in config.sensitivity_factors:
            res = run_scale(dataclasses.replace(config, nodes=(config.nodes[-1],)), measured,
                            cost_scale={key: f}, schedules=("sync", "flexmarl"))
            get = {r["schedule"]: r for r in res["rows"]}
            b, s = get["sync"], get["flexmarl"]
            out[key][f"x{f:g}"] = {
                f"speedup_vs_sync_at_{top}": b["wall_s"] / s["wall_s"],
                f"utilisation_ratio_at_{top}": s["utilisation"]["overall"]
                / b["utilisation"]["overall"],
                f"baseline_samples_per_s_at_{top}": b["samples_per_s"],
                f"samples_per_s_at_{top}": s["samples_per_s"]}
    return out


def scale_summary(config: Any, measured: Any, calibration: dict, log: Callable[[int, dict], Any],
                  info: Callable[[str], Any]) -> dict:
    """The ``flexmarl_scale`` summary: :func:`~jaxflow.marl.simulate.run_scale` of ``config``
    on the ``measured`` costs (:class:`~jaxflow.marl.simulate.MeasuredRun`), per node count
    (keys: strings) the strict schedule's speedup vs sync, both utilisations and their ratio,
    every schedule's speedup (the ablation), samples/s, the :func:`paper_checks`, the
    :func:`sensitivity` and the simulated rows; ``calibration`` is reported as given.
    ``log(nodes, metrics)`` gets one metrics row per node count, ``info`` one line each."""
    out = run_scale(config, measured)
    rows = out["rows"]
    get = {(r["nodes"], r["schedule"]): r for r in rows}
    speed, util, base_util, ratio, ablation = {}, {}, {}, {}, {}
    for nodes in config.nodes:
        b, f = get[(nodes, "sync")], get[(nodes, "flexmarl")]
        k = str(nodes)
        speed[k] = b["wall_s"] / f["wall_s"]
        util[k], base_util[k] = f["utilisation"], b["utilisation"]
        ratio[k] = f["utilisation"]["overall"] / b["utilisation"]["overall"]
        ablation[k] = {r["schedule"]: b["wall_s"] / r["wall_s"] for r in rows
                       if r["nodes"] == nodes and r["schedule"] != "sync"}
        log(nodes, {"speedup_vs_sync": speed[k], "utilisation": util[k]["overall"],
                    "baseline_utilisation": base_util[k]["overall"],
                    "samples_per_s": f["samples_per_s"],
                    "baseline_samples_per_s": b["samples_per_s"]})
        info(f"{nodes:3d} nodes: sync {b['samples_per_s']:8.1f} samples/s util "
             f"{b['utilisation']['overall']:.2f} | flexmarl {f['samples_per_s']:8.1f} "
             f"util {f['utilisation']['overall']:.2f} | speedup {speed[k]:.2f}x")
    checks = paper_checks(speed, ratio, config.validation_rel_tol)
    for name, c in checks.items():
        info(paper_check_line(name, c))
    return {"speedup_vs_sync": speed, "utilisation": util, "baseline_utilisation": base_util,
            "utilisation_ratio": ratio, "ablation_speedup_vs_sync": ablation,
            "samples_per_s": {str(n): get[(n, "flexmarl")]["samples_per_s"]
                              for n in config.nodes},
            "baseline_samples_per_s": {str(n): get[(n, "sync")]["samples_per_s"]
                                       for n in config.nodes},
            "paper": PAPER, "paper_speedup": PAPER["speedup"],
            "paper_utilisation_ratio": PAPER["utilisation_ratio"],
            "costs_s": {n: dataclasses.asdict(c) for n, c in out["costs"].items()},
            "calibration": calibration, "calibrated_costs": out["calibration"],
            "paper_checks": checks,
            "paper_checks_rel_tol": config.validation_rel_tol,
            "sensitivity": {"calibration": sensitivity(config, measured)}, "rows": rows,
            "simulated": "discrete-event model, not a measurement (jaxflow.marl.simulate)"}


def plot_scale(summary: dict, nodes: Sequence[int], path) -> None:
    """Speedup and utilisation vs node count beside the paper's figures (one small PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = [str(n) for n in nodes]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2), dpi=90)
    a1.plot(nodes, [summary["speedup_vs_sync"][n] for n in k], "o-", label="flexmarl strict")
    for name in summary["ablation_speedup_vs_sync"][k[0]]:
        if name.startswith("eta"):
            a1.plot(nodes, [summary["ablation_speedup_vs_sync"][n][name] for n in k], "^:",
                    label=f"bounded {name}")
    a1.axhline(PAPER["speedup"], ls="--", c="gray", label="paper (up to)")
    a1.set(xscale="log", xlabel="nodes", ylabel="speedup vs sync", title="samples/s speedup")
    a2.plot(nodes, [summary["utilisation"][n]["overall"] for n in k], "o-", label="flexmarl")
    a2.plot(nodes, [summary["baseline_utilisation"][n]["overall"] for n in k], "s-",
            label="sync (MARTI-style)")
    a2.set(xscale="log", xlabel="nodes", ylabel="busy fraction", ylim=(0, 1),
           title=f"utilisation (paper: {PAPER['utilisation_ratio']}x)")
    a1.set_ylim(0, max(PAPER["speedup"] * 1.1, a1.get_ylim()[1]))
    for ax in (a1, a2):
        ax.minorticks_off()
        ax.set_xticks(list(nodes), [str(n) for n in nodes])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
