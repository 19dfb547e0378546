"""A discrete-event simulator of one embedding-heavy training step (NestPipe, the ``nestpipe_scale``
experiment) on 128 -> 1,536 workers for the pipelines sync / semi_sync / dbp / fwp / dbp+fwp.

What is simulated
-----------------
Every worker owns five resources, each serving its queue in issue order like a stream: a pool
of ``host_threads`` CPU threads (data prefetch, retrieval from the host-resident tables, write
back), the host-to-device link, a small "keys" communicator (key routing's All2All), the
network (the All2All of embeddings forward and of gradients backward) and the accelerator
(dense forward/backward + update, the dual-buffer patch). An op starts when its dependencies
have finished and its resource is free; a collective (route, All2All) starts when every worker
has reached it and ends when the slowest worker's part ends, so per-worker variance turns into
straggler waits: op durations are ``mean x lognormal(cv)``, drawn per worker, and a collective
costs the max of N draws. Because every resource serves its queue in issue order (streams,
communicators, a FIFO thread pool), the event queue reduces to issuing ops in program order: an
op's start and end are fixed when it is issued, from its dependencies' ends and its resource's
clock, with no heap. The simulator is vectorised over workers (every worker runs the same
program, so each resource queue has the same order everywhere) and is deterministic given a seed.

Per batch, the stages are: data -> h2d -> route (collective) -> retrieve -> [All2All forward ->
compute -> All2All backward] -> write back. Pipelines (what may overlap):
- ``sync``: all stages one after another, batch after batch (TorchRec's synchronous baseline).
- ``dbp``: batch t+1's data / h2d / route / retrieve run while batch t computes. Two embedding
  buffers: retrieve(t+1) writes the buffer batch t-1 used, so it waits for write_back(t-1) and
  for patch(t) (which reads that buffer); patch(t+1), a device copy of the rows in
  K(B_t) & K(B_t+1) from batch t's freshly updated buffer, runs on the accelerator after batch t's
  update (its backward All2All) and before batch t+1's All2All. data(t+1) waits for
  retrieve(t-1) (a pinned-memory ring of three batches), so prefetch may span two steps.
- ``fwp``: stages serial across batches, but the All2All + compute part is split into
  ``micro_batches`` pieces; the forward All2All of micro-batch i+1 is issued before the backward
  All2All of micro-batch i, so communication overlaps compute. Each piece moves 1/m of the bytes
  (pooled embeddings scale with samples) but pays the full per-call latency.
- ``dbp+fwp``: both. ``semi_sync``: dbp without the patch (one-step-stale rows, not exact).

Stage costs (calibration)
-------------------------
Mean per-worker costs are in "step units": the sum of the mean stage costs of ``sync`` at the
reference scale N0 = 128 is 1. The paper's shares at N0 give lookup (route + retrieve) = s_L0,
All2All (forward + backward) = s_A0 and the rest 1 - s_L0 - s_A0; inside those groups the split
follows this CPU's measured stage times (``MEASURED_STAGE_MS``, from the ``nestpipe`` run, or a
summary.json named by ``calibration``): data : h2d : compute : write_back and route : retrieve.
(``rest_on_accelerator``: count the whole rest as accelerator compute instead; on this CPU data
prep is 34% of the rest, which the pipelines can hide; a large HSTU step is mostly compute.)
Scale laws (weak scaling: the per-worker batch is fixed, so data, h2d, compute, write back and
patch keep their cost):
- lookup(N) = lookup(N0) + c_peer (N - N0)          (per-peer request handling; linear in peers)
- All2All(N) per direction and call = lam (N - 1)  +  [gamma (N - 1) + beta phi(N)] / m:
  a per-peer, per-call latency ``lam`` (set a priori, ``peer_latency_us``; paid by every one of
  fwp's m calls), plus the byte-proportional part (1/m of it per micro-batch): the NIC time
  phi(N) = [(G-1)/r + (min(N,P) - G) + (N - P)+ * o] / N (each worker sends 1/N of its bytes to
  every peer; peers in its node, G per node, at r x the NIC bandwidth, peers in its pod of P at
  the NIC bandwidth, the rest through an o:1 oversubscribed spine, the bisection limit) and a
  congestion term gamma (N - 1) (incast, small messages: effective bandwidth falling with peers).
The free parameters (c_peer; gamma, beta) are solved from the shares at BOTH ends (s_L1, s_A1
at N1 = 1,536) with the rest's mean cost held fixed:
  lookup(N1) = (1 - s_L0 - s_A0) s_L1 / (1 - s_L1 - s_A1), and likewise for All2All.
So the model reproduces the paper's mean stage costs at 128 and 1,536 by construction; the
network shape (G, P, o, r) only decides the scales in between. Step units convert to ms through
the paper's 1,536-worker TorchRec step: the mean-cost sum at N1 is (1 - s_L0 - s_A0) /
(1 - s_L1 - s_A1) units = 5,793.83 ms (no efficiency number enters). The per-call latency
matters for fwp: at lam = 10 us a 1,536-peer call costs ~15 ms; if the paper's All2All growth
were all per-call latency (``peer_latency_us`` ~270), fwp would lose to sync (see sensitivity).

Scaling efficiency and the validation
-------------------------------------
Weak scaling: each worker keeps its batch, so throughput at N is N B / T_p(N) and the
efficiency of pipeline p at N is its throughput per worker relative to N0:
    E_p(N) = [N B / T_p(N)] / [N/N0 x N0 B / T_p(N0)] = T_p(N0) / T_p(N).
Each system is measured against its own 128-worker step: the paper's table satisfies this
(TorchRec 0.4434 x 5,793.83 ms = 2,569 ms at 128; NestPipe 0.9407 x 1,895.98 = 1,784 ms), and
its lookup and All2All times at 1,536 (2,871 and ~1,188 ms) match 49.6% and 20.5% of 5,793.83.
T_p(N) is the simulated steady-state step time (mean spacing of the last batches' completions).

The validation compares E_sync(1536) with TorchRec's 0.4434. What it can and cannot show: with
no variance, a serial step is the sum of the mean costs, and the shares fed in fix that sum's
growth: E = (1 - s_L1 - s_A1) / (1 - s_L0 - s_A0) = 0.299 / 0.664 = 0.450 (reported as
``identity_efficiency``). The simulator's own contribution is everything on top: the step-time
accounting of the serial pipeline, the barriers at every collective, stragglers (the max of N
draws grows with N) and resource contention. So the check fails if the baseline is not serial
(e.g. a pipeline that overlaps lookup), if barriers or stragglers are mis-modelled, or if the
variance is large (cv ~0.3 pulls E below 0.40); it does not test where the share growth comes
from. The out-of-sample quantities are the other pipelines' efficiencies and speedups, and the
exposed lookup / communication of dbp+fwp at 1,536, which the paper reports for NestPipe
(lookup 2,870.99 -> 30.19 ms, exposed communication 1,207.85 -> 154.23 ms, speedup 3.06x).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Mapping, Sequence

import numpy as np

PIPELINES = ("sync", "dbp", "fwp", "dbp+fwp", "semi_sync")
EXACT_PIPELINES = ("sync", "dbp", "fwp", "dbp+fwp")
HOST_STAGES = ("data", "h2d", "route", "retrieve", "compute", "write_back")

#: Median stage times (ms) of ``sync`` in the nestpipe quick run on the dev CPU, 2026-11-30
#: (experiments/README.md, ``## nestpipe``; runs/nestpipe/20261130-083527/summary.json,
#: ``stage_seconds``); ``patch`` is the intersection patch measured in ``dbp`` (2.72 ms).
MEASURED_STAGE_MS = {"data": 7.8, "h2d": 0.5, "route": 2.2, "retrieve": 5.5, "compute": 13.8,
                     "write_back": 0.9, "patch": 2.7}
MEASURED_SOURCE = ("built-in table: experiments/README.md `## nestpipe` (nestpipe quick, dev CPU, "
                   "2026-11-30, run 20261130-083527): sync stage medians; patch from dbp")

#: The paper's profile of TorchRec's synchronous step (shares of the step at 128 and 1,536).
PAPER_WORKERS = (128, 1536)
PAPER_SHARES = {"lookup": (0.244, 0.496), "all2all": (0.092, 0.205)}
PAPER_BASELINE_EFFICIENCY = 0.4434
#: NestPipe (arXiv 2604.06956), 1,536 NPUs: step ms, speedup vs TorchRec, scaling efficiency.
PAPER_TABLE = {
    "TorchRec (sync)": {"step_ms": 5793.83, "speedup": 1.00, "scaling_efficiency": 0.4434},
    "2D sparse parallelism": {"step_ms": 4914.01, "speedup": 1.18, "scaling_efficiency": 0.4932},
    "UniEmb (async prefetch)": {"step_ms": 2919.76, "speedup": 1.98, "scaling_efficiency": 0.6762},
    "NestPipe": {"step_ms": 1895.98, "speedup": 3.06, "scaling_efficiency": 0.9407},
}
PAPER_NESTPIPE_EXPOSED_MS = {"lookup": (2870.99, 30.19), "all2all": (1207.85, 154.23)}


@dataclasses.dataclass(frozen=True)
class NetworkShape:
    """Where an All2All's bytes go: G workers per node, pods of P, an o:1 spine above pods."""

    gpus_per_node: int = 8
    pod_size: int = 256
    oversubscription: float = 2.0
    intra_over_inter_bw: float = 8.0  # node fabric (NVLink / HCCS) vs NIC bandwidth

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.pod_size < self.gpus_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}, pod_size={self.pod_size}: "
                             "need 1 <= gpus_per_node <= pod_size")
        if self.oversubscription < 1 or self.intra_over_inter_bw <= 0:
            raise ValueError(f"oversubscription={self.oversubscription} (need >= 1), "
                             f"intra_over_inter_bw={self.intra_over_inter_bw} (need > 0)")


def bandwidth_factor(n: int, shape: NetworkShape) -> float:
    """phi(N): an All2All's byte time per worker in units of (its bytes / NIC bandwidth)."""
    if n <= 1:
        return 0.0
    g = min(n, shape.gpus_per_node)
    p = min(n, shape.pod_size)
    return ((g - 1) / shape.intra_over_inter_bw + (p - g)
            + max(0, n - p) * shape.oversubscription) / n


@dataclasses.dataclass(frozen=True)
class StageModel:
    """Mean per-worker stage costs as a function of the worker count (step units).

    ``route``, ``retrieve`` etc. are the means at ``n0``; lookup (route + retrieve) grows by
    ``lookup_per_peer`` per added worker; each All2All direction costs
    ``a2a_call`` per call (``a2a_latency * (N - 1)``) plus ``a2a_bytes`` split over the calls
    (``a2a_congestion * (N - 1) + a2a_bandwidth * bandwidth_factor(N)``).
    """

    n0: int
    data: float
    h2d: float
    route: float
    retrieve: float
    compute: float
    write_back: float
    patch: float = 0.0
    lookup_per_peer: float = 0.0
    a2a_latency: float = 0.0
    a2a_congestion: float = 0.0
    a2a_bandwidth: float = 0.0
    shape: NetworkShape = NetworkShape()
    unit_ms: float = 1.0  # milliseconds per step unit

    def costs(self, n: int) -> dict[str, float]:
        lookup0 = self.route + self.retrieve
        scale = (lookup0 + self.lookup_per_peer * (n - self.n0)) / lookup0 if lookup0 > 0 else 1.0
        if scale < 0:
            raise ValueError(f"workers={n}: the lookup law gives a negative cost")
        return {"data": self.data, "h2d": self.h2d, "route": self.route * scale,
                "retrieve": self.retrieve * scale, "compute": self.compute,
                "write_back": self.write_back, "patch": self.patch,
                "a2a_call": self.a2a_latency * max(n - 1, 0),
                "a2a_bytes": (self.a2a_congestion * max(n - 1, 0)
                              + self.a2a_bandwidth * bandwidth_factor(n, self.shape))}

    def mean_shares(self, n: int) -> dict[str, float]:
        """Lookup / All2All / rest as fractions of the serial sum of mean costs (no waits)."""
        c = self.costs(n)
        lookup = c["route"] + c["retrieve"]
        a2a = 2 * (c["a2a_call"] + c["a2a_bytes"])
        rest = c["data"] + c["h2d"] + c["compute"] + c["write_back"]
        total = lookup + a2a + rest
        return {"lookup": lookup / total, "all2all": a2a / total, "rest": rest / total,
                "a2a_call_fraction": c["a2a_call"] / max(c["a2a_call"] + c["a2a_bytes"], 1e-30)}


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


class Cluster:
    """Per-worker resource clocks of N workers, vectorised over workers.

    ``op`` schedules one stage on every worker: start = max(dependencies done, resource free);
    a collective starts when the last worker is ready and ends with its slowest part.
    """

    RESOURCES = ("h2d", "keys", "net", "accel")

    def __init__(self, n: int, *, cv: float, host_threads: int, rng: np.random.Generator):
        self.n, self.cv, self.rng = n, cv, rng
        self.host = np.zeros((n, host_threads))
        self.clock = {r: np.zeros(n) for r in self.RESOURCES}
        self.busy: dict[str, float] = {}
        self._sigma = math.sqrt(math.log1p(cv * cv))

    def _durations(self, mean: float) -> np.ndarray:
        # Always draw, so zeroing one stage's cost leaves every other draw unchanged.
        z = self.rng.standard_normal(self.n)
        if self.cv == 0:
            return np.full(self.n, mean)
        return mean * np.exp(self._sigma * z - 0.5 * self._sigma ** 2)

    def op(self, stage: str, resource: str, mean: float, deps: Sequence[np.ndarray] = (),
           collective: bool = False) -> np.ndarray:
        d = self._durations(mean)
        ready = np.maximum.reduce(list(deps)) if deps else np.zeros(self.n)
        if resource == "host":
            rows = np.arange(self.n)
            k = np.argmin(self.host, axis=1)
            start = np.maximum(ready, self.host[rows, k])
            end = start + d
            self.host[rows, k] = end
        else:
            start = np.maximum(ready, self.clock[resource])
            if collective:
                end = np.full(self.n, start.max() + d.max())
            else:
                end = start + d
            self.clock[resource] = end
        self.busy[stage] = self.busy.get(stage, 0.0) + float(d.mean())
        return end


def _prep(cl: Cluster, c: dict, data_deps, retrieve_deps):
    d = cl.op("data", "host", c["data"], data_deps)
    h = cl.op("h2d", "h2d", c["h2d"], [d])
    r = cl.op("route", "keys", c["route"], [h], collective=True)
    return cl.op("retrieve", "host", c["retrieve"], [r, *retrieve_deps])


def _forward_backward(cl: Cluster, c: dict, ready: np.ndarray, m: int) -> np.ndarray:
    """All2All forward, compute, All2All backward in m micro-batches; returns the update's end."""
    part = c["a2a_call"] + c["a2a_bytes"] / m
    fwd = [cl.op("all2all", "net", part, [ready], collective=True)]
    for i in range(m):
        if i + 1 < m:  # issued before backward(i): it overlaps compute(i)
            fwd.append(cl.op("all2all", "net", part, [ready], collective=True))
        comp = cl.op("compute", "accel", c["compute"] / m, [fwd[i]])
        bwd = cl.op("all2all", "net", part, [comp], collective=True)
    return bwd


def simulate_steps(pipeline: str, costs: Mapping[str, float], n: int, *, batches: int = 16,
                   warmup: int = 4, micro_batches: int = 4, cv: float = 0.05, host_threads: int = 4,
                   seed: int = 0) -> dict:
    """Simulates ``batches`` steps of ``pipeline`` on ``n`` workers with mean ``costs``.

    Returns ``step`` (steady-state seconds per batch: mean completion spacing after ``warmup``
    batches), ``busy`` (mean per-worker busy time per batch by stage) and ``ends``.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r}; valid: {', '.join(PIPELINES)}")
    if n < 1 or batches <= warmup or warmup < 1 or micro_batches < 1 or host_threads < 1 or cv < 0:
        raise ValueError(f"workers={n}, batches={batches}, warmup={warmup}, micro_batches="
                         f"{micro_batches}, host_threads={host_threads}, cv={cv}: need workers, "
                         "micro_batches, host_threads >= 1, 1 <= warmup < batches, cv >= 0")
    bad = [k for k, v in costs.items() if v < 0]
    if bad:
        raise ValueError(f"negative stage costs {bad}")
    cl = Cluster(n, cv=cv, host_threads=host_threads, rng=np.random.default_rng([seed, n]))
    m = micro_batches if pipeline in ("fwp", "dbp+fwp") else 1
    ends = []
    if pipeline in ("sync", "fwp"):
        done = np.zeros(n)
        for _ in range(batches):
            got = _prep(cl, costs, [done], [])
            upd = _forward_backward(cl, costs, got, m)
            done = cl.op("write_back", "host", costs["write_back"], [upd])
            ends.append(done)
    else:
        patched = pipeline != "semi_sync"
        got = {0: _prep(cl, costs, [], [])}
        upd, wb, patch = {}, {}, {}
        for t in range(batches):
            ready = [got[t]]
            if patched and t > 0:  # rows in K(B_t-1) & K(B_t) from t-1's updated buffer
                patch[t] = cl.op("patch", "accel", costs["patch"], [got[t], upd[t - 1]])
                ready = [patch[t]]
            if t + 1 < batches:  # prefetch t+1 into the buffer batch t-1 used
                data_deps = [got[t - 1]] if t >= 1 else []
                buf_deps = ([wb[t - 1]] + ([patch[t]] if t in patch else [])) if t >= 1 else []
                got[t + 1] = _prep(cl, costs, data_deps, buf_deps)
            upd[t] = _forward_backward(cl, costs, np.maximum.reduce(ready), m)
            wb[t] = cl.op("write_back", "host", costs["write_back"], [upd[t]])
            ends.append(wb[t])
    finish = np.array([e.max() for e in ends])
    step = float((finish[-1] - finish[warmup - 1]) / (batches - warmup))
    return {"step": step, "busy": {k: v / batches for k, v in cl.busy.items()}, "ends": finish}


def step_time(pipeline: str, model: StageModel, n: int, *, repeats: int = 1, seed: int = 0,
              zero: Sequence[str] = (), **kw) -> float:
    """Mean simulated step over ``repeats`` seeds; ``zero`` names stage groups costed at 0
    (``lookup``: route + retrieve, ``all2all``: both directions) to measure their exposure."""
    costs = model.costs(n)
    groups = {"lookup": ("route", "retrieve"), "all2all": ("a2a_call", "a2a_bytes")}
    for g in zero:
        for k in groups[g]:
            costs[k] = 0.0
    return float(np.mean([simulate_steps(pipeline, costs, n, seed=seed * 1000 + r, **kw)["step"]
                          for r in range(repeats)]))


def efficiency_table(model: StageModel, workers: Sequence[int], pipelines: Sequence[str], *,
                     repeats: int = 1, seed: int = 0, **kw) -> dict:
    """Step times and E_p(N) = T_p(N0) / T_p(N) (N0 = workers[0]) per pipeline and scale."""
    steps = {p: {int(n): step_time(p, model, int(n), repeats=repeats, seed=seed, **kw)
                 for n in workers} for p in pipelines}
    n0 = int(workers[0])
    eff = {p: {n: steps[p][n0] / t for n, t in steps[p].items()} for p in pipelines}
    return {"step": steps, "efficiency": eff}


def fold_rest_into_compute(measured_ms: Mapping[str, float]) -> dict[str, float]:
    """Data, h2d and write back counted as accelerator compute (none of the rest overlappable)."""
    rest = sum(measured_ms[k] for k in ("data", "h2d", "compute", "write_back"))
    return dict(measured_ms, data=0.0, h2d=0.0, write_back=0.0, compute=rest)
