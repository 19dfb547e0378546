"""lm_pretrain: the decoder LM on multi-digit addition (character tokens), held-out exact match.

    python -m jaxflow.run --exp=lm_pretrain --variant=quick
    python -m jaxflow.run --exp=lm_pretrain --variant=default --set train.steps=3000
    python -m jaxflow.run --exp=lm_pretrain --variant=quick --devices=8 --set mesh.shape=4,2
    python -m jaxflow.run --exp=lm_pretrain --variant=full --compile-only --target=tpu-v5p:4x4x4
    python -m jaxflow.run --exp=lm_pretrain --variant=quick --set model.lora.rank=8   # LoRA adapters only

``full`` is Meta-Llama-3-8B (bf16, remat per block, the blocks as one ``lax.scan``) on 256
sequences of 4096 tokens per step, sharded ZeRO-3 style over "fsdp" (every device): the batch,
and the MLP-hidden and vocab dimensions of the weights, the attention projections' model
dimension, and their AdamW moments (``jaxflow.mesh.DEFAULT_RULES``); the loss is taken by vocab
tiles of the head (``train.fused_loss``: no [B, L, V] float32 logits).
``--set mesh.shape=1,8,8`` adds 8-way tensor parallelism. On a v5p:4x4x4 pod that is 4
sequences per chip and 14.1 GiB of 95 GiB HBM per chip (``--compile-only``, jax 0.10.2; 46.6
with the layers unrolled, the attention weights replicated and the logits held). The
variant states the model and the global batch; ``--compile-only --target=T`` lays it out for T
(:mod:`jaxflow.compile_only.variants`): FSDP over every device and gradient accumulation
(``train.microbatches``) until the HBM estimate fits; on 8 x H100 that is FSDP 8 with remat
and 4 micro-batches of 8 sequences per GPU (32 sequences at once with the logits held needed
172 GiB per GPU: their float32 logits alone are 63 GiB).

``full_70b`` is the same step with Meta-Llama-3-70B, for ``--compile-only`` (the 70B rows
beside MaxText's published MFU in docs/api/compile_only.md).

The RL experiments warm-start from this run's checkpoint.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, SEED, Int, domains
from jaxflow.data.arithmetic import AdditionTask
from jaxflow.mesh import MeshConfig
from jaxflow.models.architectures import shipped_config
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "decoder LM pretraining on multi-digit addition; loss + held-out exact-match accuracy"
ENTRY = "jaxflow.main.lm_pretrain:main"
HEADLINES = "jaxflow.study.headlines_rl:lm_pretrain"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.lora",)


@domains(max_digits=COUNT, heldout_mod=Int(2))
@dataclasses.dataclass(frozen=True)
class DataConfig:
    max_digits: int = 3
    heldout_mod: int = 20
    loss_on: str = "answer"  # "answer": score answer digits + EOS; "all": every token

    def __post_init__(self):
        if self.loss_on not in ("answer", "all"):
            raise ValueError(f"data.loss_on={self.loss_on!r}; valid: answer, all")
        AdditionTask(max_digits=self.max_digits, heldout_mod=self.heldout_mod)  # their ranges


@domains(steps=COUNT, batch_size=COUNT, seq_len=COUNT, log_every=COUNT, eval_every=COUNT, eval_examples=COUNT,
         checkpoint_every=COUNT, keep_checkpoints=COUNT, microbatches=COUNT)
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 64
    seq_len: int = 96
    log_every: int = 20
    eval_every: int = 500
    eval_examples: int = 512
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    # gradient accumulation: each step's batch in this many micro-batches (one update); a
    # ``full`` variant compiled for a target gets it from the target's layout
    # (jaxflow.compile_only.resolve)
    microbatches: int = 1
    # the loss from the final hidden states and the head by vocab tiles (no [B, L, V] logits:
    # jaxflow.train.lm_state.make_train_step's ``fused_loss``); the full variants' choice
    fused_loss: bool = False

    def __post_init__(self):
        require_positive(self, "steps", "batch_size", "seq_len", "log_every", "eval_every",
                         "eval_examples", "checkpoint_every", "keep_checkpoints", "microbatches")
        if self.batch_size % self.microbatches:
            raise ValueError(f"train.microbatches={self.microbatches} does not divide "
                             f"train.batch_size={self.batch_size}; valid: a divisor of it")


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    model: TransformerConfig = TransformerConfig(
        vocab_size=23, d_model=128, n_layers=3, n_heads=4, n_kv_heads=4, d_ff=384, max_seq_len=128
    )
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}; valid: train.seq_len <= model.max_seq_len")


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, steps=400, batch_size=32, eval_every=200,
                                  eval_examples=256, checkpoint_every=200),
    )


def _full() -> Config:
    """Llama-3-8B at production size: FSDP over every device (see the module docstring)."""
    base = Config()
    return dataclasses.replace(
        base,
        model=shipped_config("llama-3-8b", max_seq_len=4096, remat=True, scan_layers=True),
        data=dataclasses.replace(base.data, max_digits=5),
        train=dataclasses.replace(base.train, steps=20000, batch_size=256, seq_len=4096,
                                  eval_every=2000, checkpoint_every=2000, fused_loss=True),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95),
        mesh=MeshConfig(axes=("data", "fsdp", "model"), shape=(1, -1, 1)),
    )


def _full_70b() -> Config:
    """``full`` with Meta-Llama-3-70B (80 layers, d 8192): the 70B row of the efficiency table
    beside MaxText's (``--compile-only`` only; laid out per target like ``full``)."""
    base = _full()
    return dataclasses.replace(base, model=shipped_config("llama-3-70b", max_seq_len=4096,
                                                          remat=True, scan_layers=True))


get_config = Variants(quick=_quick, default=Config, full=_full, full_70b=_full_70b)
VARIANTS = get_config.variants
