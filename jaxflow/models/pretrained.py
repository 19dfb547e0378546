"""Experiment hook: ``--set model.hf_path=DIR`` swaps an experiment's own small model for a
local Hugging Face checkpoint (architecture, weights and tokenizer.json)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from jax.sharding import Mesh

from jaxflow.mesh import DEFAULT_RULES, LogicalRules
from jaxflow.models.architectures import config_from_hf
from jaxflow.models.hf_checkpoint import load_hf_params, read_config
from jaxflow.models.tokenizer_hf import HFTokenizer
from jaxflow.models.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class HFSource:
    """``hf_path``: a local checkpoint directory (config.json, *.safetensors, tokenizer.json);
    "" keeps the experiment's own model and character tokenizer."""

    hf_path: str = ""

    def __post_init__(self):
        if self.hf_path and not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ValueError(f"model.hf_path={self.hf_path!r}: not a checkpoint directory "
                             "(no config.json there)")


def load_policy(hf_path: str, mesh: Mesh, *, rules: LogicalRules = DEFAULT_RULES,
                dtype: str = "float32") -> tuple[TransformerConfig, Any, HFTokenizer]:
    """(config, params pure dict laid out by ``rules`` on ``mesh`` - the trainers' layout -,
    the checkpoint's tokenizer). RL trainers keep f32 parameters, hence the default dtype."""
    config = dataclasses.replace(config_from_hf(read_config(hf_path), dtype=dtype),
                                 hf_path=hf_path)
    tokenizer = HFTokenizer.from_pretrained(hf_path)
    if config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"{hf_path}: model vocab_size={config.vocab_size} < the tokenizer's "
                         f"{tokenizer.vocab_size}")
    params, _ = load_hf_params(hf_path, config, mesh=mesh, rules=rules)
    return config, params, tokenizer
