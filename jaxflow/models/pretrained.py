"""Experiment hook: ``--set model.hf_path=DIR`` swaps an experiment's own small model for a
local Hugging Face checkpoint (architecture, weights and tokenizer.json)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from jax.sharding import Mesh

from jaxflow.config import flatten
from jaxflow.config_reads import experiment_field
from jaxflow.mesh import DEFAULT_RULES, LogicalRules
from jaxflow.models.architectures import CheckpointError, read_transformer_config
from jaxflow.models.hf_checkpoint import load_hf_params
from jaxflow.models.tokenizer_hf import HFTokenizer
from jaxflow.models.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class HFSource:
    """``hf_path``: a local checkpoint directory (config.json, *.safetensors, tokenizer.json);
    "" keeps the experiment's own model and character tokenizer."""

    hf_path: str = experiment_field("")  # read by the experiments that list it in READS

    def __post_init__(self):
        if self.hf_path and not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ValueError(f"model.hf_path={self.hf_path!r}: not a checkpoint directory "
                             "(no config.json there)")


def checkpoint_configs(config: Any) -> dict[str, TransformerConfig]:
    """``{dotted key: the checkpoint's TransformerConfig}`` for each ``hf_path`` field of the
    nested dataclass ``config`` that is set: the models a run would load (``--dry-run`` prints
    them). CheckpointError naming the file and field for a bad config.json."""
    return {key: read_transformer_config(path) for key, path in flatten(config).items()
            if key.rpartition(".")[2] == "hf_path" and path}


def load_policy(hf_path: str, mesh: Mesh, *, rules: LogicalRules = DEFAULT_RULES,
                dtype: Any = "float32") -> tuple[TransformerConfig, Any, HFTokenizer]:
    """(config, params pure dict laid out by ``rules`` on ``mesh`` - the trainers' layout -,
    the checkpoint's tokenizer). RL trainers keep f32 parameters, hence the default dtype
    ("float32" | "bfloat16", or the jnp / numpy dtype).

    Raises CheckpointError naming the file and field for a bad config.json, tokenizer or
    weights; everything but the tensor data is checked before any weight is read."""
    config = dataclasses.replace(read_transformer_config(hf_path, dtype=dtype), hf_path=hf_path)
    tokenizer = HFTokenizer.from_pretrained(hf_path)
    if config.vocab_size < tokenizer.vocab_size:
        raise CheckpointError(
            f"{os.path.join(hf_path, 'config.json')} vocab_size={config.vocab_size} is smaller "
            f"than the {tokenizer.vocab_size} tokens of {os.path.join(hf_path, 'tokenizer.json')}"
            "; valid: vocab_size >= the tokenizer's vocabulary")
    params, _ = load_hf_params(hf_path, config, mesh=mesh, rules=rules)
    return config, params, tokenizer
