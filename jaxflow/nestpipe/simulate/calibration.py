"""Calibration: the measured stage times (a data file written by a ``nestpipe`` run, with its
provenance), the paper's figures, and the fit of the scale laws to them.

``data/nestpipe_quick.json``: median stage times of ``sync`` (and dbp's patch) in a ``nestpipe``
quick run, written by that run itself::

    python -m jaxflow.run --exp=nestpipe --variant=quick \
        --set calibration_out=jaxflow/nestpipe/simulate/data/nestpipe_quick.json

Its ``provenance`` holds the git commit, the command, the (fake) device count, the date and the
machine's load; :func:`load_calibration` also reads any file written that way, or a nestpipe run
directory / summary.json. :func:`calibration_summary` is what a simulator's summary reports under
``calibration`` and warns when the measured code changed since the recorded commit.
``data/paper_nestpipe.json``: NestPipe's (arXiv 2604.06956) profile of TorchRec's synchronous
step and its 1,536-NPU table (copied from the paper, not measured).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Mapping, Sequence

import numpy as np

from jaxflow import provenance
from jaxflow.nestpipe.simulate.network import NetworkShape, StageModel, bandwidth_factor

DATA = pathlib.Path(__file__).parent / "data"
#: The calibration the simulator reads unless told otherwise.
DEFAULT_CALIBRATION = DATA / "nestpipe_quick.json"
HOST_STAGES = ("data", "h2d", "route", "retrieve", "compute", "write_back")
#: The measured inputs of :func:`calibrate` (ms per step).
STAGE_KEYS = HOST_STAGES + ("patch",)
#: The code a calibration measures (git pathspecs, relative to the repository root).
MEASURED_PATHS = ("jaxflow/nestpipe", ":(exclude)jaxflow/nestpipe/simulate", "jaxflow/embeddings",
                  "jaxflow/recsys", "jaxflow/main/nestpipe.py", "configs/nestpipe.py")


CalibrationWarning = provenance.CalibrationWarning


_PAPER = json.loads((DATA / "paper_nestpipe.json").read_text())["values"]

#: The paper's profile of TorchRec's synchronous step (shares of the step at 128 and 1,536).
PAPER_WORKERS: tuple[int, int] = tuple(_PAPER["workers"])
PAPER_SHARES: dict[str, tuple[float, float]] = {k: tuple(v) for k, v in _PAPER["shares"].items()}
PAPER_BASELINE_EFFICIENCY: float = _PAPER["baseline_efficiency"]
#: NestPipe, 1,536 NPUs: step ms, speedup vs TorchRec, scaling efficiency.
PAPER_TABLE: dict[str, dict[str, float]] = _PAPER["table"]
PAPER_NESTPIPE_EXPOSED_MS: dict[str, tuple[float, float]] = {
    k: tuple(v) for k, v in _PAPER["nestpipe_exposed_ms"].items()}
#: Ablations (fractions): DBP alone removes ~98% of lookup latency; without clustering, a
#: frozen window of 16 micro-batches leaves 25.2% of the communication exposed.
PAPER_ABLATIONS: dict[str, float] = _PAPER["ablations"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured stage times (ms per step, :data:`STAGE_KEYS`), where they come from
    (``provenance``: git_commit, command, devices, date, machine, measured_paths) and what else
    the run measured (``context``: step times, rows per step, throughput; not fitted)."""

    stage_ms: dict
    provenance: dict
    path: str
    context: dict = dataclasses.field(default_factory=dict)

    def scaled(self, stage: str, factor: float) -> dict:
        """``stage_ms`` with one stage multiplied by ``factor`` (for the sensitivity)."""
        if stage not in self.stage_ms:
            raise ValueError(f"stage={stage!r}; valid: {', '.join(self.stage_ms)}")
        return dict(self.stage_ms, **{stage: self.stage_ms[stage] * factor})


def calibration_from_summary(summary: Mapping) -> tuple[dict, dict]:
    """(stage ms, context) from a ``nestpipe`` summary: ``stage_seconds.sync`` medians, the patch
    from ``stage_seconds.dbp``; step times, distinct rows per owner, patched rows, throughput."""
    stages = summary.get("stage_seconds", {})
    if "sync" not in stages:
        raise ValueError("the summary has no stage_seconds.sync (is it a nestpipe run?)")
    ms = {k: 1e3 * float(stages["sync"][k]) for k in HOST_STAGES}
    ms["patch"] = 1e3 * float(stages.get("dbp", {}).get("patch", 0.0))
    cfg = summary.get("config", {})
    steps = summary.get("step_seconds", {})
    owner = summary.get("owner_rows_per_step", {}).get("sync")
    context = {
        "exchange_ms": 1e3 * float(stages["sync"].get("exchange", 0.0)),
        "step_ms": {p: 1e3 * float(s) for p, s in steps.items()},
        "speedup_vs_sync": dict(summary.get("speedup_vs_sync", {})),
        "owner_rows_per_step": ([float(x) for x in owner] if owner else None),
        "patched_rows_per_step": summary.get("patched_rows_per_step", {}).get("dbp"),
        "batch_size": cfg.get("batch_size"), "multi_hot": cfg.get("multi_hot"),
        "embed_dim": cfg.get("embed_dim"), "tables": len(cfg.get("vocab_sizes", ())) or None,
        "micro_batches": summary.get("micro_batches", cfg.get("micro_batches")),
    }
    if cfg.get("batch_size") and steps.get("sync"):
        context["sync_samples_per_s"] = float(cfg["batch_size"]) / float(steps["sync"])
    return ms, context


def write_calibration(path: str | pathlib.Path, summary: Mapping, prov: Mapping) -> str:
    """Writes the calibration file of a ``nestpipe`` summary with provenance ``prov``
    (:func:`jaxflow.provenance.run_provenance`); returns the path written."""
    ms, context = calibration_from_summary(summary)
    return provenance.write_record(
        path, what="median stage times (ms per step) of the sync pipeline of a nestpipe run; "
                   "patch = the dual-buffer intersection patch measured in dbp",
        provenance=prov, values=ms, context=context)


#: The ``nestpipe`` driver's ``calibration_out``, ``(path, summary, *, experiment, variant,
#: devices) -> path written``: :func:`jaxflow.provenance.write_calibration_from_run` with
#: :func:`write_calibration` and :data:`MEASURED_PATHS` (the provenance of this process now).
write_calibration_from_run = functools.partial(provenance.write_calibration_from_run,
                                               write_calibration, measured_paths=MEASURED_PATHS)


def load_calibration(calibration: str | pathlib.Path = "") -> Calibration:
    """A calibration: "" = :data:`DEFAULT_CALIBRATION`; a file written by
    :func:`write_calibration`; or a nestpipe run directory / summary.json (its provenance is
    the summary's own git_commit, argv and device_count)."""
    path, record = provenance.read_record(calibration, DEFAULT_CALIBRATION, "nestpipe")
    if provenance.is_record(record):
        missing = [k for k in STAGE_KEYS if k not in record["values"]]
        if missing:
            raise ValueError(f"calibration={str(path)!r}: values lack {missing}")
        return Calibration({k: float(record["values"][k]) for k in STAGE_KEYS},
                           dict(record["provenance"]), provenance.display_path(path),
                           dict(record.get("context", {})))
    try:
        ms, context = calibration_from_summary(record)
    except ValueError as e:
        raise ValueError(f"calibration={str(path)!r}: {e}") from None
    return Calibration(ms, provenance.summary_provenance(record, MEASURED_PATHS),
                       provenance.display_path(path), context)


def calibration_summary(cal: Calibration, root: pathlib.Path = provenance.REPO_ROOT) -> dict:
    """What a simulator's summary reports under ``calibration``
    (:func:`jaxflow.provenance.calibration_report` and the stage times); warns
    (CalibrationWarning) when the measured code changed since the recorded commit or that
    cannot be checked."""
    return (provenance.calibration_report(cal.provenance, cal.path, MEASURED_PATHS, root)
            | {"stage_ms": dict(cal.stage_ms)})


def calibrate(measured_ms: Mapping[str, float], *, shares: Mapping[str, Sequence[float]] = PAPER_SHARES,
              workers: Sequence[int] = PAPER_WORKERS, shape: NetworkShape = NetworkShape(),
              device_copy_speedup: float = 20.0, peer_latency_us: float = 10.0,
              step_ms_at_n1: float = PAPER_TABLE["TorchRec (sync)"]["step_ms"]) -> StageModel:
    """Fits the scale laws to the lookup / All2All shares at ``workers = (N0, N1)``.

    ``measured_ms`` only splits the groups (rest into data / h2d / compute / write back, lookup
    into route / retrieve) and sets the patch: measured patch / retrieve on this CPU divided by
    ``device_copy_speedup`` (on an accelerator the patch is a device-to-device copy at HBM
    bandwidth, the retrieval a host gather over PCIe; on the CPU both are host memory).
    """
    n0, n1 = (int(w) for w in workers)
    if not 1 <= n0 < n1:
        raise ValueError(f"workers={tuple(workers)}: need 1 <= N0 < N1")
    (l0, l1), (a0, a1) = shares["lookup"], shares["all2all"]
    for name, (s, a) in (("N0", (l0, a0)), ("N1", (l1, a1))):
        if not (0 <= s and 0 <= a and s + a < 1):
            raise ValueError(f"shares at {name}: lookup={s}, all2all={a}; need >= 0 and sum < 1")
    if device_copy_speedup <= 0:
        raise ValueError(f"device_copy_speedup={device_copy_speedup}; need > 0")
    if peer_latency_us < 0 or step_ms_at_n1 <= 0:
        raise ValueError(f"peer_latency_us={peer_latency_us} (need >= 0), step_ms_at_n1="
                         f"{step_ms_at_n1} (need > 0)")
    missing = [k for k in STAGE_KEYS if k not in measured_ms or measured_ms[k] < 0]
    if missing:
        raise ValueError(f"measured stage times lack or have negative {missing}")
    rest0 = 1.0 - l0 - a0
    rest_ms = sum(measured_ms[k] for k in ("data", "h2d", "compute", "write_back"))
    lookup_ms = measured_ms["route"] + measured_ms["retrieve"]
    if rest_ms <= 0 or lookup_ms <= 0:
        raise ValueError(f"measured stage times {dict(measured_ms)}: need positive rest and lookup")
    part = {k: rest0 * measured_ms[k] / rest_ms for k in ("data", "h2d", "compute", "write_back")}
    route, retrieve = (l0 * measured_ms[k] / lookup_ms for k in ("route", "retrieve"))
    # The rest keeps its mean cost under weak scaling, so the N1 shares give absolute costs.
    lookup1 = rest0 * l1 / (1.0 - l1 - a1)
    a2a1 = rest0 * a1 / (1.0 - l1 - a1)
    per_peer = (lookup1 - l0) / (n1 - n0)
    if l0 - per_peer * (n0 - 1) < 0:
        raise ValueError(f"lookup shares {l0} -> {l1} imply a negative lookup cost at 1 worker")
    unit_ms = step_ms_at_n1 / (rest0 / (1.0 - l1 - a1))
    lam = peer_latency_us * 1e-3 / unit_ms
    # per direction: lam (N - 1) + gamma (N - 1) + beta phi(N) = All2All(N) / 2 at N0 and N1
    lhs = np.array([[n0 - 1, bandwidth_factor(n0, shape)], [n1 - 1, bandwidth_factor(n1, shape)]])
    rhs = np.array([a0 / 2 - lam * (n0 - 1), a2a1 / 2 - lam * (n1 - 1)])
    gamma, beta = np.linalg.solve(lhs, rhs)
    if gamma < -1e-12 or beta < -1e-12:
        raise ValueError(f"All2All shares {a0} -> {a1} with {shape} and peer_latency_us="
                         f"{peer_latency_us} need congestion={gamma:.3g}, bandwidth={beta:.3g} < 0: "
                         "this latency or network shape alone grows the All2All faster than the "
                         "shares; lower oversubscription / peer_latency_us")
    patch = retrieve * measured_ms["patch"] / measured_ms["retrieve"] / device_copy_speedup
    return StageModel(n0=n0, route=route, retrieve=retrieve, patch=patch,
                      lookup_per_peer=per_peer, a2a_latency=lam, a2a_congestion=max(gamma, 0.0),
                      a2a_bandwidth=max(beta, 0.0), shape=shape, unit_ms=unit_ms, **part)


def fold_rest_into_compute(measured_ms: Mapping[str, float]) -> dict[str, float]:
    """Data, h2d and write back counted as accelerator compute (none of the rest overlappable)."""
    rest = sum(measured_ms[k] for k in ("data", "h2d", "compute", "write_back"))
    return dict(measured_ms, data=0.0, h2d=0.0, write_back=0.0, compute=rest)
