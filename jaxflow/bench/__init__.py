"""Measurement harnesses of the benchmark experiments (``jaxflow/main/bench_*``): what is
measured, how, and the figures' models, as plain functions a notebook can call.

Modules (one per benchmark family):
  checkpoint    Hugging Face checkpoint loading (time, peak RSS), forward vs transformers, MoE
                all-to-all vs dense
  kernel_cases  every Pallas kernel / attention backend and its XLA reference on the same arrays,
                with per-dtype tolerances and the bytes / FLOP model of each case
  kernels       one case built, checked against its reference and timed in alternated pairs;
                the copy-bandwidth yardstick
  peers         jaxflow and its peers (TorchRec, ...) on the same work in processes of their own,
                alternated rounds, wall / CPU ratios (``bench_peers``)
  sparse_sync   SparseRL-Sync on real GRPO runs: every codec on the trainer's own trajectory,
                bit-exactness of what the rollouts were served, TCP replica processes
  sync_codec    every weight-sync codec, the trainer's sender paths and the PULSE-style baseline
                on a bf16 tree after one Adam-like step: bytes, entropy bound, throughput
"""

from jaxflow.bench import checkpoint, kernel_cases, kernels, peers, sparse_sync, sync_codec
from jaxflow.bench.kernel_cases import TOLERANCE, Case, iter_cases
from jaxflow.bench.kernels import alternate, copy_bandwidth, max_error, run_case

__all__ = [
    "checkpoint", "kernel_cases", "kernels", "peers", "sparse_sync", "sync_codec",
    "TOLERANCE", "Case", "alternate", "copy_bandwidth", "iter_cases", "max_error", "run_case",
]
