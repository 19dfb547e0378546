"""FlowTrain: decoupled vision-encoder / LLM-backbone training with dynamic packing.

Modules (one idea each):
  digits_data  sklearn digits rendered at 8-32 px, 1-4 images per sample, text tasks
  vit          ViT encoder over packed variable-size images + projector
  vlm          image embeddings spliced into text, packed rows, segment attention backends
  packing      cost model and balanced packing (first-fit / LPT / Karmarkar-Karp)
  batching     host layout of one step: encoder patch rows, padded or packed token rows
  pool         bounded producer-consumer embedding pool keyed by sample
  steps        pure gradient functions and jitted steps of both modes
  monolithic   the whole VLM as one step on one mesh (padded or packed rows)
  decoupled    encoder and backbone on disjoint sub-meshes joined by the pool
  allocator    throughput-matching split of the devices
  meshes       the monolithic mesh and each candidate split's encoder / backbone sub-meshes
  system       FlowTrainSystem: the decoupled trainer (and the monolithic arms) as a System
  profile      the allocator run: profile each candidate split, choose one; matmul peak
  report       the metrics row of a step and the run's summary

The ``flowtrain`` and ``bench_packing`` experiments live in ``jaxflow/main/``.
"""

from jaxflow.flow.allocator import Allocation, ParallelConfig, allocate
from jaxflow.flow.batching import LAYOUTS, PackingConfig
from jaxflow.flow.decoupled import DecoupledTrainer
from jaxflow.flow.digits_data import DigitsConfig, Sample, heldout_samples, step_samples
from jaxflow.flow.monolithic import MonolithicTrainer
from jaxflow.flow.packing import ALGORITHMS, CostModel, OverBudgetError, Packing, pack
from jaxflow.flow.pool import EmbeddingPool, PoolClosed
from jaxflow.flow.system import MODES, FlowTrainState, FlowTrainSystem
from jaxflow.flow.vit import PatchBatch, ViTConfig, ViTEncoder, pack_patches

__all__ = [
    "DigitsConfig", "Sample", "heldout_samples", "step_samples",
    "ViTConfig", "ViTEncoder", "PatchBatch", "pack_patches",
    "ALGORITHMS", "CostModel", "OverBudgetError", "Packing", "pack",
    "LAYOUTS", "PackingConfig",
    "EmbeddingPool", "PoolClosed",
    "MonolithicTrainer", "DecoupledTrainer",
    "Allocation", "ParallelConfig", "allocate",
    "MODES", "FlowTrainState", "FlowTrainSystem",
]
