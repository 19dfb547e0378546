"""Hugging Face checkpoints out: ``save_pretrained(model, dir)``, :func:`write_checkpoint` of a
params tree, and random checkpoints for tests and benchmarks.

A params tree that holds LoRA adapters (``*_lora_a`` / ``*_lora_b`` leaves) is never written as
its base weights alone: the safetensors hold the merged weights ``W + (alpha / r) * (A @ B)``
(:func:`jaxflow.models.lora.merge`, the forward's own merge) and ``adapter/`` is a PEFT adapter
of the same adapters; without a LoRA config to merge with (the model's, or ``lora=``) the save
is refused with one line before anything is written.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxflow.models import lora as lora_lib
from jaxflow.models.architectures import hf_config_from, hf_shape, tensor_map
from jaxflow.models.tokenizer_hf import check_tokenizer_fits
from jaxflow.models.transformer import Transformer, TransformerConfig

INDEX_FILE = "model.safetensors.index.json"


def abstract_model(config: TransformerConfig):
    """(abstract Transformer, its graphdef, its abstract state): ``nnx.eval_shape``, nothing
    allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return abstract, graphdef, state


def flat_params(tree: dict, prefix=()) -> dict[tuple[str, ...], Any]:
    """{path of str keys -> leaf} of a nested-dict params tree (int layer keys as str)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_params(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out


def host_array(x: jax.Array) -> np.ndarray:
    """``x`` as one host numpy array (gathered over processes when not fully addressable;
    every process must call it then)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def hf_tensors(model_or_params: Any, config: TransformerConfig | None = None):
    """Yields (checkpoint tensor name, host numpy array) for a model or a base-shaped params
    pure dict. Adapters are refused (:class:`~jaxflow.models.lora.AdapterError`), never skipped:
    merge them first (:func:`jaxflow.models.lora.merge`; :func:`write_checkpoint` does)."""
    if isinstance(model_or_params, nnx.Module):
        config = model_or_params.config
        params = nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
    else:
        params = model_or_params
    if config is None:
        raise ValueError("hf_tensors(params) needs config= when given a pure dict")
    if lora_lib.has_adapters(params):
        raise lora_lib.AdapterError("hf_tensors got params with LoRA adapters (*_lora_a / *_lora_b); "
                                    "valid: base-shaped params (lora.merge(params, lora_config) first, "
                                    "or write_checkpoint / save_pretrained, which merge)")
    flat = flat_params(params)
    for p, src in tensor_map(config).items():
        value = host_array(flat[p])
        blocks = list(value) if src.stacked else [value]
        for name, block in zip(src.hf_names, blocks):
            if src.transpose:
                inner = math.prod(block.shape[:src.split])
                block = block.reshape(inner, -1).T
            yield name, np.ascontiguousarray(block)


def write_checkpoint(params: Any, config: TransformerConfig, path: str, *,
                     max_shard_bytes: int = 5 * 2**30, tokenizer: Any = None,
                     lora: lora_lib.LoraConfig | None = None) -> bool:
    """Writes params pure dict ``params`` of a model of ``config`` as a Hugging Face checkpoint
    directory (config.json + safetensors, an index when several files).

    Args:
      params: ``nnx.to_pure_dict`` layout (int or str layer keys), on any mesh; with adapter
        leaves the merged weights are written and ``path/adapter`` is a PEFT adapter.
      config: the model's config; ``config.lora`` is the adapters' LoRA config unless ``lora``.
      path: output directory (created; files in it are overwritten).
      max_shard_bytes: the largest safetensors file.
      tokenizer: None, an :class:`~jaxflow.models.tokenizer_hf.HFTokenizer` or a
        :class:`~jaxflow.models.tokenizer_hf.TransformersTokenizer`: its files go in ``path``.
      lora: the adapters' LoraConfig when ``config.lora`` is off (e.g. a base model's config).

    Returns:
      Whether a PEFT adapter was written.

    Raises:
      AdapterError: adapters without a LoRA config that gives their scale, or adapters that do not
        match it (rank, targets); nothing is written then.
    """
    from safetensors.numpy import save_file

    base_cfg = dataclasses.replace(config, lora=lora_lib.LoraConfig())
    hf_config = hf_config_from(base_cfg)
    check_tokenizer_fits(tokenizer, config.vocab_size)
    adapter_lora = lora_lib.adapters_config(params, lora if lora is not None else config.lora)
    if adapter_lora is not None:  # the merged weights here, a PEFT adapter in path/adapter
        params = lora_lib.save_adapter(params, dataclasses.replace(config, lora=adapter_lora),
                                       os.path.join(path, "adapter"), host_array)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in hf_tensors(params, base_cfg):
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if jax.process_index() != 0:
        return adapter_lora is not None
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return adapter_lora is not None
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        for name, arr in shard.items():
            weight_map[name] = file
            total += arr.nbytes
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return adapter_lora is not None


def save_pretrained(model: Transformer, path: str, *, max_shard_bytes: int = 5 * 2**30,
                    params: Any = None, tokenizer: Any = None,
                    lora: lora_lib.LoraConfig | None = None) -> None:
    """Writes ``model`` as a Hugging Face checkpoint directory (config.json + safetensors).

    Tensors are written in the parameter dtype, in files of at most ``max_shard_bytes`` (several
    files get a ``model.safetensors.index.json``). ``params`` (a pure dict) replaces the model's
    own parameters, e.g. a trainer's. Adapters (the model's, or ``*_lora_a/_b`` leaves of
    ``params``) are merged into the weights written and ``path/adapter`` is a PEFT adapter
    (:func:`jaxflow.models.lora.save_adapter`); their LoRA config is ``model.config.lora``, or
    ``lora`` when the model has none (``save_pretrained(from_pretrained(P), out,
    params=trained, lora=LoraConfig(rank=8))``); adapters without either are refused
    (:class:`~jaxflow.models.lora.AdapterError`), never dropped. ``tokenizer`` (an
    :class:`HFTokenizer`, e.g. the checkpoint's own, or a :class:`TransformersTokenizer`) adds
    its files (``tokenizer.json``, ``tokenizer_config.json``, ...); without one no tokenizer
    file is written. On several processes every process must call it (sharded parameters are
    gathered); process 0 writes."""
    if params is None:
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    write_checkpoint(params, model.config, path, max_shard_bytes=max_shard_bytes,
                     tokenizer=tokenizer, lora=lora)


def write_random_checkpoint(config: TransformerConfig, path: str, *, seed: int = 0,
                            std: float = 0.02, max_shard_bytes: int = 2**30) -> int:
    """Writes a random checkpoint of ``config`` (host numpy, one file's tensors in memory at a
    time): N(0, std^2) weights, norm scales 1 + N(0, std^2). For tests and benchmarks.

    Returns the total tensor bytes written.
    """
    from safetensors.numpy import save_file

    hf_config = hf_config_from(config)
    abstract = flat_params(nnx.to_pure_dict(abstract_model(config)[2]))
    dtype = np.dtype(config.params_dtype)
    rng = np.random.default_rng(seed)
    plan: list[list[tuple[str, tuple[int, ...], bool]]] = [[]]
    size = 0
    for p, src in tensor_map(config).items():
        shape = tuple(abstract[p].shape)
        block = shape[1:] if src.stacked else shape
        for name in src.hf_names:
            t_shape = hf_shape(src, block)
            nbytes = math.prod(t_shape) * dtype.itemsize
            if plan[-1] and size + nbytes > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append((name, t_shape, p[-1] == "scale"))
            size += nbytes
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    weight_map, total = {}, 0
    for i, entries in enumerate(plan):
        file = ("model.safetensors" if len(plan) == 1
                else f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors")
        tensors = {}
        for name, shape, is_scale in entries:
            x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            tensors[name] = (x + 1 if is_scale else x).astype(dtype)
            weight_map[name] = file
            total += tensors[name].nbytes
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        del tensors
    if len(plan) > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total
