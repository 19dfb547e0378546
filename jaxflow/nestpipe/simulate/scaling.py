"""The ``nestpipe_scale`` study on the simulator: the model fitted from a config and a calibration,
the figures at the largest scale (speedups, what lookup and All2All still cost), and how the
headline numbers move with each assumption (``sensitivity``).

``config`` is ``configs/nestpipe_scale.py``'s ``Config`` (``workers``: first = reference scale
N0, last = target N1; the network shape, the jitter, the simulated batches and repeats, the
sensitivity grids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jaxflow.nestpipe.simulate.calibration import STAGE_KEYS, Calibration, calibrate, fold_rest_into_compute
from jaxflow.nestpipe.simulate.network import NetworkShape, StageModel
from jaxflow.nestpipe.simulate.schedules import PIPELINES, efficiency_table, simulate_steps, step_time

__all__ = ["ScalingStudy", "exposed_difference", "window_noise"]

#: float rounding of two step estimates that are equal in exact arithmetic (relative)
ROUNDING = 1e-9


def window_noise(step: float, *, cv: float, batches: int, warmup: int) -> float:
    """How far two steady-state step estimates of the same schedule can differ when only a
    hidden stage group's cost changes: a step is the mean completion spacing over the last
    ``batches - warmup`` batches, and with per-worker jitter ``cv`` zeroing a hidden group can
    move the window's first completion by about one step's jitter (``cv x step``), spread over
    those spacings; plus float rounding. (nestpipe_scale quick: dbp+fwp's hidden All2All at
    1,536 workers measured -1.3 ms of a 2,267 ms step; the bound is 9.4 ms; 0 within rounding
    with ``cv=0``.)"""
    return step * (cv / (batches - warmup) + ROUNDING)


def exposed_difference(step: float, step_without: float, noise: float, what: str = "") -> float:
    """The time a stage group leaves exposed: ``step - step_without``, with a negative
    difference within ``noise`` (:func:`window_noise`: the group is hidden) reported as 0.
    ValueError (one line) for a larger negative difference: zeroing work cannot slow a step
    down by more than the window's noise."""
    diff = step - step_without
    if diff >= 0:
        return diff
    if -diff <= noise:
        return 0.0
    raise ValueError(f"exposed time of {what or 'a stage group'} = {diff:.6g} (step {step:.6g}, without it "
                     f"{step_without:.6g}): more negative than the window's noise; valid: >= {-noise:.6g}")


@dataclasses.dataclass(frozen=True)
class ScalingStudy:
    """A config and a calibration: ``measured`` the stage times (ms) the fit splits by (the
    calibration's, with the rest folded into compute when ``rest_on_accelerator``),
    ``as_measured`` the calibration's as they are, ``shape`` the network."""

    config: Any
    calibration: Calibration
    measured: Mapping[str, float]
    as_measured: Mapping[str, float]
    shape: NetworkShape

    @classmethod
    def from_config(cls, config, calibration: Calibration) -> "ScalingStudy":
        """The study of ``config`` on ``calibration`` (``load_calibration``)."""
        measured = as_measured = calibration.stage_ms
        if config.rest_on_accelerator:
            measured = fold_rest_into_compute(measured)
        shape = NetworkShape(config.gpus_per_node, config.pod_size, config.oversubscription,
                             config.intra_over_inter_bw)
        return cls(config, calibration, measured, as_measured, shape)

    @property
    def workers(self) -> tuple[int, ...]:
        """The simulated worker counts (first = reference N0, last = target N1)."""
        return tuple(int(n) for n in self.config.workers)

    @property
    def sim(self) -> dict:
        """The simulation's keyword arguments (batches, warmup, micro_batches, cv, host_threads)."""
        c = self.config
        return dict(batches=c.batches, warmup=c.warmup, micro_batches=c.micro_batches,
                    cv=c.jitter_cv, host_threads=c.host_threads)

    @property
    def reps(self) -> dict:
        """Seeds averaged per point: ``repeats`` and ``seed``."""
        return dict(repeats=self.config.repeats, seed=self.config.seed)

    def fit(self, stage_ms: Mapping[str, float] | None = None, **over) -> StageModel:
        """``calibrate`` at (N0, N1) with the config's shape, device copy speedup and peer
        latency (``over`` replaces any of them); ``stage_ms`` defaults to ``measured``.

        Raises:
          ValueError: the shares cannot be fitted under these assumptions.
        """
        n = self.workers
        kw = {"workers": (n[0], n[-1]), "shape": self.shape,
              "device_copy_speedup": self.config.device_copy_speedup,
              "peer_latency_us": self.config.peer_latency_us, **over}
        return calibrate(self.measured if stage_ms is None else stage_ms, **kw)

    def table(self, model: StageModel, pipelines: Sequence[str]) -> dict:
        """``efficiency_table`` of ``pipelines`` over the workers: ``{"efficiency", "step"}``."""
        return efficiency_table(model, self.workers, pipelines, **self.reps, **self.sim)

    def exposed_ms(self, model: StageModel, steps: Mapping, pipelines: Sequence[str], **sim) -> dict:
        """``{pipeline: {"lookup", "all2all": ms}}`` at N1: the step minus the step with that
        group costed at 0 (``steps``: the table's step times; ``sim`` overrides), never negative
        (:func:`exposed_difference`)."""
        n1, kw = self.workers[-1], {**self.sim, **sim}
        return {p: {g: model.unit_ms * exposed_difference(
                        steps[p][n1], step_time(p, model, n1, zero=(g,), **self.reps, **kw),
                        self.noise(steps[p][n1], kw), f"{p}/{g}")
                    for g in ("lookup", "all2all")} for p in pipelines}

    @staticmethod
    def noise(step: float, sim: Mapping[str, Any]) -> float:
        """:func:`window_noise` of ``step`` under the simulation arguments ``sim``."""
        return window_noise(step, cv=sim["cv"], batches=sim["batches"], warmup=sim["warmup"])

    def sync_shares(self, model: StageModel) -> dict:
        """sync's simulated lookup / All2All shares of its step at N1 (one seed)."""
        n1 = self.workers[-1]
        busy = simulate_steps("sync", model.costs(n1), n1, seed=self.config.seed, **self.sim)
        return {"lookup": (busy["busy"]["route"] + busy["busy"]["retrieve"]) / busy["step"],
                "all2all": busy["busy"]["all2all"] / busy["step"]}

    def fwp16_exposed_all2all_ms(self, model: StageModel) -> float:
        """The All2All left exposed at N1 by a 16-micro-batch frozen window (ms)."""
        n1, sim16 = self.workers[-1], dict(self.sim, micro_batches=16)
        step = step_time("fwp", model, n1, **self.reps, **sim16)
        without = step_time("fwp", model, n1, zero=("all2all",), **self.reps, **sim16)
        return model.unit_ms * exposed_difference(step, without, self.noise(step, sim16), "fwp16/all2all")

    def point(self, p: str, m: StageModel, **over) -> dict:
        """Pipeline ``p`` under model ``m`` (``over`` replaces simulation arguments): E at N1,
        the speedup vs sync at N1 and at N0."""
        n0, n1, kw = self.workers[0], self.workers[-1], {**self.sim, **over}
        t0, t1 = (step_time(p, m, n, **self.reps, **kw) for n in (n0, n1))
        s0, s1 = (step_time("sync", m, n, **self.reps, **kw) for n in (n0, n1))
        return {"efficiency": t0 / t1, "speedup_vs_sync": s1 / t1, f"speedup_vs_sync_at_{n0}": s0 / t0}

    def headline(self, m: StageModel) -> dict:
        """E at N1 and the speedup vs sync at N1 of every pipeline of the config under ``m``."""
        n0, n1, pipelines = self.workers[0], self.workers[-1], self.config.pipelines
        t = {p: {n: step_time(p, m, n, **self.reps, **self.sim) for n in (n0, n1)} for p in pipelines}
        return {p: {"efficiency": t[p][n0] / t[p][n1], "speedup_vs_sync": t["sync"][n1] / t[p][n1]}
                for p in pipelines}

    def sensitivity(self, model: StageModel) -> dict:
        """How the headline numbers move: ``calibration`` (each measured stage time x the
        config's ``sensitivity_factors``, refitted), ``jitter_cv``, ``micro_batches``,
        ``peer_latency_us`` and ``device_copy_speedup`` (refitted; ``{"error"}`` where the fit
        fails), ``oversubscription`` (E over the workers), ``rest_split`` (measured vs the rest
        on the accelerator)."""
        c = self.config
        calib_sens = {}
        for stage in STAGE_KEYS:
            calib_sens[stage] = {}
            for factor in c.sensitivity_factors:
                table = self.calibration.scaled(stage, factor)
                if c.rest_on_accelerator:
                    table = fold_rest_into_compute(table)
                calib_sens[stage][f"x{factor:g}"] = self.headline(self.fit(table))
        sens = {"calibration": calib_sens,
                "jitter_cv": {str(cv): {p: self.point(p, model, cv=cv) for p in ("sync", "dbp", "dbp+fwp")}
                              for cv in c.sensitivity_cv},
                "micro_batches": {str(mb): {p: self.point(p, model, micro_batches=mb) for p in ("fwp", "dbp+fwp")}
                                  for mb in c.sensitivity_micro_batches}}
        n1 = self.workers[-1]
        for name, values, pipes in (
                ("peer_latency_us", c.sensitivity_peer_latency_us, ("fwp", "dbp+fwp")),
                ("device_copy_speedup", c.sensitivity_device_copy_speedup, ("dbp", "dbp+fwp"))):
            sens[name] = {}
            for v in values:
                try:
                    m_v = self.fit(**{name: v})
                except ValueError as e:
                    sens[name][str(v)] = {"error": str(e)}
                    continue
                sens[name][str(v)] = {"a2a_call_fraction_at_max": m_v.mean_shares(n1)["a2a_call_fraction"],
                                      **{p: self.point(p, m_v) for p in pipes}}
        # The endpoints are fitted, so the network shape only moves the scales in between.
        sens["oversubscription"] = {}
        for o in c.sensitivity_oversubscription:
            try:
                m_o = self.fit(shape=dataclasses.replace(self.shape, oversubscription=o))
            except ValueError as e:
                sens["oversubscription"][str(o)] = {"error": str(e)}
                continue
            sens["oversubscription"][str(o)] = self.table(m_o, ("sync", "dbp+fwp"))["efficiency"]
        # The CPU run splits "the rest" into host work (data, write back: overlappable) and
        # compute; the paper's HSTU step may be mostly dense compute: all of it on the accelerator.
        sens["rest_split"] = {}
        for name, ms_table in (("measured", self.as_measured),
                               ("rest_on_accelerator", fold_rest_into_compute(self.as_measured))):
            sens["rest_split"][name] = {p: self.point(p, self.fit(ms_table)) for p in PIPELINES}
        return sens
