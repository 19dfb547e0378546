"""Study machinery: what every seed study shares, so a driver is config + system + report.

Modules (one idea each):
  grid        seed grids: every setting x seeds (seeds innermost), per-cell seeds
  cells       cell resume: finished cells in ``cells.jsonl``, the loop that skips them, the
              metrics rows a resumed cell logged before its checkpoint
  intervals   paired seed intervals, one-sample seed intervals, means over records, their text
              (over :mod:`jaxflow.stats`)
  timing      a step's wall seconds, the median past the compile; fair side-by-side timing
              (:mod:`jaxflow.timing`)
  warm_start  the warm start as point 0 of every curve and the summary's ``warm_start`` block
  report      ``results.json`` / ``results.md`` beside the ``summary.json`` the runner writes
              from the driver's return value; the headlines added to it (``with_headlines``)
  headline    an experiment's headline figures: ``Headline`` (arm vs the strongest baseline
              measured in the run, spread, target, met), ``strongest_baseline``,
              ``headline_from_arms``, seed / round spreads, stale calibrations, paper checks
  headlines_systems, headlines_rl, headlines_bench
              each experiment's headline builder (``HEADLINES = "jaxflow.study.headlines_rl:figa"``
              in ``configs/<name>.py``): systems (nestpipe, flowtrain, flexmarl, dlrm, the two
              simulators), learning experiments (RL, SIS, FIGA, OxygenREC, DecorateLM, ...), benchmarks

A *cell* is one independent run of a study (a setting and a seed) with a unique ``label``; its
*record* is a JSON-able dict (``{"label": ..., ...}``) appended to ``cells.jsonl`` when it
finishes. ``--resume`` skips the finished cells and continues the running one from its
checkpoint (``checkpoints/<label>/``), so a resumed study reports what an uninterrupted one
would.

This package sits below the library packages that run studies (``jaxflow.rl`` and the others
may import it); it imports none of them.

Usage::

    from jaxflow.study import finished_cells, run_cells, paired_by_seed, write_results
    done = finished_cells(run)
    records, _ = run_cells(cells, lambda cell, i: run_one(cell, i), run=run, done=done)
"""

from jaxflow.study import headlines_bench, headlines_rl, headlines_systems
from jaxflow.study.cells import CELLS_FILE, CellsRun, finished_cells, read_cells, record_cell, rows_of_cell, run_cells
from jaxflow.study.grid import cell_seed, seed_grid
from jaxflow.study.headline import (
    Headline,
    HeadlineBuilder,
    Spread,
    finite_arms,
    headline_from_arms,
    headline_from_ratios,
    mark_stale,
    met,
    paper_check,
    paper_check_line,
    range_spread,
    seed_spread,
    strongest_baseline,
)
from jaxflow.study.intervals import (
    PairedInterval,
    format_bounds,
    format_pm,
    mean_of,
    normalized_auc,
    paired_by_seed,
    paired_interval,
    sample_sd,
    seed_interval,
)
from jaxflow.study.report import headline_builder, with_headlines, write_results
from jaxflow.study.timing import choose_mode, median_after_warmup, paired_rounds, timed
from jaxflow.study.warm_start import curve_from_rows, warm_start_report

__all__ = [
    "cells", "grid", "intervals", "report", "timing", "warm_start", "headline",
    "headlines_systems", "headlines_rl", "headlines_bench",
    "seed_grid", "cell_seed",
    "CELLS_FILE", "CellsRun", "finished_cells", "read_cells", "record_cell", "rows_of_cell", "run_cells",
    "PairedInterval", "paired_interval", "paired_by_seed", "seed_interval", "normalized_auc", "mean_of",
    "sample_sd", "format_pm", "format_bounds",
    "timed", "median_after_warmup", "paired_rounds", "choose_mode",
    "curve_from_rows", "warm_start_report",
    "write_results", "headline_builder", "with_headlines",
    "Headline", "HeadlineBuilder", "Spread", "strongest_baseline", "headline_from_arms", "seed_spread",
    "range_spread", "met", "mark_stale", "finite_arms", "paper_check", "paper_check_line",
    "headline_from_ratios",
]
