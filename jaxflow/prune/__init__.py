"""Post-training pruning: SparseGPT (JAX), Wanda / magnitude baselines, sequential pruning of the
foundation LM, capability-decomposed evaluation and calibration sources (incl. IGSP).

    from jaxflow.prune import prune
    pruned_params, report = prune(params, calibration_batches, 0.6)        # or "2:4"

Modules: ``sparsegpt`` (one layer), ``baselines`` (Wanda / magnitude), ``masks``,
``sequential`` (layer by layer through the LM), ``system`` (the same pipeline as a
:class:`jaxflow.system.System`: ``PruneSystem``, one step per block), ``calibration`` /
``selfgen`` (calibration sources), ``capabilities`` / ``task_files`` (evaluation),
``correlation`` (Spearman intervals), ``dense`` (the cached dense model), ``tradeoffs`` (the
calibration-source study's grid), ``bench`` (the SparseGPT-vs-llmcompressor measurement).
"""

from jaxflow.prune import bench, system, tradeoffs
from jaxflow.prune.baselines import magnitude_prune, wanda_prune
from jaxflow.prune.masks import SparsityPattern, parse_sparsity
from jaxflow.prune.sequential import METHODS, PrunedMatrix, infer_model_config, prune
from jaxflow.prune.sparsegpt import (
    CholeskyRetryWarning,
    HessianState,
    hessian_init,
    hessian_update,
    reconstruction_error,
    sparsegpt_prune,
)
from jaxflow.prune.system import PruneConfig, PruneState, PruneSystem

__all__ = [
    "bench", "system", "tradeoffs",
    "CholeskyRetryWarning", "HessianState", "METHODS", "PruneConfig", "PruneState", "PruneSystem", "PrunedMatrix",
    "SparsityPattern",
    "hessian_init", "hessian_update", "infer_model_config", "magnitude_prune", "parse_sparsity",
    "prune", "reconstruction_error", "sparsegpt_prune", "wanda_prune",
]
