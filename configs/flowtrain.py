"""flowtrain: decoupled ViT encoder / LM backbone training with dynamic packing (FlowTrain).

Three modes on the same samples, model, kernels and optimizers, timed side by side in one
process: monolithic_padded (baseline), monolithic_packed, decoupled (allocator-chosen split,
encoder and backbone on disjoint sub-meshes joined by the embedding pool). Runs on every device
present (``devices=N``: the first N); on one device the decoupled sides share it (colocated).
On a CPU-only machine the runner creates 8 fake CPU devices by itself (``--devices=N`` for
another count):

    python -m jaxflow.run --exp=flowtrain --variant=quick
    python -m jaxflow.run --exp=flowtrain --variant=default
    python -m jaxflow.run --exp=flowtrain --variant=quick --set flow.run_ahead=1
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.flow.batching import PackingConfig
from jaxflow.flow.digits_data import FLOW_ALPHABET, DigitsConfig
from jaxflow.flow.vit import ViTConfig
from jaxflow.mesh import MeshConfig
from jaxflow.models.attention_backends import ATTENTION_BACKENDS
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("decoupled ViT/LM training on multi-image digits: padded vs packed vs decoupled "
               "samples/s, padding waste, cost imbalance, allocator, held-out accuracy")
ENTRY = "jaxflow.main.flowtrain:main"
VOCAB = len(FLOW_ALPHABET) + 3


@dataclasses.dataclass(frozen=True)
class FlowConfig:
    run_ahead: int = 0  # encoder may run this many steps ahead (0 = strict)
    pool_capacity: int = 256  # samples held in the embedding pool
    encoder_devices: int = 0  # 0: the allocator decides
    # The backbone's attention (jaxflow.models.attention_backends): auto | xla | splash (TPU)
    # | flash | cudnn (GPU); auto is xla on CPU.
    attention: str = "auto"

    def __post_init__(self):
        if self.run_ahead < 0:
            raise ValueError(f"flow.run_ahead={self.run_ahead}; must be >= 0")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"flow.attention={self.attention!r}; valid: "
                             f"{', '.join(ATTENTION_BACKENDS)}")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    encoder_candidates: tuple[int, ...] = (1, 2, 4)
    backbone_model_degrees: tuple[int, ...] = (1,)
    profile_repeats: int = 3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32  # samples per global step (every mode)
    warmup_rounds: int = 1  # untimed rounds (compilation) before the timed ones
    rounds: int = 10  # timed rounds; each runs every mode for block_steps steps
    block_steps: int = 2  # > flow.run_ahead: the encoder runs ahead within a block only
    eval_examples: int = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """The decoupled producer lives for one timed block (so no mode's work leaks into another
    mode's clock); ``flow.run_ahead`` must therefore be < ``train.block_steps``."""

    seed: int = 0
    data: DigitsConfig = DigitsConfig()
    vit: ViTConfig = ViTConfig(patch_size=4, max_grid=8, d_model=32, n_layers=1, n_heads=2,
                               d_ff=64, out_dim=64)
    model: TransformerConfig = TransformerConfig(vocab_size=VOCAB, d_model=64, n_layers=2,
                                                 n_heads=4, n_kv_heads=2, d_ff=192,
                                                 max_seq_len=512)
    packing: PackingConfig = PackingConfig()
    flow: FlowConfig = FlowConfig()
    allocator: AllocatorConfig = AllocatorConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=20)
    mesh: MeshConfig = MeshConfig(axes=("data",), shape=(-1,))  # monolithic: all of ``devices``
    devices: int | None = None  # None: every device present (8 fake CPU devices on a CPU)

    def __post_init__(self):
        if self.flow.run_ahead >= self.train.block_steps:
            raise ValueError(
                f"flow.run_ahead={self.flow.run_ahead} needs train.block_steps > run_ahead "
                f"(got {self.train.block_steps}); also set --set train.block_steps="
                f"{self.flow.run_ahead + 1}")
        if self.model.attention not in ("auto", self.flow.attention):
            raise ValueError(f"model.attention={self.model.attention!r} conflicts with "
                             f"flow.attention={self.flow.attention!r}; the backbone's attention "
                             "is flow.attention (leave model.attention at 'auto')")
        if self.vit.out_dim != self.model.d_model:
            raise ValueError(f"vit.out_dim={self.vit.out_dim} must equal model.d_model="
                             f"{self.model.d_model}")


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(
        base, allocator=dataclasses.replace(base.allocator, encoder_candidates=(1, 2),
                                            profile_repeats=2),
        train=dataclasses.replace(base.train, rounds=10, block_steps=2, eval_examples=64))


def _default() -> Config:
    base = Config()
    return dataclasses.replace(
        base, packing=dataclasses.replace(base.packing, row_granularity=16),
        train=dataclasses.replace(base.train, rounds=100, block_steps=3, eval_examples=256))


def _full() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, d_model=128, n_layers=4, d_ff=384),
        vit=dataclasses.replace(base.vit, d_model=64, n_layers=2, d_ff=128, out_dim=128),
        allocator=dataclasses.replace(base.allocator, backbone_model_degrees=(1, 2)),
        train=dataclasses.replace(base.train, batch_size=64, rounds=300, block_steps=3,
                                  eval_examples=512))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
