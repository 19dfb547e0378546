"""Hugging Face checkpoints in and out: ``from_pretrained(dir)`` / ``save_pretrained(model, dir)``.

A checkpoint directory holds ``config.json`` and one or more ``*.safetensors`` files (with a
``model.safetensors.index.json`` weight map when there are several). Loading never builds a
randomly initialised model: the parameter tree comes from ``nnx.eval_shape``, each parameter's
NamedSharding from its logical axes and the sharding rules, and each device's shard is read
straight from the file with safetensors' ``get_slice`` inside
``jax.make_array_from_callback`` - so on a multi-process mesh every process reads only the
slices its own devices hold, and no host ever holds a whole sharded tensor. Each file is
opened (memory-mapped) for one parameter at a time and closed after it, so resident memory
grows by the loaded parameters plus one tensor's pages.

Everything is validated before any tensor data is read: config.json (architecture, sizes),
the index, every safetensors header, every expected tensor present, no unexpected one, every
dtype floating point, every shape as config.json implies. Paths only, no network.

The save side (``save_pretrained``, ``write_random_checkpoint``) lives in
:mod:`jaxflow.models.hf_save` and stays importable from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxflow.errors import one_line
from jaxflow.mesh import LogicalRules, shardings_from_logical
from jaxflow.models import lora
from jaxflow.models.architectures import (
    IGNORED_SUFFIXES,
    CheckpointError,
    TensorSource,
    dtype_name,
    hf_shape,
    read_config,  # noqa: F401 (kept importable from here)
    read_json_object,
    read_transformer_config,
    tensor_map,
)
from jaxflow.models.hf_save import (  # noqa: F401 (the save side, kept importable from here)
    INDEX_FILE,
    hf_tensors,
    save_pretrained,
    write_checkpoint,
    write_random_checkpoint,
)
from jaxflow.models.hf_save import abstract_model as _abstract_model
from jaxflow.models.hf_save import flat_params as _flat
from jaxflow.models.sharding import FSDP_TP_RULES
from jaxflow.models.transformer import Transformer, TransformerConfig, logical_axes

#: safetensors dtype codes a weight may be stored in (converted to the load dtype on reading).
WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclasses.dataclass
class LoadStats:
    """What a load read: bytes of tensor data taken from the files (stored dtype), number of
    ``get_slice`` reads, and wall seconds."""

    bytes_read: int = 0
    reads: int = 0
    seconds: float = 0.0


def _open(file: str):
    """``safe_open(file)``; CheckpointError naming the file when it is not a safetensors file
    (truncated, garbage header, unreadable)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="np")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"safetensors file {file!r} cannot be read ({one_line(e)}); "
                              "valid: a complete safetensors file (8-byte header size, JSON "
                              "header, tensor data)") from None


def _weight_map(path: str) -> dict[str, str]:
    """{tensor name -> safetensors file path} from the index, or by listing every file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        mapping = read_json_object(index, what="safetensors index").get("weight_map")
        if not isinstance(mapping, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object; valid: "
                                  '{"weight_map": {tensor name: safetensors file name}}')
        out = {}
        for name, file in mapping.items():
            if (not isinstance(file, str) or not file or os.path.isabs(file)
                    or os.path.normpath(file).split(os.sep)[0] == os.pardir):
                raise CheckpointError(f"{index} weight_map maps tensor {name!r} to {file!r}; "
                                      "valid: a safetensors file name inside the checkpoint "
                                      "directory")
            full = os.path.join(path, file)
            if not os.path.isfile(full):
                raise CheckpointError(f"{index} maps tensor {name!r} to {file!r}, which does "
                                      "not exist")
            out[name] = full
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors file")
    out = {}
    for file in files:
        full = os.path.join(path, file)
        with _open(full) as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} is in both {out[name]} and {full}")
                out[name] = full
    return out


def _searched(path: str, weight_map: dict[str, str]) -> str:
    """The file(s) a tensor was looked for in: the index, else the safetensors files."""
    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        return os.path.join(path, INDEX_FILE)
    names = sorted({os.path.basename(f) for f in weight_map.values()})
    return f"{', '.join(names) or '*.safetensors'} in {path}"


def _checkpoint_tensors(weight_map: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype code)} from the files' headers (no data read)."""
    tensors = {}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"the index maps tensor {name!r} to {file}, which "
                                          "does not contain it")
                sl = f.get_slice(name)
                tensors[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return tensors


def _validate(config: TransformerConfig, sources: dict, abstract: dict,
              tensors: dict[str, tuple[tuple[int, ...], str]], weight_map: dict[str, str],
              searched: str) -> None:
    """Missing / extra tensors, dtypes that are not floating point, shape mismatches -> one
    CheckpointError naming the tensor and the file."""
    expected: dict[str, tuple[int, ...]] = {}
    for path, src in sources.items():
        block = tuple(abstract[path].shape[1:] if src.stacked else abstract[path].shape)
        for name in src.hf_names:
            expected[name] = hf_shape(src, block)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint lacks tensor {missing[0]!r}{more}, which the "
                              f"{config.architecture} architecture in config.json needs; "
                              f"searched: {searched}")
    allowed_extra = {"lm_head.weight"} if config.tie_embeddings else set()
    extra = [n for n in tensors if n not in expected and n not in allowed_extra
             and not n.endswith(IGNORED_SUFFIXES)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {extra[0]!r}{more} (in "
                              f"{weight_map[extra[0]]}), not used by the {config.architecture} "
                              "architecture in config.json")
    if "lm_head.weight" in tensors and config.tie_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.d_model)
    for name, want in expected.items():
        shape, dtype = tensors[name]
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {weight_map[name]} has dtype {dtype}; "
                                  "valid weight dtypes: "
                                  f"{', '.join(f'{k} ({v})' for k, v in WEIGHT_DTYPES.items())}")
        if shape != want:
            raise CheckpointError(f"tensor {name!r} has shape {shape} in {weight_map[name]}; "
                                  f"config.json implies {want}")


def _group_range(slices: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Flat [start, stop) covering a block sliced on its first dim (the rest are re-sliced
    after reading), and the first dim's slice length."""
    inner = math.prod(shape[1:])
    start, stop, _ = slices[0].indices(shape[0])
    return start * inner, stop * inner, stop - start


class _Reader:
    """Reads blocks of checkpoint tensors, counting the bytes read.

    Small reads share one memory-mapped handle per file (closed after each parameter).
    Reads over ``chunk_bytes`` go in row chunks, each through its own short-lived handle, and
    are written (converted, transposed) straight into the output, so a big tensor costs its
    output plus one chunk of resident memory, not its mapped pages plus copies."""

    chunk_bytes = 32 * 2**20

    def __init__(self, weight_map: dict[str, str], stats: LoadStats, dtype: np.dtype):
        self.weight_map, self.stats, self.dtype = weight_map, stats, dtype
        self._files: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def close(self):
        self._stack.close()
        self._files.clear()

    def _slice(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._stack.enter_context(_open(file))
        return self._files[file].get_slice(name)

    def _count(self, arr: np.ndarray) -> np.ndarray:
        self.stats.bytes_read += arr.nbytes
        self.stats.reads += 1
        return arr

    def _read(self, name: str, index: tuple[slice, ...], transpose: bool = False) -> np.ndarray:
        """tensor[index] in the load dtype, transposed (2-D only) when asked."""
        sl = self._slice(name)
        shape = [s.indices(d) for s, d in zip(index, sl.get_shape())]
        lengths = [stop - start for start, stop, _ in shape]
        itemsize = np.dtype(self.dtype).itemsize
        if len(index) != 2 or math.prod(lengths) * itemsize <= self.chunk_bytes:
            arr = self._count(sl[index]).astype(self.dtype, copy=False)
            return np.ascontiguousarray(arr.T) if transpose else arr
        (r0, r1, _), (c0, c1, _) = shape
        rows_per_chunk = max(1, self.chunk_bytes // max(1, lengths[1] * itemsize))
        out = np.empty(lengths[::-1] if transpose else lengths, self.dtype)
        for a in range(r0, r1, rows_per_chunk):
            b = min(a + rows_per_chunk, r1)
            with _open(self.weight_map[name]) as f:
                chunk = self._count(f.get_slice(name)[a:b, c0:c1]).astype(self.dtype,
                                                                          copy=False)
            if transpose:
                out[:, a - r0:b - r0] = chunk.T
            else:
                out[a - r0:b - r0] = chunk
            del chunk
        return out

    def block(self, name: str, src: TensorSource, shape: tuple[int, ...],
              index: tuple[slice, ...]) -> np.ndarray:
        """jaxflow block ``[index]`` (block shape ``shape``) from checkpoint tensor ``name``."""
        if not src.transpose:
            return self._read(name, index)
        inner, outer = shape[:src.split], shape[src.split:]
        i_idx, o_idx = index[:src.split], index[src.split:]
        r0, r1, n_out = _group_range(o_idx, outer)
        c0, c1, n_in = _group_range(i_idx, inner)
        arr = self._read(name, (slice(r0, r1), slice(c0, c1)), transpose=True)
        arr = arr.reshape((n_in,) + inner[1:] + (n_out,) + outer[1:])  # splits: a view
        arr = arr[(slice(None),) + tuple(i_idx[1:]) + (slice(None),) + tuple(o_idx[1:])]
        return np.ascontiguousarray(arr)  # no copy unless head_dim itself is sliced

    def param(self, src: TensorSource, shape: tuple[int, ...], index: tuple) -> np.ndarray:
        index = tuple(slice(*s.indices(d)) for s, d in zip(index, shape))
        if not src.stacked:
            return self.block(src.hf_names[0], src, shape, index)
        experts = range(*index[0].indices(shape[0]))
        return np.stack([self.block(src.hf_names[e], src, shape[1:], index[1:])
                         for e in experts])


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        tree = tree[int(k) if int(k) in tree else k] if k.isdigit() else tree[k]
    last = path[-1]
    tree[int(last) if last.isdigit() and int(last) in tree else last] = value


def load_hf_params(path: str, config: TransformerConfig, *, mesh: Mesh | None = None,
                   rules: LogicalRules = FSDP_TP_RULES) -> tuple[dict, LoadStats]:
    """The checkpoint's parameters as jaxflow's pure dict, placed in their shardings.

    Args:
      path: checkpoint directory.
      config: its TransformerConfig (``config_from_hf(read_config(path))``, possibly with
        runtime fields such as ``moe_impl`` or ``remat`` replaced).
      mesh: place each parameter by its logical axes and ``rules`` on this mesh (each
        process reads only its addressable shards); None: uncommitted arrays on the default
        device.

    With ``config.lora`` on, the checkpoint is the base and fresh adapters are added
    (:func:`jaxflow.models.lora.add_adapters`: B = 0, so the params compute the checkpoint's
    logits exactly).

    Returns:
      (params pure dict as ``nnx.to_pure_dict(nnx.state(model))``, LoadStats).
    """
    t0 = time.perf_counter()
    lora_cfg = config.lora
    if lora_cfg.enabled:  # the checkpoint holds the base weights only
        config = dataclasses.replace(config, lora=lora.LoraConfig())
    abstract, _, state = _abstract_model(config)
    pure = nnx.to_pure_dict(state)
    flat_abstract = _flat(pure)
    sources = tensor_map(config)
    if set(sources) != set(flat_abstract):
        raise AssertionError(f"tensor_map and the model disagree: "
                             f"{sorted(set(sources) ^ set(flat_abstract))}")
    weight_map = _weight_map(path)
    _validate(config, sources, flat_abstract, _checkpoint_tensors(weight_map), weight_map,
              _searched(path, weight_map))
    shardings = {}
    if mesh is not None:
        axes = nnx.to_pure_dict(logical_axes(nnx.state(abstract, nnx.Param)))
        shardings = _flat(shardings_from_logical(pure, axes, mesh, rules))
    stats = LoadStats()
    dtype = np.dtype(config.params_dtype)
    for p, aval in flat_abstract.items():
        reader = _Reader(weight_map, stats, dtype)
        memo: dict[tuple, np.ndarray] = {}
        src, shape = sources[p], tuple(aval.shape)

        def callback(index, src=src, shape=shape, reader=reader, memo=memo):
            key = tuple((s.start, s.stop) for s in index)
            if key not in memo:  # replicated shards on several local devices: read once
                memo[key] = reader.param(src, shape, index)
            return memo[key]

        try:
            if mesh is None:  # uncommitted on the default device, free to move later
                value = jax.device_put(callback(tuple(slice(None) for _ in shape)))
            else:
                value = jax.make_array_from_callback(shape, shardings[p], callback)
            _set(pure, p, value)
        finally:
            reader.close()
            memo.clear()
    if lora_cfg.enabled:
        pure = _with_adapters(pure, dataclasses.replace(config, lora=lora_cfg), mesh, rules)
    stats.seconds = time.perf_counter() - t0
    return pure, stats


def _with_adapters(base: dict, config: TransformerConfig, mesh: Mesh | None,
                   rules: LogicalRules) -> dict:
    """``base`` with fresh adapters of ``config.lora`` (B = 0), placed by their logical axes on
    ``mesh`` (every process builds the same values from the LoRA seed)."""
    params = lora.add_adapters(base, config)
    if mesh is None:
        return params
    abstract, _, state = _abstract_model(config)
    axes = nnx.to_pure_dict(logical_axes(nnx.state(abstract, nnx.Param)))
    shardings = _flat(shardings_from_logical(nnx.to_pure_dict(state), axes, mesh, rules))
    for p, value in _flat(params).items():
        if lora.is_adapter_key(p[-1]):
            host = np.asarray(value)
            _set(params, p, jax.make_array_from_callback(host.shape, shardings[p],
                                                         lambda index, host=host: host[index]))
    return params


def from_pretrained(path: str, *, mesh: Mesh | None = None, dtype: Any = None,
                    rules: LogicalRules = FSDP_TP_RULES, **overrides) -> Transformer:
    """A Transformer holding a local Hugging Face checkpoint (Llama, Qwen3, Qwen3-MoE).

    Args:
      path: directory with config.json and *.safetensors (an index when sharded).
      mesh: shard parameters over this mesh by the logical-axis ``rules`` (FSDP over "fsdp",
        tensor parallel over "model", experts over "expert"; axes the mesh lacks are
        replicated). None: one device.
      dtype: "float32" | "bfloat16" (or ``jnp.float32``, ``np.float32``, ``jnp.bfloat16``, a
        ``np.dtype``) for parameters and compute; None: the checkpoint's dtype when it is one
        of those, else float32.
      overrides: TransformerConfig fields to replace (``remat=True``, ``moe_impl="dispatch"``,
        ``max_seq_len=...``; ``lora=LoraConfig(rank=8)`` adds fresh adapters, B = 0, to the
        checkpoint's weights: the same logits until they are trained).

    Returns:
      The model; ``model(tokens [B, T] int32) -> logits [B, T, vocab_size] float32`` with
      positions 0..T-1.

    Raises:
      CheckpointError: a config.json, index or safetensors file that is not valid (names the
        file and the field or tensor): unknown architecture, bad sizes, missing / unexpected
        tensors, non-floating dtypes, shape mismatch; all before any tensor data is read.
      ConfigError: ``dtype`` (or a dtype override) that is not float32 / bfloat16.
    """
    for key in ("dtype", "param_dtype"):
        if key in overrides:
            overrides[key] = dtype_name(overrides[key], what=key)
    config = read_transformer_config(path, dtype=dtype)
    if overrides:
        config = dataclasses.replace(config, **overrides)
    params, _ = load_hf_params(path, config, mesh=mesh, rules=rules)
    _, graphdef, state = _abstract_model(config)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
