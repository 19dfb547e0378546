"""Calibration: the measured stage times and the paper's figures (data files with their
provenance), and the fit of the scale laws to them.

``data/measured_stage_ms.json``: median stage times of ``sync`` in a ``nestpipe`` run on the dev
CPU (a summary.json named by ``calibration`` replaces it, :func:`load_calibration`).
``data/paper_nestpipe.json``: NestPipe's (arXiv 2604.06956) profile of TorchRec's synchronous
step and its 1,536-NPU table.
"""

from __future__ import annotations

import json
import pathlib
from typing import Mapping, Sequence

import numpy as np

from jaxflow.nestpipe.simulate.network import NetworkShape, StageModel, bandwidth_factor


DATA = pathlib.Path(__file__).parent / "data"
HOST_STAGES = ("data", "h2d", "route", "retrieve", "compute", "write_back")


def _read(name: str) -> dict:
    return json.loads((DATA / name).read_text())


_MEASURED = _read("measured_stage_ms.json")
_PAPER = _read("paper_nestpipe.json")["values"]

#: Median stage times (ms) of ``sync`` in the nestpipe quick run (see the data file's provenance);
#: ``patch`` is the intersection patch measured in ``dbp``.
MEASURED_STAGE_MS: dict[str, float] = dict(_MEASURED["values"])
MEASURED_SOURCE: str = _MEASURED["provenance"]["source"]

#: The paper's profile of TorchRec's synchronous step (shares of the step at 128 and 1,536).
PAPER_WORKERS: tuple[int, int] = tuple(_PAPER["workers"])
PAPER_SHARES: dict[str, tuple[float, float]] = {k: tuple(v) for k, v in _PAPER["shares"].items()}
PAPER_BASELINE_EFFICIENCY: float = _PAPER["baseline_efficiency"]
#: NestPipe, 1,536 NPUs: step ms, speedup vs TorchRec, scaling efficiency.
PAPER_TABLE: dict[str, dict[str, float]] = _PAPER["table"]
PAPER_NESTPIPE_EXPOSED_MS: dict[str, tuple[float, float]] = {
    k: tuple(v) for k, v in _PAPER["nestpipe_exposed_ms"].items()}


def load_calibration(calibration: str) -> tuple[dict[str, float], str]:
    """Measured stage times in ms: the built-in table ("") or a nestpipe summary.json / run dir."""
    if not calibration:
        return dict(MEASURED_STAGE_MS), MEASURED_SOURCE
    path = pathlib.Path(calibration)
    path = path / "summary.json" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"calibration={calibration!r}: no nestpipe summary.json there; "
                                "use '' for the built-in table or a runs/nestpipe/<run> directory")
    stages = json.loads(path.read_text()).get("stage_seconds", {})
    if "sync" not in stages:
        raise ValueError(f"calibration={calibration!r}: summary.json has no stage_seconds.sync "
                         "(is it a nestpipe run?)")
    ms = {k: 1e3 * float(stages["sync"][k]) for k in HOST_STAGES}
    ms["patch"] = 1e3 * float(stages.get("dbp", {}).get("patch", MEASURED_STAGE_MS["patch"] / 1e3))
    return ms, str(path)


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
    missing = [k for k in MEASURED_STAGE_MS if k not in measured_ms or measured_ms[k] < 0]
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
