"""The code each experiment's figures measure: the registry of measured paths.

Every experiment (``configs/<name>.py``) has an entry: the packages its driver runs (the
driver's imports, closed over the package import graph), its driver and its config. A record
stores the sha256 of these files' contents (:func:`jaxflow.provenance.measured_hash`); when the
tree's hash differs, the record's figures describe other code and its page marks it stale.
"""

from __future__ import annotations

from typing import Mapping

from jaxflow.errors import UserError


class ResultsError(UserError, ValueError):
    """A record, page or template that is not valid (one line naming the value and what is valid)."""

# The layers most experiments stand on (their import closure), named once.
_LM = ("jaxflow/data", "jaxflow/models", "jaxflow/sync", "jaxflow/train", "pallas_kernels")
_RL = _LM + ("jaxflow/rl", "jaxflow/rollout", "jaxflow/stats.py", "jaxflow/study", "jaxflow/timing.py")
_BENCH = _RL + ("jaxflow/bench", "jaxflow/embeddings")
_RECSYS = _LM + ("jaxflow/embeddings", "jaxflow/recsys")
_WARM_START = ("configs/lm_pretrain.py", "jaxflow/main/lm_pretrain.py")


def _own(name: str, driver: str | None = None, *extra: str) -> tuple[str, ...]:
    return (f"jaxflow/main/{driver or name}.py", f"configs/{name}.py") + extra


#: experiment -> the paths (files or folders, relative to the repository root; ``:(exclude)P``
#: leaves P out) whose contents its figures measure.
MEASURED_PATHS: Mapping[str, tuple[str, ...]] = {
    "bench_checkpoint": _BENCH + _own("bench_checkpoint"),
    "bench_embedding": _RECSYS + _own("bench_embedding", None, "configs/dlrm_train.py"),
    "bench_kernels": _BENCH + _own("bench_kernels"),
    "bench_packing": _LM + ("jaxflow/flow",) + _own("bench_packing"),
    "bench_peers": _BENCH + _own("bench_peers"),
    "bench_policy_loss": _RL + _own("bench_policy_loss"),
    "bench_rollout": _RL + ("jaxflow/marl",) + _own("bench_rollout"),
    "bench_sparsegpt": _RL + ("jaxflow/prune",) + _own("bench_sparsegpt"),
    "bench_sync_codec": _BENCH + _own("bench_sync_codec"),
    "calibration_tradeoffs": _RL + ("jaxflow/prune",) + _own("calibration_tradeoffs"),
    "corrections_study": _RL + _own("corrections_study", None, "configs/sis_offpolicy.py", "configs/flagship.py",
                                    "configs/bench_policy_loss.py") + _WARM_START,
    "decoratelm": _LM + ("jaxflow/decorate",) + _own("decoratelm"),
    "dlrm_train": _RECSYS + _own("dlrm_train"),
    "figa": _RL + ("jaxflow/align",) + _own("figa", None, "configs/sis_offpolicy.py") + _WARM_START,
    "flagship": _RL + _own("flagship") + _WARM_START,
    "flexmarl": _RL + ("jaxflow/marl", ":(exclude)jaxflow/marl/simulate") + _own("flexmarl"),
    "flexmarl_scale": ("jaxflow/marl/simulate",) + _own("flexmarl_scale"),
    "flowtrain": _LM + ("jaxflow/flow",) + _own("flowtrain"),
    "kernel_footprints": ("pallas_kernels", "jaxflow/compile_only") + _own("kernel_footprints"),
    "lm_pretrain": _LM + _own("lm_pretrain"),
    "nestpipe": _RECSYS + ("jaxflow/nestpipe", ":(exclude)jaxflow/nestpipe/simulate", "jaxflow/timing.py")
    + _own("nestpipe", None, "configs/dlrm_train.py"),
    "nestpipe_scale": ("jaxflow/nestpipe/simulate",) + _own("nestpipe_scale"),
    "oxygenrec": _RL + ("jaxflow/embeddings", "jaxflow/genrec", "jaxflow/recsys") + _own("oxygenrec"),
    "rl": _RL + _own("rl", None, "configs/flagship.py"),
    "sis_exact_gradient": _RL + _own("sis_exact_gradient"),
    "sis_offpolicy": _RL + _own("sis_offpolicy") + _WARM_START,
    "sis_regime": _RL + _own("sis_regime", None, "configs/sis_offpolicy.py") + _WARM_START,
    "sis_study": _RL + _own("sis_study", "sis_offpolicy", "configs/sis_offpolicy.py") + _WARM_START,
    "sparse_sync": _BENCH + _own("sparse_sync", None, "configs/sis_offpolicy.py") + _WARM_START,
    "sync_cost_model": ("jaxflow/sync",) + _own("sync_cost_model"),
}


def measured_paths(experiment: str) -> tuple[str, ...]:
    """The measured paths of ``experiment`` (:data:`MEASURED_PATHS`); ResultsError naming the
    valid experiments otherwise."""
    if experiment not in MEASURED_PATHS:
        raise ResultsError(f"experiment {experiment!r} has no measured paths; valid: "
                          f"{', '.join(sorted(MEASURED_PATHS))} (add it to jaxflow/results/registry.py)")
    return MEASURED_PATHS[experiment]
