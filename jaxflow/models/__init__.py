"""Decoder-only LM (flax nnx), its jitted KV-cache sampler (``decode_kernel``: its decode through
a paged decode kernel on TPU / GPU, ``DecodeKernel``), per-token log-probs of a sequence
(``token_logprobs``), LoRA adapters on its projections (``LoraConfig``, ``merge``), and Hugging
Face checkpoints in and out (Llama-3, Qwen3, Qwen3-MoE; adapters are merged and also written as a
PEFT adapter; ``export_hf`` adds the source checkpoint's tokenizer files)."""
from jaxflow.models.architectures import CheckpointError, config_from_hf, hf_config_from
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.hf_checkpoint import from_pretrained, load_hf_params, save_pretrained
from jaxflow.models.hf_export import export_hf
from jaxflow.models.kv_cache import KVCache
from jaxflow.models.logprobs import predicted_mask, token_logprobs
from jaxflow.models.lora import LoraConfig
from jaxflow.models.lora import merge as merge_lora
from jaxflow.models.rope import RopeScaling
from jaxflow.models.sampler import SampleOutput, SamplingConfig, make_sampler, sample
from jaxflow.models.tokenizer_hf import HFTokenizer, TransformersTokenizer
from jaxflow.models.transformer import (
    PRESETS,
    Transformer,
    TransformerConfig,
    logical_axes,
    param_count,
)

__all__ = [
    "CheckpointError",
    "HFTokenizer",
    "TransformersTokenizer",
    "RopeScaling",
    "config_from_hf",
    "DecodeKernel",
    "export_hf",
    "from_pretrained",
    "hf_config_from",
    "load_hf_params",
    "save_pretrained",
    "KVCache",
    "LoraConfig",
    "merge_lora",
    "PRESETS",
    "SampleOutput",
    "SamplingConfig",
    "Transformer",
    "TransformerConfig",
    "logical_axes",
    "make_sampler",
    "param_count",
    "predicted_mask",
    "sample",
    "token_logprobs",
]
