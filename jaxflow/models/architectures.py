"""Hugging Face checkpoint families as TransformerConfigs, and their tensor names and layouts.

Supported ``config.json`` architectures: ``LlamaForCausalLM`` (Llama 2/3, incl. Llama-3.1's
"llama3" RoPE scaling), ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM``. Everything here is
host-side metadata (no arrays): :func:`config_from_hf` / :func:`hf_config_from` translate
configs, :func:`tensor_map` says which checkpoint tensors make each jaxflow parameter.

Layouts: a Hugging Face linear weight is ``[out_features, in_features]``; jaxflow keeps
``[in, out]`` with the head axes split out (``wq [d, heads, head_dim]``, ``wo [heads,
head_dim, d]``), so a parameter is the checkpoint tensor transposed then reshaped. Qwen3-MoE
experts are stored per expert (``mlp.experts.{e}.gate_proj.weight``) and stacked on a leading
expert axis in jaxflow (``mlp.w_gate [E, d, f]``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxflow.errors import FileFormatError
from jaxflow.models.rope import RopeScaling
from jaxflow.models.transformer import TransformerConfig

#: config.json "architectures" entry -> jaxflow architecture name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_CLASS = {v: k for k, v in ARCHITECTURES.items()}

# Keys translated into TransformerConfig fields (everything else is kept in hf_extra).
_MODELLED = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "use_sliding_window",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "torch_dtype", "dtype",
}


class CheckpointError(FileFormatError):
    """A checkpoint directory jaxflow cannot load (names the file, key or tensor)."""


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the classic rope_theta / rope_scaling keys or the newer
    rope_parameters dict."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"config.json rope scaling type {kind!r} is not supported; "
                              "supported: 'default', 'llama3'")
    return theta, RopeScaling(
        kind="llama3", factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_len=int(scaling["original_max_position_embeddings"]))


def config_from_hf(cfg: dict[str, Any], *, dtype: str | None = None) -> TransformerConfig:
    """TransformerConfig for a parsed config.json; CheckpointError for what is unsupported.

    ``dtype`` ("float32" | "bfloat16") sets param and compute dtype; None: the checkpoint's
    ``torch_dtype`` / ``dtype`` when it is one of those, else float32.
    """
    archs = cfg.get("architectures") or []
    names = [a for a in archs if a in ARCHITECTURES]
    if not names:
        raise CheckpointError(
            f"config.json architectures={archs!r} (model_type {cfg.get('model_type')!r}) is not "
            f"supported; supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[names[0]]
    for key, bad in (("attention_bias", True), ("mlp_bias", True), ("use_sliding_window", True)):
        if cfg.get(key) == bad:
            raise CheckpointError(f"config.json {key}={bad} is not supported for {names[0]}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act={cfg['hidden_act']!r}; only 'silu' "
                              "(SwiGLU) is supported")
    if dtype is None:
        stored = cfg.get("dtype") or cfg.get("torch_dtype")
        dtype = stored if stored in ("float32", "bfloat16") else "float32"
    theta, scaling = _rope(cfg)
    n_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")
    d_model = int(cfg["hidden_size"])
    moe = {}
    if arch == "qwen3_moe":
        n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if n_experts is None:
            raise CheckpointError("config.json of Qwen3MoeForCausalLM lacks num_experts")
        moe = dict(n_experts=int(n_experts),
                   n_experts_per_token=int(cfg["num_experts_per_tok"]),
                   d_ff_expert=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   moe_every=int(cfg.get("decoder_sparse_step", 1)),
                   dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
    extra = tuple(sorted((k, json.dumps(v)) for k, v in cfg.items() if k not in _MODELLED))
    return TransformerConfig(
        vocab_size=int(cfg["vocab_size"]), d_model=d_model,
        n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        d_ff=int(cfg["intermediate_size"]),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        dtype=dtype, param_dtype=dtype,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim_override=(int(head_dim) if head_dim and int(head_dim) != d_model // n_heads
                           else None),
        qk_norm=arch in ("qwen3", "qwen3_moe"), architecture=arch, hf_extra=extra, **moe)


def hf_config_from(config: TransformerConfig) -> dict[str, Any]:
    """config.json contents for ``config`` (its ``architecture`` picks the family; jaxflow's
    own dense decoder, architecture "jaxflow", is exactly a Llama and is written as one)."""
    arch = config.architecture
    if arch == "jaxflow" and not config.qk_norm and not config.n_experts:
        arch = "llama"
    if arch not in _HF_CLASS:
        raise CheckpointError(f"TransformerConfig.architecture={arch!r} has no Hugging Face "
                              f"format; valid: {sorted(_HF_CLASS)}")
    if config.qk_norm != (arch in ("qwen3", "qwen3_moe")):
        raise CheckpointError(f"qk_norm={config.qk_norm} does not match architecture {arch!r}")
    if (config.n_experts > 0) != (arch == "qwen3_moe"):
        raise CheckpointError(f"n_experts={config.n_experts} does not match architecture "
                              f"{arch!r}")
    out: dict[str, Any] = {k: json.loads(v) for k, v in config.hf_extra}
    out.update(
        architectures=[_HF_CLASS[arch]], model_type=arch, vocab_size=config.vocab_size,
        hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
        hidden_act="silu", attention_bias=False, dtype=config.param_dtype)
    if arch == "llama":
        out["mlp_bias"] = False
    if config.rope_scaling is not None:
        s = config.rope_scaling
        out["rope_scaling"] = dict(rope_type=s.kind, factor=s.factor,
                                   low_freq_factor=s.low_freq_factor,
                                   high_freq_factor=s.high_freq_factor,
                                   original_max_position_embeddings=s.original_max_len)
    else:
        out["rope_scaling"] = None
    if arch == "qwen3_moe":
        out.update(num_experts=config.n_experts, num_experts_per_tok=config.n_experts_per_token,
                   moe_intermediate_size=config.d_ff_expert,
                   norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.moe_every,
                   mlp_only_layers=list(config.dense_layers))
    return out


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one jaxflow parameter comes from.

    hf_names: one checkpoint tensor, or one per expert (stacked on jaxflow's leading axis).
    transpose: the checkpoint tensor is a [out, in] linear weight; jaxflow's block is
      ``tensor.T.reshape(block_shape)`` where the first ``split`` block dims form ``in``.
      False: the block is the tensor itself (embeddings, norm scales).
    """

    hf_names: tuple[str, ...]
    transpose: bool
    split: int = 1
    stacked: bool = False


def tensor_map(config: TransformerConfig) -> dict[tuple[str, ...], TensorSource]:
    """{jaxflow parameter path (as in nnx.to_pure_dict, ints as str) -> TensorSource}."""
    m: dict[tuple[str, ...], TensorSource] = {
        ("embedding",): TensorSource(("model.embed_tokens.weight",), False),
        ("final_norm", "scale"): TensorSource(("model.norm.weight",), False),
    }
    if not config.tie_embeddings:
        m[("lm_head",)] = TensorSource(("lm_head.weight",), True)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        layer = ("layers", str(i))
        m[layer + ("attn_norm", "scale")] = TensorSource((p + "input_layernorm.weight",), False)
        m[layer + ("mlp_norm", "scale")] = TensorSource(
            (p + "post_attention_layernorm.weight",), False)
        for ours, theirs, split in (("wq", "q_proj", 1), ("wk", "k_proj", 1),
                                    ("wv", "v_proj", 1), ("wo", "o_proj", 2)):
            m[layer + ("attn", ours)] = TensorSource((p + f"self_attn.{theirs}.weight",), True,
                                                     split)
        if config.qk_norm:
            for n in ("q_norm", "k_norm"):
                m[layer + ("attn", n, "scale")] = TensorSource((p + f"self_attn.{n}.weight",),
                                                               False)
        if config.is_moe_layer(i):
            m[layer + ("mlp", "router")] = TensorSource((p + "mlp.gate.weight",), True)
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                 ("w_down", "down_proj")):
                names = tuple(f"{p}mlp.experts.{e}.{theirs}.weight"
                              for e in range(config.n_experts))
                m[layer + ("mlp", ours)] = TensorSource(names, True, 1, stacked=True)
        else:
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                                 ("w_down", "down_proj")):
                m[layer + ("mlp", ours)] = TensorSource((p + f"mlp.{theirs}.weight",), True)
    return m


def hf_shape(source: TensorSource, block_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Checkpoint tensor shape of one block (one expert when stacked)."""
    if not source.transpose:
        return tuple(block_shape)
    inner, outer = block_shape[:source.split], block_shape[source.split:]
    return (math.prod(outer), math.prod(inner))


#: Checkpoint tensors that are derived buffers, not parameters (older exports include them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


#: The Hugging Face config.json files kept in ``configs/hf`` (the ``full`` variants' models).
SHIPPED_CONFIGS = ("qwen3-8b", "llama-3-8b")


def shipped_config(name: str, *, dtype: str | None = None, **changes) -> TransformerConfig:
    """The TransformerConfig of a config.json kept in ``configs/hf/NAME.json`` (values as
    published with the checkpoint: Qwen3-8B, Meta-Llama-3-8B), through :func:`config_from_hf`;
    ``changes`` replace fields after (e.g. ``n_layers=2``, ``max_seq_len``, ``remat=True``)."""
    import importlib.resources

    if name not in SHIPPED_CONFIGS:
        raise ValueError(f"unknown shipped config {name!r}; valid: {', '.join(SHIPPED_CONFIGS)}")
    text = importlib.resources.files("configs").joinpath("hf", f"{name}.json").read_text("utf-8")
    return dataclasses.replace(config_from_hf(json.loads(text), dtype=dtype), **changes)
