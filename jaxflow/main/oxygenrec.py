"""The ``oxygenrec`` experiment: OxygenREC vs TIGER-style (with and without the instruction),
SASRec-style and popularity, with ablations, Recall@K / NDCG@K per scenario over the full item
set, several seeds.

Each seed is one cell (:func:`jaxflow.study.run_cells`: ``--resume`` skips the seeds that
finished) running :func:`jaxflow.genrec.study.run_seed` (data and semantic IDs, then every
system: the generative arms through :class:`jaxflow.genrec.system.OxygenRECSystem`); the
summary is :func:`jaxflow.genrec.study.summarize_seeds`.
"""

from __future__ import annotations

from jaxflow.experiment import RunContext
from jaxflow.genrec.study import seed_cells, seed_record, summarize_seeds
from jaxflow.study import finished_cells, run_cells


def main(config, run: RunContext) -> dict:
    cells = run_cells(seed_cells(config), lambda cell, _: seed_record(config, cell.seed, run),
                      run=run, done=finished_cells(run))
    return summarize_seeds(config, cells.records)
