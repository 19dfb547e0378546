"""The pipelines' programs (sync / dbp / fwp / dbp+fwp / semi_sync) issued on a :class:`Cluster`,
steady-state step times and scaling efficiencies.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from jaxflow.nestpipe.simulate.cluster import Cluster
from jaxflow.nestpipe.simulate.network import StageModel

PIPELINES = ("sync", "dbp", "fwp", "dbp+fwp", "semi_sync")


EXACT_PIPELINES = ("sync", "dbp", "fwp", "dbp+fwp")


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
