"""nestpipe_scale: a discrete-event simulator of sync / dbp / fwp / dbp+fwp / semi_sync on
128 -> 1,536 workers, fitted to the paper's stage shares and split by stage times measured by a
``nestpipe`` run (a calibration file with its commit, command and device count). Its
predictions are checked against paper figures that did not enter the fit (``paper_checks``).
Pure numpy, seconds. Its ``fwp`` / ``dbp+fwp`` are the paper's overlapped frozen window
(micro-batch i+1's forward All2All overlaps micro-batch i's compute, as ``nestpipe``'s fwp /
dbp+fwp issue it with async collectives); ``nestpipe``'s ``sync_accum`` (the whole window routed
once: sync plus gradient accumulation) is not modelled. The calibration takes only sync's stage
times and dbp's patch from the measured run, not fwp's CPU step time (no async collectives on
the CPU, so nothing overlapped there).

    python -m jaxflow.run --exp=nestpipe_scale --variant=quick
    python -m jaxflow.run --exp=nestpipe_scale --variant=quick --set calibration=runs/nestpipe/<run>
    python -m jaxflow.run --exp=nestpipe_scale --variant=default --set jitter_cv=0.1

Regenerate the built-in calibration (then rerun this):

    python -m jaxflow.run --exp=nestpipe --variant=quick \
        --set calibration_out=jaxflow/nestpipe/simulate/data/nestpipe_quick.json

Summary keys: ``scaling_efficiency`` (pipeline -> E at the largest scale, E = T(128) / T(N)
under weak scaling), ``modelled_schedules`` (pipeline -> what the simulator runs for it),
``baseline_efficiency_error`` (simulated sync minus 0.4434; in-sample,
``baseline_consistency_passed``), ``paper_checks`` (out-of-sample: prediction, paper, relative
error and the tolerance ``paper_checks_rel_tol``), ``efficiency_by_workers``, ``speedup_vs_sync``,
``exposed_ms_at_max_workers`` (never negative: a difference within the window's jitter noise is
0, ``jaxflow.nestpipe.simulate.scaling.exposed_difference``), ``calibration``
(git_commit, command, devices, path, stale, warning), ``sensitivity`` (``calibration``: each
measured stage time x0.5 / x2 -> E and speedup at the largest scale per pipeline), and ONE
headline (``headlines``: simulated dbp+fwp vs sync at the largest scale, stale when the
calibration is).
The model and its assumptions: jaxflow/nestpipe/simulate/'s docstring.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, POSITIVE, SEED, Real, domains

DESCRIPTION = "NestPipe at 128 -> 1,536 workers: discrete-event simulator calibrated from a nestpipe run"
ENTRY = "jaxflow.main.nestpipe_scale:main"
HEADLINES = "jaxflow.study.headlines_systems:nestpipe_scale"
PIPELINE_NAMES = ("sync", "dbp", "fwp", "dbp+fwp", "semi_sync")


@domains(seed=SEED, workers=COUNT, micro_batches=COUNT, host_threads=COUNT, jitter_cv=NON_NEGATIVE,
         device_copy_speedup=POSITIVE, peer_latency_us=NON_NEGATIVE, gpus_per_node=COUNT, pod_size=COUNT,
         oversubscription=Real(1.0), intra_over_inter_bw=POSITIVE, batches=COUNT, warmup=COUNT0, repeats=COUNT,
         sensitivity_cv=NON_NEGATIVE, sensitivity_micro_batches=COUNT, sensitivity_peer_latency_us=NON_NEGATIVE,
         sensitivity_oversubscription=Real(1.0), sensitivity_device_copy_speedup=POSITIVE,
         sensitivity_factors=POSITIVE, validation_rel_tol=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    # calibration file written by `nestpipe --set calibration_out=...`, or a nestpipe run dir /
    # summary.json; "" = jaxflow/nestpipe/simulate/data/nestpipe_quick.json
    calibration: str = ""
    workers: tuple[int, ...] = (128, 256, 512, 768, 1024, 1536)  # first = reference, last = target
    pipelines: tuple[str, ...] = PIPELINE_NAMES
    micro_batches: int = 4  # the frozen window's N (the measured nestpipe run used 4)
    rest_on_accelerator: bool = False  # True: data / h2d / write back counted as compute
    host_threads: int = 4  # CPU threads per worker for data / retrieval / write back
    jitter_cv: float = 0.05  # per-worker, per-op coefficient of variation (lognormal)
    device_copy_speedup: float = 20.0  # patch on device vs measured CPU patch / retrieve ratio
    peer_latency_us: float = 10.0  # All2All latency per peer per call (a priori, not fitted)
    gpus_per_node: int = 8
    pod_size: int = 256
    oversubscription: float = 2.0  # spine above a pod
    intra_over_inter_bw: float = 8.0
    batches: int = 16  # simulated steps per (pipeline, scale)
    warmup: int = 4
    repeats: int = 2  # seeds averaged per point
    sensitivity_cv: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.3)
    sensitivity_micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    sensitivity_peer_latency_us: tuple[float, ...] = (0.0, 10.0, 50.0, 150.0)
    sensitivity_oversubscription: tuple[float, ...] = (1.0, 2.0, 4.0)
    sensitivity_device_copy_speedup: tuple[float, ...] = (1.0, 20.0, 1000.0)
    sensitivity_factors: tuple[float, ...] = (0.5, 2.0)  # each measured stage time x these
    validation_rel_tol: float = 0.25  # paper_checks: |predicted / paper - 1| <= this passes

    def __post_init__(self):
        bad = [p for p in self.pipelines if p not in PIPELINE_NAMES]
        if bad or "sync" not in self.pipelines:
            raise ValueError(f"pipelines={self.pipelines}: {bad or 'sync missing'}; valid: "
                             f"{', '.join(PIPELINE_NAMES)} (sync is required, it is the baseline)")
        if len(self.workers) < 2 or list(self.workers) != sorted(set(self.workers)) or self.workers[0] < 1:
            raise ValueError(f"workers={self.workers}: need >= 2 increasing counts >= 1 "
                             "(first = reference scale, last = target)")
        for name in ("micro_batches", "host_threads", "repeats", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; need >= 1")
        if self.batches <= self.warmup:
            raise ValueError(f"batches={self.batches} must exceed warmup={self.warmup}")
        if not self.jitter_cv >= 0 or any(not c >= 0 for c in self.sensitivity_cv):
            raise ValueError(f"jitter_cv={self.jitter_cv} / sensitivity_cv={self.sensitivity_cv}; "
                             "need >= 0")
        if self.peer_latency_us < 0:
            raise ValueError(f"peer_latency_us={self.peer_latency_us}; need >= 0")
        if any(not f > 0 for f in self.sensitivity_factors) or not self.validation_rel_tol > 0:
            raise ValueError(f"sensitivity_factors={self.sensitivity_factors} / validation_rel_tol="
                             f"{self.validation_rel_tol}; need > 0")
        if self.device_copy_speedup <= 0:
            raise ValueError(f"device_copy_speedup={self.device_copy_speedup}; need > 0")


def _default() -> Config:
    return Config(workers=(128, 256, 384, 512, 768, 1024, 1280, 1536), batches=32, repeats=5)


def _full() -> Config:
    return Config(workers=tuple(range(128, 1537, 128)), batches=64, warmup=8, repeats=10)


get_config = Variants(quick=Config, default=_default, full=_full)
VARIANTS = get_config.variants
