"""nestpipe: sync / sparse_dist (TorchRec TrainPipelineSparseDist) / dbp / fwp / dbp+fwp /
sync_accum / semi_sync pipelines over host-resident tables and a DLRM: exactness vs sync
(after ``steps`` steps and per step), per-stage and exposed time, speedup vs sync in the same
run, the ideal bound (sum of stages / slowest), AUC / logloss, clustering's transfer reduction.
``fwp`` / ``dbp+fwp`` are the paper's frozen-window pipelining on every platform (per
micro-batch routing, clustering and All2All; overlappable with async collectives, which the
CPU backend does not have); ``sync_accum`` is the whole window routed and exchanged once (the
collectives of sync, the backward in N micro-batches: sync plus gradient accumulation, not FWP).

    python -m jaxflow.run --exp=nestpipe --variant=quick
    python -m jaxflow.run --exp=nestpipe --variant=default
    python -m jaxflow.run --exp=nestpipe --variant=quick --set micro_batches=8
    python -m jaxflow.run --exp=nestpipe --variant=quick --set runs=3   # README figures
    python -m jaxflow.run --exp=nestpipe --variant=quick \
        --set calibration_out=jaxflow/nestpipe/simulate/data/nestpipe_quick.json

Data-parallel DLRM on a mesh of every device present (``devices=N`` takes the first N); on a
CPU-only machine the runner creates 8 fake CPU devices (``--devices=N`` for another count). Each
device routes its keys to the owning shard of the host tables and gets rows back by All2All.
The quick / default capacities were measured on ``capacity_devices`` (8) devices; on another
count they fall back to the worst-case sizes (0, cannot overflow).

``full`` is the production size of ``dlrm_train --variant=full``: the same 26 tables of
10M..100M rows (``configs.dlrm_train.PRODUCTION_VOCABS``, 1.03B rows) at dim 128 with bags of
1..4 ids, the MLPerf DLRM dense model (bottom 512-256-128, top 1024-1024-512-256-1), global
batch 65,536 in a window of 8 micro-batches. Sharding: the tables stay in host memory, split
row-wise over the one "data" axis (each device owns ``ceil(V / P)`` rows of every table and
holds only the owner buffer of the rows a step touches: the worst-case capacities, as they were
not measured at that size), the batch split over "data", the dense model replicated with its
gradients psum-ed. It does not run on a CPU host (528 GB of host tables); check it with
``python -m jaxflow.run --exp=nestpipe --variant=full --compile-only --target=tpu-v5p:4x4x4``.

Summary keys (maps keyed by pipeline): ``speedup_vs_sync`` (median over ``runs`` of each run's
paired median), ``speedup_runs`` (every run's figure), ``speedup_pairs`` (every pair),
``ideal_speedup``, ``max_param_diff_vs_sync`` (max over leaves of max |x - x_sync| /
max |x_sync|), ``max_one_step_diff_vs_sync`` (the windowed pipelines), ``frozen_exchange``
(pipeline -> its window's All2All schedule); ``auto_mode`` / ``auto_speedup_vs_sync`` (the
measured choice among the exact pipelines).
"""

from __future__ import annotations

import dataclasses

from configs.dlrm_train import POOLING_BACKENDS, PRODUCTION_VOCABS
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, POSITIVE, SEED, domains

DESCRIPTION = "NestPipe dual-buffer / frozen-window pipelines vs sync over host-resident tables"
ENTRY = "jaxflow.main.nestpipe:main"
HEADLINES = "jaxflow.study.headlines_systems:nestpipe"
#: the owner update's implementations (jaxflow.nestpipe.sharded.UPDATE_BACKENDS)
UPDATE_BACKENDS = ("auto", "xla", "host_kernel")
PIPELINE_NAMES = ("sync", "sparse_dist", "dbp", "fwp", "dbp+fwp", "sync_accum", "semi_sync")
#: the paper's frozen window's All2All schedules (sharded.FROZEN_EXCHANGES less ``window``,
#: which is the sync_accum pipeline)
FWP_EXCHANGES = ("per_micro_batch", "batched")


@domains(seed=SEED, vocab_sizes=COUNT, multi_hot=COUNT, zipf_a=POSITIVE, drift_period=COUNT, embed_dim=COUNT,
         bottom=COUNT, top=COUNT, batch_size=COUNT, dense_lr=POSITIVE, sparse_lr=POSITIVE, devices=COUNT,
         capacity_devices=COUNT, capacity=COUNT0, bucket_capacity=COUNT0, micro_bucket_capacity=COUNT0,
         owner_capacity=COUNT0, micro_batches=COUNT, steps=COUNT, step_check_steps=COUNT, eval_batches=COUNT,
         warmup=COUNT0, timing_steps=COUNT, pairs=COUNT, runs=COUNT, probe_rounds=COUNT, probe_steps=COUNT0)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    vocab_sizes: tuple[int, ...] = (200_000, 100_000, 50_000, 20_000, 5_000, 1_000, 100, 10)
    multi_hot: int = 4
    zipf_a: float = 1.05
    drift_period: int = 50
    embed_dim: int = 32
    bottom: tuple[int, ...] = (64, 32)
    top: tuple[int, ...] = (64, 32)
    batch_size: int = 2048
    dense_lr: float = 1e-3
    sparse_lr: float = 0.05
    devices: int | None = None  # data-parallel mesh: None = every device present (8 fake on CPU)
    capacity_devices: int = 8  # device count the capacities below were measured on
    # fixed shapes of the routing (exceeding one raises CapacityOverflowError; 0 = cannot overflow)
    capacity: int = 0  # distinct keys per device per (micro-)batch, all tables together
    bucket_capacity: int = 0  # keys one device asks of one owner per batch (sync, dbp, semi_sync)
    micro_bucket_capacity: int = 0  # the same per micro-batch (fwp / dbp+fwp: routed per micro-batch)
    owner_capacity: int = 0  # distinct rows one owner retrieves per batch
    micro_batches: int = 4  # the window's N (fwp, dbp+fwp, sync_accum)
    cluster: bool = True  # key-centric clustering of samples (fwp / dbp+fwp; sync_accum: no effect)
    cluster_method: str = "vote"  # vote (vectorised) | greedy (fewer rows moved, slower)
    pipelines: tuple[str, ...] = PIPELINE_NAMES
    steps: int = 50  # K, for the exactness comparison and AUC
    step_check_steps: int = 10  # steps of the per-step (one-step-from-sync) reorder error check
    eval_batches: int = 4
    warmup: int = 3
    timing_steps: int = 8
    pairs: int = 10  # timing rounds per run (every pipeline once per round, random order)
    runs: int = 1  # timing runs, each with a fresh warm-up and auto probe (--set runs=3)
    auto: bool = True  # probe the exact pipelines and time the fastest as "auto"
    probe_rounds: int = 3
    probe_steps: int = 0  # steps per probe call; 0 = timing_steps (short probes favour sync: a
    # pipeline's fill / drain is a larger share of a short run)
    # fwp / dbp+fwp's All2All schedule: per_micro_batch (the paper's, every platform) | batched
    # (diagnostic: the same values with one row and one gradient All2All per window)
    frozen_exchange: str = "per_micro_batch"
    # write the simulator's calibration file here (nestpipe_scale reads it; see its config)
    calibration_out: str = ""
    # bag pooling in the compute programs: "auto" = the Pallas embedding-bag kernel on GPU /
    # TPU where it builds, XLA on a CPU (the same values as "xla" there)
    pooling_backend: str = "auto"
    # the owner buffers' sparse update: "auto" = the fused host kernel (numba via XLA FFI, in
    # place) on a CPU program, XLA on GPU / TPU; "xla" always XLA; "host_kernel" the kernel or
    # an error saying why not (nestpipe.sharded.UPDATE_BACKENDS)
    update_backend: str = "auto"

    def __post_init__(self):
        bad = [p for p in self.pipelines if p not in PIPELINE_NAMES]
        if bad:
            raise ValueError(f"pipelines {bad}; valid: {', '.join(PIPELINE_NAMES)}")
        if self.runs < 1 or self.pairs < 1 or self.probe_rounds < 1 or self.probe_steps < 0:
            raise ValueError(f"runs={self.runs}, pairs={self.pairs}, probe_rounds="
                             f"{self.probe_rounds}, probe_steps={self.probe_steps}; need >= 1 "
                             "(probe_steps >= 0)")
        if self.frozen_exchange not in FWP_EXCHANGES:
            hint = (" (the whole-window schedule is the sync_accum pipeline, not fwp)"
                    if self.frozen_exchange == "window" else "")
            raise ValueError(f"frozen_exchange={self.frozen_exchange!r}; valid: "
                             f"{', '.join(FWP_EXCHANGES)}{hint}")
        if self.pooling_backend not in POOLING_BACKENDS:
            raise ValueError(f"pooling_backend={self.pooling_backend!r}; valid: "
                             f"{', '.join(POOLING_BACKENDS)}")
        if self.update_backend not in UPDATE_BACKENDS:
            raise ValueError(f"update_backend={self.update_backend!r}; valid: {', '.join(UPDATE_BACKENDS)}")
        if self.cluster_method not in ("vote", "greedy"):
            raise ValueError(f"cluster_method={self.cluster_method!r}; valid: vote, greedy")
        if self.devices is not None and (self.devices < 1 or
                                         self.batch_size % (self.devices * self.micro_batches)):
            raise ValueError(f"batch_size={self.batch_size} not divisible by devices={self.devices}"
                             f" x micro_batches={self.micro_batches}")
        if self.batch_size % self.micro_batches:
            raise ValueError(f"batch_size={self.batch_size} not divisible by micro_batches="
                             f"{self.micro_batches}")


def _quick() -> Config:  # capacities ~1.5x the maxima seen over the run's batches
    return Config(capacity=3072, bucket_capacity=512, micro_bucket_capacity=192,
                  owner_capacity=2048)


def _default() -> Config:
    return Config(batch_size=8192, embed_dim=64, steps=500, pairs=20, timing_steps=16,
                  capacity=12288, bucket_capacity=1664, micro_bucket_capacity=576,
                  owner_capacity=8192, step_check_steps=20,
                  vocab_sizes=(2_000_000, 1_000_000, 500_000, 200_000, 50_000, 10_000, 1_000, 100))


def _full() -> Config:
    """Production size (see the module docstring): 26 x 10M..100M rows x 128, batch 65,536."""
    return Config(batch_size=65536, embed_dim=128, steps=2000, pairs=30, timing_steps=16,
                  micro_batches=8, bottom=(512, 256), top=(1024, 1024, 512, 256),
                  vocab_sizes=PRODUCTION_VOCABS)


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
