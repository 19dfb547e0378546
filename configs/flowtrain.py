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
    python -m jaxflow.run --exp=flowtrain --variant=full --compile-only --target=tpu-v5p:4x4x4

Across processes (``--coordinator`` / ``--num-processes`` / ``--process-id``, one per host) the
same run spans the global device set: each process gives the encoder and the backbone the same
number of its own devices (jaxflow.mesh.process_role_meshes), so the allocator only considers
encoder counts that are multiples of the process count, and it picks process 0's measured
split on every process. 2 processes x 4 CPU devices give the figures of 1 x 8 (the losses
within f32 rounding: gloo sums the cross-process all-reduces in another order).

``full`` is the production size: a ViT-L/14 encoder (24 blocks, width 1024, 16 heads, SwiGLU MLP
4096; grayscale digits at 112-336 px, so 64-576 patches per image, a 336 px image like
ViT-L/14-336) feeding Meta-Llama-3-8B (its config.json, vocabulary included; the character
tokenizer uses its first ids), both computing in bf16 on float32 master weights with every block
rematerialised (the encoder's and the backbone's blocks each run as one scan over the layers,
``scan_layers``); 256 samples per step packed into rows of up to 4096 tokens (image tokens
included). Sharding
(``mesh`` data x model, TP over heads / mlp / vocab by the logical rules): the monolithic
baselines run on all devices as data x 8-way model (on a v5p:4x4x4 pod 8 x 8, on 8 GPUs 1 x 8);
the decoupled candidates give the encoder 4 or 8 devices (data parallel, replicated weights) and
the backbone the rest as data x 4 or data x 8 (64 chips: 4 + 15x4, 8 + 14x4, 8 + 7x8; 8 GPUs: 4
+ 1x4). It needs a multiple of 8 devices. With ``--compile-only --target=T`` the target lays it
out instead (``jaxflow.compile_only.resolve_flow.flow_layout``, keys set by ``--set mesh.*`` /
``allocator.*`` kept): the smallest TP widths whose HBM estimate fits, on v5p:4x4x4 a 16 x 4
monolithic mesh and the splits 4 + 30x2, 8 + 28x2; v6e:16x16 and 8 x H100 / H200 exit 2 (the
padded step's 256 rows of up to 2,560 tokens need more than 8-way TP gives; v5p:4x4x4 fits).
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, SEED, domains
from jaxflow.flow.batching import PackingConfig
from jaxflow.flow.digits_data import FLOW_ALPHABET, DigitsConfig
from jaxflow.flow.vit import ViTConfig
from jaxflow.mesh import MeshConfig
from jaxflow.models.architectures import shipped_config
from jaxflow.models.attention_backends import ATTENTION_BACKENDS
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("decoupled ViT/LM training on multi-image digits: padded vs packed vs decoupled "
               "samples/s, padding waste, cost imbalance, allocator, held-out accuracy")
ENTRY = "jaxflow.main.flowtrain:main"
HEADLINES = "jaxflow.study.headlines_systems:flowtrain"
VOCAB = len(FLOW_ALPHABET) + 3


@domains(run_ahead=COUNT0, pool_capacity=COUNT, encoder_devices=COUNT0)
@dataclasses.dataclass(frozen=True)
class FlowConfig:
    run_ahead: int = 0  # encoder may run this many steps ahead (0 = strict)
    pool_capacity: int = 256  # samples held in the embedding pool
    encoder_devices: int = 0  # 0: the allocator decides
    # The attention of the backbone (causal) and of the ViT encoder (bidirectional within each
    # image) (jaxflow.models.attention_backends): auto | xla | splash (TPU) | flash | cudnn
    # (GPU); auto is xla on CPU.
    attention: str = "auto"

    def __post_init__(self):
        if self.run_ahead < 0:
            raise ValueError(f"flow.run_ahead={self.run_ahead}; must be >= 0")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"flow.attention={self.attention!r}; valid: "
                             f"{', '.join(ATTENTION_BACKENDS)}")


@domains(encoder_candidates=COUNT, backbone_model_degrees=COUNT, profile_repeats=COUNT)
@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    encoder_candidates: tuple[int, ...] = (1, 2, 4)
    backbone_model_degrees: tuple[int, ...] = (1,)
    profile_repeats: int = 3


@domains(batch_size=COUNT, warmup_rounds=COUNT0, rounds=COUNT, block_steps=COUNT, eval_examples=COUNT)
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32  # samples per global step (every mode)
    warmup_rounds: int = 1  # untimed rounds (compilation) before the timed ones
    rounds: int = 10  # timed rounds; each runs every mode for block_steps steps
    block_steps: int = 2  # > flow.run_ahead: the encoder runs ahead within a block only
    eval_examples: int = 128


@domains(seed=SEED, devices=COUNT)
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
        if self.vit.patch_size != self.data.patch_size or self.vit.max_grid < self.data.max_grid:
            raise ValueError(f"vit.patch_size={self.vit.patch_size}, vit.max_grid="
                             f"{self.vit.max_grid}: need data.patch_size={self.data.patch_size} "
                             f"and max_grid >= {self.data.max_grid} (the largest image's grid)")


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
    """ViT-L/14 + Llama-3-8B at production sizes (see the module docstring)."""
    llama = shipped_config("llama-3-8b", dtype="float32", remat=True, scan_layers=True)
    return Config(
        data=DigitsConfig(patch_size=14, sizes=(112, 168, 224, 280, 336),
                          size_weights=(4.0, 3.0, 2.0, 1.5, 1.0)),
        vit=ViTConfig(patch_size=14, max_grid=24, d_model=1024, n_layers=24, n_heads=16,
                      d_ff=4096, out_dim=llama.d_model, dtype="bfloat16", remat=True,
                      scan_layers=True),
        model=dataclasses.replace(llama, dtype="bfloat16"),  # bf16 compute, f32 master weights
        packing=PackingConfig(token_budget=4096, row_granularity=512),
        flow=FlowConfig(pool_capacity=512),
        allocator=AllocatorConfig(encoder_candidates=(4, 8), backbone_model_degrees=(4, 8),
                                  profile_repeats=2),
        train=TrainConfig(batch_size=256, warmup_rounds=1, rounds=20, block_steps=2,
                          eval_examples=256),
        optim=OptimConfig(lr=2e-5, warmup_steps=10),
        mesh=MeshConfig(axes=("data", "model"), shape=(-1, 8)))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
