"""The simulator's predictions beside the paper's figures that did not enter the fit
(``paper_checks``), what each simulated pipeline stands for (``MODELLED_SCHEDULES``), and the
efficiency plot of the ``nestpipe_scale`` experiment."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

from jaxflow.nestpipe.simulate.calibration import (
    PAPER_ABLATIONS,
    PAPER_NESTPIPE_EXPOSED_MS,
    PAPER_TABLE,
)
from jaxflow.study.headline import paper_check

__all__ = ["MODELLED_SCHEDULES", "paper_checks", "plot_efficiency"]

#: what each simulated pipeline is (the ``nestpipe_scale`` summary's ``modelled_schedules``)
MODELLED_SCHEDULES = {
    "sync": "serial stages, batch after batch (TorchRec's synchronous baseline)",
    "dbp": "dual-buffer pipelining: batch t+1's stages 1-4 during batch t, intersection patch",
    "fwp": "the paper's overlapped frozen window: micro-batch i+1's forward All2All issued "
           "before micro-batch i's backward All2All, overlapping compute (nestpipe's fwp, "
           "frozen_exchange=per_micro_batch, with async collectives); nestpipe's sync_accum "
           "(the whole window routed once, sync's collectives) is not modelled",
    "dbp+fwp": "dbp and the overlapped frozen window together (stands for NestPipe)",
    "semi_sync": "dbp without the patch (one step stale)",
}


def paper_checks(eff: Mapping, steps: Mapping, exposed_ms: Mapping, fwp16_exposed_fraction: float,
                 n0: int, n1: int, rel_tol: float) -> dict:
    """Predictions of figures that did not enter the fit, beside the paper's (dbp+fwp stands
    for NestPipe): each with ``relative_error`` = predicted / paper - 1, the tolerance
    ``rel_tol`` and ``within_tolerance`` = |relative_error| <= ``rel_tol`` (reported beside the
    error, never as a bare "passed"). ``eff`` / ``steps``: ``{pipeline: {workers: E or step}}``
    (``efficiency_table``), ``exposed_ms``: ``{pipeline: {"lookup", "all2all": ms at n1}}``;
    a check whose pipeline was not simulated is left out."""
    torchrec, nest = PAPER_TABLE["TorchRec (sync)"], PAPER_TABLE["NestPipe"]
    implied_128 = (torchrec["scaling_efficiency"] * torchrec["step_ms"]) / (
        nest["scaling_efficiency"] * nest["step_ms"])
    lookup_sync = exposed_ms["sync"]["lookup"]
    rows = {  # name -> (paper, prediction); a row whose pipeline was not simulated is left out
        f"nestpipe_speedup_at_{n1}": (nest["speedup"],
                                      lambda: steps["sync"][n1] / steps["dbp+fwp"][n1]),
        f"nestpipe_efficiency_at_{n1}": (nest["scaling_efficiency"], lambda: eff["dbp+fwp"][n1]),
        f"nestpipe_speedup_at_{n0}_implied_by_the_table": (
            implied_128, lambda: steps["sync"][n0] / steps["dbp+fwp"][n0]),
        f"nestpipe_exposed_lookup_ms_at_{n1}": (PAPER_NESTPIPE_EXPOSED_MS["lookup"][1],
                                                lambda: exposed_ms["dbp+fwp"]["lookup"]),
        f"nestpipe_exposed_all2all_ms_at_{n1}": (PAPER_NESTPIPE_EXPOSED_MS["all2all"][1],
                                                 lambda: exposed_ms["dbp+fwp"]["all2all"]),
        "dbp_lookup_removed_fraction": (PAPER_ABLATIONS["dbp_lookup_removed_fraction"],
                                        lambda: 1.0 - exposed_ms["dbp"]["lookup"] / lookup_sync),
        "fwp16_unclustered_exposed_comm_fraction": (
            PAPER_ABLATIONS["fwp16_unclustered_exposed_comm_fraction"],
            lambda: fwp16_exposed_fraction),
    }
    out = {}
    for name, (paper, predict) in rows.items():
        try:
            predicted = predict()
        except KeyError:
            continue
        out[name] = paper_check(paper, predicted, rel_tol)
    return out


def plot_efficiency(path: pathlib.Path, workers: Sequence[int], eff: Mapping,
                    paper_points: Mapping[str, tuple[int, float]]) -> None:
    """A PNG at ``path``: E(N) per pipeline over ``workers`` (``eff``: ``{pipeline: {workers:
    E}}``) and the paper's points (``{label: (workers, E)}``) as stars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for p, by_n in eff.items():
        ax.plot(list(workers), [by_n[int(n)] for n in workers], marker="o", ms=3, lw=1.5, label=p)
    for label, (n, e) in paper_points.items():
        ax.scatter([n], [e], marker="*", s=90, zorder=5, label=f"paper: {label}")
    ax.set_xlabel("workers (weak scaling)")
    ax.set_ylabel("scaling efficiency T(128) / T(N)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("nestpipe_scale: simulated efficiency vs workers", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
