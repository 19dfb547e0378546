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
import os
from typing import Any

import numpy as np

from jaxflow.config import ConfigError
from jaxflow.errors import FileFormatError, one_line, read_text
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


#: The dtypes a checkpoint loads into (parameters and compute), as TransformerConfig names them.
LOAD_DTYPES = ("float32", "bfloat16")

_REQUIRED = object()
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
               float: "number", type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed JSON value's type ("object", "array", "string", ...)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def dtype_name(dtype: Any, *, what: str = "dtype") -> str | None:
    """``dtype`` as its name in :data:`LOAD_DTYPES` ("float32" | "bfloat16"); None stays None.

    Accepts the name, a jnp / numpy scalar type (``jnp.float32``, ``np.float32``,
    ``jnp.bfloat16``) or a ``np.dtype``. ConfigError naming ``what`` and the valid names
    otherwise."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else None
    if name is None:
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError, KeyError, AttributeError):
            name = None
    if name not in LOAD_DTYPES:
        raise ConfigError(f"{what}={dtype!r} is not a supported dtype; valid: "
                          f"{', '.join(LOAD_DTYPES)} (as a string, a jnp / numpy dtype or a "
                          "np.dtype)")
    return name


def read_json_object(path: str, *, what: str) -> dict[str, Any]:
    """The JSON object in file ``path`` (read as UTF-8, a byte-order mark dropped).

    Raises:
      CheckpointError: ``path`` missing, not UTF-8, not JSON (names the line and column), or
        not a JSON object at the top level.
    """
    try:
        text = read_text(path, what=what)
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path!r} is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}") from None
    except RecursionError:
        raise CheckpointError(f"{what} {path!r} is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path!r} holds a JSON {json_type(data)} at "
                              "the top level; valid: a JSON object ({...})")
    return data


def _show(value: Any) -> str:
    """A config value as JSON, cut to keep messages one short line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _lookup(cfg: dict, key: str, default: Any) -> tuple[bool, Any]:
    """(found, value): null counts as absent when there is a default."""
    if key not in cfg or (cfg[key] is None and default is not _REQUIRED):
        return False, default
    return True, cfg[key]


def _int(cfg: dict, key: str, source: str, default: Any = _REQUIRED, *, minimum: int = 1,
         label: str | None = None) -> int:
    """``cfg[key]`` as an int >= ``minimum`` (``default`` when absent or null)."""
    label = label or key
    found, value = _lookup(cfg, key, default)
    if not found and default is _REQUIRED:
        raise CheckpointError(f"{source} lacks {label}; valid: an integer >= {minimum}")
    if found and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise CheckpointError(f"{source} {label}={_show(value)}; valid: an integer >= {minimum}")
    return value


def _positive(cfg: dict, key: str, source: str, default: Any = _REQUIRED, *,
              label: str | None = None) -> float:
    """``cfg[key]`` as a finite float > 0 (``default`` when absent or null)."""
    label = label or key
    found, value = _lookup(cfg, key, default)
    if not found and default is _REQUIRED:
        raise CheckpointError(f"{source} lacks {label}; valid: a finite number > 0")
    if found and (isinstance(value, bool) or not isinstance(value, (int, float))
                  or not math.isfinite(value) or value <= 0):
        raise CheckpointError(f"{source} {label}={_show(value)}; valid: a finite number > 0")
    return float(value)


def _bool(cfg: dict, key: str, source: str, default: bool) -> bool:
    found, value = _lookup(cfg, key, default)
    if found and not isinstance(value, bool):
        raise CheckpointError(f"{source} {key}={_show(value)}; valid: true or false")
    return value


def _rope(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either the classic rope_theta / rope_scaling keys or the newer
    rope_parameters dict."""
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise CheckpointError(f"{source} {key}={_show(cfg[key])}; valid: an object or null")
    params = cfg.get("rope_parameters") or {}
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    scaling = cfg.get("rope_scaling") or params
    if "rope_theta" in params:
        theta = _positive(params, "rope_theta", source, label="rope_parameters.rope_theta")
    else:
        theta = _positive(cfg, "rope_theta", source, 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{source} rope scaling type {_show(kind)} is not supported; "
                              "supported: 'default', 'llama3'")
    values = {key: _positive(scaling, key, source, label=f"{where}.{key}")
              for key in ("factor", "low_freq_factor", "high_freq_factor")}
    original = _int(scaling, "original_max_position_embeddings", source,
                    label=f"{where}.original_max_position_embeddings")
    try:
        return theta, RopeScaling(kind="llama3", original_max_len=original, **values)
    except ValueError as e:
        raise CheckpointError(f"{source} {where}: {one_line(e)}") from None


def _moe_fields(cfg: dict, source: str, n_layers: int) -> dict[str, Any]:
    """The TransformerConfig MoE fields of a Qwen3MoeForCausalLM config.json."""
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    n_experts = _int(cfg, key, source, label="num_experts (or num_local_experts)")
    per_token = _int(cfg, "num_experts_per_tok", source)
    if per_token > n_experts:
        raise CheckpointError(f"{source} num_experts_per_tok={per_token} exceeds {key}="
                              f"{n_experts}; valid: 1..{n_experts}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in dense):
        raise CheckpointError(f"{source} mlp_only_layers={_show(dense)}; valid: a list of "
                              f"layer indices in 0..{n_layers - 1}")
    return dict(n_experts=n_experts, n_experts_per_token=per_token,
                d_ff_expert=_int(cfg, "moe_intermediate_size", source),
                norm_topk_prob=_bool(cfg, "norm_topk_prob", source, False),
                moe_every=_int(cfg, "decoder_sparse_step", source, 1),
                dense_layers=tuple(dense))


def _architecture(cfg: dict, source: str) -> str:
    """The supported "architectures" entry of a config.json."""
    archs = cfg.get("architectures")
    archs = [] if archs is None else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{source} architectures={_show(archs)}; valid: a list of class "
                              f"names, supported: {sorted(ARCHITECTURES)}")
    names = [a for a in archs if a in ARCHITECTURES]
    if not names:
        raise CheckpointError(
            f"{source} architectures={archs!r} (model_type {cfg.get('model_type')!r}) is not "
            f"supported; supported: {sorted(ARCHITECTURES)} (model_type "
            f"{', '.join(sorted(_HF_CLASS))})")
    return names[0]


def config_from_hf(cfg: dict[str, Any], *, dtype: Any = None,
                   source: str = "config.json") -> TransformerConfig:
    """TransformerConfig for a parsed config.json; CheckpointError for what is unsupported or
    invalid (a missing, non-integer or non-positive size, sizes that do not divide), naming
    ``source`` (the file) and the field.

    ``dtype`` ("float32" | "bfloat16", or the jnp / numpy dtype) sets param and compute dtype;
    None: the checkpoint's ``torch_dtype`` / ``dtype`` when it is one of those, else float32.
    """
    dtype = dtype_name(dtype)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source} holds a JSON {json_type(cfg)} at "
                              "the top level; valid: a JSON object ({...})")
    hf_class = _architecture(cfg, source)
    arch = ARCHITECTURES[hf_class]
    for key, bad in (("attention_bias", True), ("mlp_bias", True), ("use_sliding_window", True)):
        if cfg.get(key) == bad:
            raise CheckpointError(f"{source} {key}={bad} is not supported for {hf_class}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source} hidden_act={_show(cfg['hidden_act'])}; only 'silu' "
                              "(SwiGLU) is supported")
    if dtype is None:
        stored = cfg.get("dtype") or cfg.get("torch_dtype")
        dtype = stored if stored in LOAD_DTYPES else "float32"
    theta, scaling = _rope(cfg, source)
    sizes = {key: _int(cfg, key, source) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads")}
    d_model, n_heads = sizes["hidden_size"], sizes["num_attention_heads"]
    n_kv_heads = _int(cfg, "num_key_value_heads", source, n_heads)
    if n_heads % n_kv_heads:
        raise CheckpointError(f"{source} num_key_value_heads={n_kv_heads} does not divide "
                              f"num_attention_heads={n_heads}; valid: a divisor of {n_heads}")
    head_dim = _int(cfg, "head_dim", source, None)
    if head_dim is None and d_model % n_heads:
        raise CheckpointError(f"{source} hidden_size={d_model} is not divisible by "
                              f"num_attention_heads={n_heads} and there is no head_dim; valid: "
                              "a multiple of num_attention_heads, or a head_dim")
    if (head_dim or d_model // n_heads) % 2:
        raise CheckpointError(f"{source} head dim {head_dim or d_model // n_heads} "
                              f"({'head_dim' if head_dim else 'hidden_size / num_attention_heads'})"
                              " is odd; valid: an even head dim (RoPE rotates pairs)")
    n_layers = sizes["num_hidden_layers"]
    moe = _moe_fields(cfg, source, n_layers) if arch == "qwen3_moe" else {}
    extra = tuple(sorted((k, json.dumps(v)) for k, v in cfg.items() if k not in _MODELLED))
    override = head_dim if head_dim and (head_dim != d_model // n_heads or d_model % n_heads) \
        else None
    fields = dict(max_seq_len=_int(cfg, "max_position_embeddings", source, 2048),
                  norm_eps=_positive(cfg, "rms_norm_eps", source, 1e-6),
                  tie_embeddings=_bool(cfg, "tie_word_embeddings", source, False))
    try:
        return TransformerConfig(
            vocab_size=sizes["vocab_size"], d_model=d_model, n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=sizes["intermediate_size"],
            rope_theta=theta, rope_scaling=scaling, dtype=dtype, param_dtype=dtype,
            head_dim_override=override, qk_norm=arch in ("qwen3", "qwen3_moe"),
            architecture=arch, hf_extra=extra, **fields, **moe)
    except ValueError as e:  # what the checks above do not cover, still naming the file
        raise CheckpointError(f"{source}: {one_line(e)}") from None


def read_config(path: str) -> dict[str, Any]:
    """Parsed ``path/config.json``; CheckpointError naming the file when absent or bad."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} does not exist; a checkpoint directory needs config.json "
                              "and *.safetensors files")
    return read_json_object(file, what="checkpoint config")


def read_transformer_config(path: str, *, dtype: Any = None) -> TransformerConfig:
    """The TransformerConfig of checkpoint directory ``path`` (its config.json through
    :func:`config_from_hf`); CheckpointError naming the file and the field when it is bad."""
    return config_from_hf(read_config(path), dtype=dtype,
                          source=os.path.join(path, "config.json"))


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
SHIPPED_CONFIGS = ("qwen3-8b", "llama-3-8b", "llama-3-70b")


def shipped_config(name: str, *, dtype: Any = None, **changes) -> TransformerConfig:
    """The TransformerConfig of a config.json kept in ``configs/hf/NAME.json`` (values as
    published with the checkpoint: Qwen3-8B, Meta-Llama-3-8B, Meta-Llama-3-70B), through :func:`config_from_hf`;
    ``changes`` replace fields after (e.g. ``n_layers=2``, ``max_seq_len``, ``remat=True``)."""
    import importlib.resources

    if name not in SHIPPED_CONFIGS:
        raise ValueError(f"unknown shipped config {name!r}; valid: {', '.join(SHIPPED_CONFIGS)}")
    text = importlib.resources.files("configs").joinpath("hf", f"{name}.json").read_text("utf-8")
    return dataclasses.replace(config_from_hf(json.loads(text), dtype=dtype), **changes)
