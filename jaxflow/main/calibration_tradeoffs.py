"""The ``calibration_tradeoffs`` experiment: which calibration source preserves which capability.

For every model size x calibration source x independent draw: build the calibration set,
measure its perplexity under the dense model, prune the dense capability model at every
sparsity (SparseGPT, sequential), score every capability and report retention = pruned /
dense. Then, per size and sparsity, the Spearman correlation across sources of calibration
perplexity with each capability's retention (the paper at 0.6: +0.71 General, -0.53 Math,
-0.59 Code), with a bootstrap interval over sources, and whether each correlation keeps its
sign across sizes and sparsities.

With ``--set model.hf_path=DIR`` the dense model is a local checkpoint (one size), and
``eval_files`` / ``calibration_files`` replace the synthetic capability world
(``jaxflow.prune.task_files``).

The study's grid lives in ``jaxflow.prune.tradeoffs`` (each cell a ``jaxflow.prune.PruneSystem``);
this driver picks the dense models, runs the grid per size and writes the report.
"""

from __future__ import annotations

from jaxflow.experiment import RunContext
from jaxflow.prune.task_files import load_calibration_files, load_task_files
from jaxflow.prune.tradeoffs import sign_stability_across, study_size

__all__ = ["main"]

PAPER = {
    "spearman_at_0.6": {"general": 0.71, "math": -0.53, "code": -0.59},
    "total_retention_llama31_8b": {"mix": 0.588, "best_single_source(metamath)": 0.500, "c4": 0.400},
    "averaged_vs_code_gap_points": {"commonsense_avg_acc": 2.85, "code_retention": 51.9},
}


def main(config, run: RunContext) -> dict:
    """Every size's grid (``study_size``), the sign stability across sizes, the report."""
    mesh = config.mesh.make()
    task_sets = load_task_files(config.eval_files) if config.eval_files else None
    documents = load_calibration_files(config.calibration_files) if config.calibration_files else None
    hf = None
    models = config.size_models()
    if config.model.hf_path:  # --set model.hf_path=DIR: prune a local HF checkpoint instead
        from jaxflow.models.pretrained import load_policy

        hf = load_policy(config.model.hf_path, mesh)
        models = [("hf", hf[0])]
        run.info(f"dense model from {config.model.hf_path}: {hf[0].architecture}")
    total = len(models) * len(config.sources) * config.draws * len(config.sparsities)
    progress = [0]
    sizes = {}
    for name, model_cfg in models:
        sizes[name] = study_size(config, model_cfg, mesh, run, hf=hf, task_sets=task_sets,
                                 documents=documents, size=name, progress=progress, total=total)
    run.write_json("per_draw.json", [r for s in sizes.values() for r in s.pop("per_draw")])
    stability = sign_stability_across(sizes)
    largest = sizes[models[-1][0]]
    return {
        **{k: v for k, v in largest.items() if k != "model"},  # the largest size, as before
        "sizes": sizes,
        "sign_stability": stability,
        "draws": config.draws,
        "bootstrap": config.bootstrap,
        "method": config.method,
        "paper": PAPER,
    }
