"""Decoder-only LM (flax nnx) and its jitted KV-cache sampler."""
from jaxflow.models.kv_cache import KVCache
from jaxflow.models.sampler import SampleOutput, SamplingConfig, make_sampler, sample
from jaxflow.models.transformer import (
    PRESETS,
    Transformer,
    TransformerConfig,
    logical_axes,
    param_count,
)

__all__ = [
    "KVCache",
    "PRESETS",
    "SampleOutput",
    "SamplingConfig",
    "Transformer",
    "TransformerConfig",
    "logical_axes",
    "make_sampler",
    "param_count",
    "sample",
]
