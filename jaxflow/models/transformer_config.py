"""The decoder's architecture hyper-parameters: :class:`TransformerConfig` and :data:`PRESETS`.

Validated on construction (every field named in its error); read by
:mod:`jaxflow.models.transformer` (the nnx modules) and :mod:`jaxflow.models.architectures`
(Hugging Face config.json files mapped onto these fields).
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from jaxflow.config_domains import COUNT, COUNT0, POSITIVE, domains
from jaxflow.config_reads import experiment_field
from jaxflow.models.attention_backends import ATTENTION_BACKENDS
from jaxflow.models.lora import TARGETS as LORA_TARGETS
from jaxflow.models.lora import LoraConfig
from jaxflow.models.moe import MOE_IMPLS
from jaxflow.models.rope import RopeScaling

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LOGICAL_AXIS_NAMES = ("vocab", "embed", "attn_embed", "heads", "kv_heads", "head_dim", "mlp", "norm",
                      "expert")
# What a rematerialised block keeps for the backward pass (``jax.checkpoint_policies``).
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable")


@domains(vocab_size=COUNT, d_model=COUNT, n_layers=COUNT, n_heads=COUNT, n_kv_heads=COUNT, d_ff=COUNT,
         max_seq_len=COUNT, rope_theta=POSITIVE, norm_eps=POSITIVE, head_dim_override=COUNT, n_experts=COUNT0,
         n_experts_per_token=COUNT, d_ff_expert=COUNT0, moe_every=COUNT, dense_layers=COUNT0,
         capacity_factor=POSITIVE)
@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture hyper-parameters; validated on construction."""

    vocab_size: int = 32
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4  # grouped-query attention when < n_heads (must divide n_heads)
    d_ff: int = 512  # SwiGLU hidden size
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    tie_embeddings: bool = False
    head_dim_override: int | None = None  # None: d_model // n_heads (Qwen3 sets its own)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys before RoPE
    rope_scaling: RopeScaling | None = None  # Llama-3.1+ long-context frequency scaling
    remat: bool = False  # rematerialise each block's activations in the backward pass
    # ... keeping what this jax.checkpoint_policies policy saves (REMAT_POLICIES; only with
    # remat=True): "nothing_saveable" recomputes the whole block, "dots_saveable" keeps
    # every matmul output, "dots_with_no_batch_dims_saveable" the weight matmuls only.
    remat_policy: str = "nothing_saveable"
    # Run the blocks of the packed forward (training, log-probs, the VLM backbone) as one
    # ``lax.scan`` over their stacked weights instead of a Python loop: the same arithmetic,
    # compiled once per layer body instead of n_layers times (MaxText's scan_layers). Dense
    # models only; parameters stay stored per layer; KV-cache decoding still loops.
    scan_layers: bool = False
    # Packed causal self-attention backend (jaxflow.models.attention_backends): "auto" is the
    # XLA reference on CPU and the platform's kernel on GPU / TPU where it builds. KV-cache
    # decoding always uses the XLA reference.
    attention: str = "auto"
    # Mixture of experts (Qwen3-MoE); n_experts == 0 means every layer is dense SwiGLU.
    n_experts: int = 0
    n_experts_per_token: int = 2
    d_ff_expert: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not listed here
    moe_impl: str = "dense"  # "dense" reference | "dispatch" (capacity, expert parallel)
    capacity_factor: float = 1.25
    expert_axis: str = "expert"
    architecture: str = "jaxflow"  # checkpoint family written by save_pretrained
    hf_extra: tuple[tuple[str, str], ...] = ()  # other config.json keys (JSON values) kept
    # Experiments only (``--set model.hf_path=DIR``): load this local Hugging Face checkpoint's
    # architecture, weights and tokenizer instead (jaxflow.models.pretrained). The model
    # itself never reads it.
    # Read only by the experiments that list the key in READS (jaxflow.config_reads).
    hf_path: str = experiment_field("")
    # Low-rank adapters on the blocks' projections (jaxflow.models.lora); rank 0 = off. Trained
    # as adapters by jaxflow.train.pretrain and the GRPO trainer: only the experiments that
    # list the key in READS take it.
    lora: LoraConfig = experiment_field(LoraConfig())

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransformerConfig.{name}={value!r}: must be a positive int")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"TransformerConfig.{name}={value!r}: must be > 0")
        if self.head_dim_override is None and self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig.d_model={self.d_model} must be divisible by "
                f"n_heads={self.n_heads} (or set head_dim_override)")
        if self.head_dim_override is not None and (
                not isinstance(self.head_dim_override, int) or self.head_dim_override <= 0):
            raise ValueError(f"TransformerConfig.head_dim_override={self.head_dim_override!r}: "
                             "must be None or a positive int")
        if self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig head_dim={self.head_dim} must be even for RoPE")
        if self.hf_path and not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ValueError(f"model.hf_path={self.hf_path!r}: not a checkpoint directory "
                             "(no config.json there)")
        if self.n_experts:
            if not 1 <= self.n_experts_per_token <= self.n_experts or self.d_ff_expert <= 0:
                raise ValueError(
                    f"TransformerConfig MoE: n_experts_per_token={self.n_experts_per_token} "
                    f"must be in [1, n_experts={self.n_experts}] and d_ff_expert="
                    f"{self.d_ff_expert} > 0")
            if self.moe_impl not in MOE_IMPLS:
                raise ValueError(f"TransformerConfig.moe_impl={self.moe_impl!r}; valid: "
                                 f"{MOE_IMPLS}")
            if not self.capacity_factor > 0 or self.moe_every < 1:
                raise ValueError(f"TransformerConfig.capacity_factor={self.capacity_factor!r} "
                                 f"must be > 0 and moe_every={self.moe_every!r} >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"TransformerConfig.n_kv_heads={self.n_kv_heads} must divide "
                f"n_heads={self.n_heads}")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(
                    f"TransformerConfig.{name}={value!r}: valid values are {sorted(_DTYPES)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"TransformerConfig.attention={self.attention!r}; valid: "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"TransformerConfig.remat_policy={self.remat_policy!r}; valid: "
                             f"{', '.join(REMAT_POLICIES)}")
        if self.scan_layers and self.n_experts:
            raise ValueError(f"TransformerConfig.scan_layers=True needs a dense model (every "
                             f"layer alike); got n_experts={self.n_experts}")
        if not isinstance(self.lora, LoraConfig):
            raise ValueError(f"TransformerConfig.lora={self.lora!r}: need a LoraConfig")
        mlp_targets = [t for t in self.lora.targets if LORA_TARGETS[t][0] == "mlp"]
        if self.lora.enabled and self.n_experts and mlp_targets:
            raise ValueError(f"TransformerConfig.lora.targets={self.lora.targets!r}: an MoE model "
                             f"takes attention adapters only; drop {', '.join(mlp_targets)}")
        if self.remat_policy != REMAT_POLICIES[0] and not self.remat:
            raise ValueError(f"TransformerConfig.remat_policy={self.remat_policy!r} needs "
                             "remat=True (it says what a rematerialised block keeps)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``head_dim_override`` or ``d_model // n_heads``)."""
        return self.head_dim_override or self.d_model // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts instead of SwiGLU."""
        return (self.n_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.moe_every == 0)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The activations' dtype (``dtype``)."""
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self) -> jnp.dtype:
        """The parameters' dtype (``param_dtype``)."""
        return _DTYPES[self.param_dtype]


PRESETS: dict[str, TransformerConfig] = {
    # ~103k params: unit tests.
    "tiny": TransformerConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              d_ff=192, max_seq_len=64),
    # ~2.4M params: CPU experiments.
    "small": TransformerConfig(vocab_size=32, d_model=256, n_layers=4, n_heads=8,
                               n_kv_heads=4, d_ff=512, max_seq_len=256),
    # ~104M params (with a small vocabulary): GPU runs.
    "100m": TransformerConfig(vocab_size=32, d_model=768, n_layers=12, n_heads=12,
                              n_kv_heads=4, d_ff=3072, max_seq_len=1024),
}
