"""Results a reader can trust: recorded runs, and pages rendered from them.

Modules (one idea each):
  jaxflow.results.registry  the code each experiment's figures measure (its measured paths)
  jaxflow.results.machine   the machine a record was measured on (CPU model, ISA flags, cores)
  jaxflow.results.record    a finished run as a small JSON record with a digest
  jaxflow.results.template  hand-written page text whose figures are placeholders
  jaxflow.results.render    the index, the per-experiment pages, the README block, stale marks
  jaxflow.results.check     render every page, or list where pages, records and templates disagree

``python -m jaxflow.results record RUN_DIR | render | --check`` (``__main__``);
``python -m jaxflow.run ... --record`` records at the end of a run.
"""

from jaxflow.results import check, machine, record, registry, render, template
from jaxflow.results.check import record_and_render, render_all, rendered
from jaxflow.results.machine import machine_info, short_name
from jaxflow.results.record import (
    build_record,
    digest_problem,
    mark_start,
    read_records,
    record_digest,
    record_path,
    record_run,
    write_record,
)
from jaxflow.results.registry import MEASURED_PATHS, ResultsError, measured_paths
from jaxflow.results.render import Staleness
from jaxflow.results.template import fill, literal_figures, placeholders

__all__ = [
    "check", "machine", "record", "registry", "render", "template",
    "record_and_render", "render_all", "rendered", "machine_info", "short_name", "build_record", "digest_problem",
    "mark_start", "read_records", "record_digest", "record_path", "record_run", "write_record",
    "MEASURED_PATHS", "ResultsError", "measured_paths", "Staleness", "fill", "literal_figures",
    "placeholders",
]
