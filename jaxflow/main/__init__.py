"""Experiment drivers: one module per experiment, ``main(config, run) -> summary``.

``configs/<experiment>.py`` names its driver here through ``ENTRY``. Drivers compose the library
packages (``jaxflow.rl``, ``jaxflow.sync``, ...); no library module imports a driver.
``__all__`` names the drivers (``from jaxflow.main import *`` imports them all); the experiments
the README's experiment table says what each one measures.
"""

__all__ = [
    "bench_checkpoint", "bench_embedding", "bench_kernels", "bench_packing", "bench_peers", "bench_policy_loss",
    "bench_rollout",
    "bench_sparsegpt", "bench_sync_codec", "calibration_tradeoffs", "corrections_study", "decoratelm", "dlrm_train",
    "figa", "flagship", "flexmarl", "flexmarl_scale", "flowtrain", "kernel_footprints",
    "lm_pretrain", "nestpipe", "nestpipe_scale", "oxygenrec", "rl", "sis_exact_gradient", "sis_offpolicy",
    "sis_regime", "sparse_sync", "sync_cost_model",
]
