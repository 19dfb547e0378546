"""LoRA (Hu et al., 2021): low-rank adapters on the decoder's projections, base weights frozen.

``TransformerConfig.lora`` (a :class:`LoraConfig`; ``--set model.lora.rank=8``, rank 0 = off,
the default: the model, its params and every run are then exactly those without this module)
adds two parameters beside each targeted projection ``w`` of a decoder block:
``<w>_lora_a`` [*in, r] and ``<w>_lora_b`` [r, *out] (``in`` / ``out`` the projection's input
and output dims, e.g. wq [d, h, hd]: A [d, r], B [r, h, hd]; wo [h, hd, d]: A [h, hd, r],
B [r, d]). Initialised as PEFT does: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming-uniform
with a = sqrt(5)), B = 0, so step 0 computes exactly the base model.

The forward uses the merged weight ``W' = W + (alpha / r) * (A @ B)`` (:func:`merged_weight`,
f32 delta at HIGHEST precision, cast to the param dtype), then the layer's usual matmul. The
same function builds the base-shaped params of :func:`merge` (what the sampler and
``save_pretrained`` get), so a forward on merged params is the adapter forward bit for bit on
one device. Cost: the backward forms the [in, out] gradient of W' (as full fine-tuning does for
W) and projects it onto A and B; what LoRA saves here is the optimizer state (moments for the
adapters only) and the gradient of the frozen base (never formed: :func:`freeze_base`).

Training (:func:`trainable_only`): an ``optax.multi_transform`` runs the given optimizer on the
adapter leaves and ``set_to_zero`` on the rest (no moments: the optimizer state holds adapter-
sized moments only); :meth:`jaxflow.train.lm_state.LMFunctions.model` stops the base's gradient.
Inside a jitted step the frozen base's bits are unchanged (XLA folds ``p + 0``).

Parameter names: the pure dict keeps the base's keys and adds ``<name>_lora_a`` /
``<name>_lora_b`` beside each target (:data:`TARGETS` names the targets by their Hugging Face
projection: q, k, v, o, gate, up, down). An MoE model takes attention targets only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.config_domains import COUNT0, POSITIVE, SEED, domains
from jaxflow.errors import UserError

#: target -> (block submodule, jaxflow weight, PEFT module path, input dims of the weight)
TARGETS: dict[str, tuple[str, str, str, int]] = {
    "q": ("attn", "wq", "self_attn.q_proj", 1),
    "k": ("attn", "wk", "self_attn.k_proj", 1),
    "v": ("attn", "wv", "self_attn.v_proj", 1),
    "o": ("attn", "wo", "self_attn.o_proj", 2),
    "gate": ("mlp", "w_gate", "mlp.gate_proj", 1),
    "up": ("mlp", "w_up", "mlp.up_proj", 1),
    "down": ("mlp", "w_down", "mlp.down_proj", 1),
}
PUBLISH_MODES = ("adapters", "merged")
_A, _B = "_lora_a", "_lora_b"


@domains(rank=COUNT0, alpha=POSITIVE, seed=SEED)
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the decoder's projections (module doc).

    Attributes:
      rank: r; 0 turns LoRA off (the default).
      alpha: the adapters' product is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
      targets: which projections of each block get adapters (names of :data:`TARGETS`).
      seed: seeds the A matrices (layer and target folded in); the base's init is untouched.
      publish: how an RL trainer hands LoRA weights to its sampler: ``"adapters"`` publishes
        base + adapters (through SparseRL-Sync only the adapters change) and merges on the
        rollout side; ``"merged"`` merges on the trainer and publishes base-shaped weights.
        A sync of adapters is bounded by the adapters' size; a merged delta changes the bf16
        bits of a share of every adapted matrix that grows with the learning rate and with
        training. Measured on the flagship quick model (85k params, rank 8 = 17k adapter
        params, 4 RL steps): 23.5 KB (adapters) vs 15.2 KB (merged) per publish at lr 1e-4,
        28.0 KB vs 44.4 KB at lr 1e-3 (a dense bf16 copy: 170 KB). At real sizes the adapters
        are well under 1% of the weights, so "adapters" is the default.
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    seed: int = 0
    publish: str = "adapters"

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank={self.rank!r}: need an int >= 0 (0 = off)")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha={self.alpha!r}: need a finite number > 0")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"lora.targets={self.targets!r}: need distinct names from "
                             f"{', '.join(TARGETS)}")
        if self.publish not in PUBLISH_MODES:
            raise ValueError(f"lora.publish={self.publish!r}; valid: {', '.join(PUBLISH_MODES)}")

    @property
    def enabled(self) -> bool:
        """Whether adapters exist (rank > 0)."""
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``A @ B``."""
        return self.alpha / self.rank


# ----------------------------------------------------------------------------- the model side


def init_a(lora: LoraConfig, layer: int, target: str, shape: tuple[int, ...],
           dtype: Any) -> jax.Array:
    """A for ``target`` of decoder layer ``layer``: shape [*in, r], U(-1/sqrt(fan_in),
    1/sqrt(fan_in)) with fan_in = prod(in) (PEFT's kaiming-uniform, a = sqrt(5)); a pure
    function of (lora.seed, layer, target)."""
    key = jax.random.fold_in(jax.random.key(lora.seed), layer * len(TARGETS) + list(TARGETS).index(target))
    bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def adapter_shapes(w_shape: tuple[int, ...], split: int, rank: int) -> tuple[tuple, tuple]:
    """(A shape [*in, r], B shape [r, *out]) for a weight of ``w_shape`` whose first ``split``
    dims are its input."""
    return tuple(w_shape[:split]) + (rank,), (rank,) + tuple(w_shape[split:])


def attach(module: nnx.Module, lora: LoraConfig, layer: int, submodule: str) -> None:
    """Adds the adapters of ``lora.targets`` living in ``module`` (a block's ``submodule``,
    "attn" or "mlp") as nnx Params beside their weights; no-op when LoRA is off."""
    if not lora.enabled:
        return
    module.lora_scale = lora.scale
    for target in lora.targets:
        sub, name, _, split = TARGETS[target]
        if sub != submodule:
            continue
        w = getattr(module, name)
        axes = tuple(w.get_metadata()["out_sharding"])
        a_shape, b_shape = adapter_shapes(w.shape, split, lora.rank)
        setattr(module, name + _A, nnx.Param(init_a(lora, layer, target, a_shape, w.dtype),
                                             out_sharding=axes[:split] + (None,), eager_sharding=False))
        setattr(module, name + _B, nnx.Param(jnp.zeros(b_shape, w.dtype),
                                             out_sharding=(None,) + axes[split:], eager_sharding=False))


def merged_weight(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``w + scale * (a @ b)`` in ``w``'s dtype: w [*in, *out], a [*in, r], b [r, *out]; the
    product in f32 at HIGHEST precision."""
    r = a.shape[-1]
    delta = jnp.matmul(a.reshape(-1, r).astype(jnp.float32), b.reshape(r, -1).astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def weight(module: nnx.Module, name: str) -> jax.Array:
    """The value of ``module.<name>`` the forward uses: the weight itself, or with adapters
    :func:`merged_weight` (param dtype)."""
    w = getattr(module, name)[...]
    a = getattr(module, name + _A, None)
    if a is None:
        return w
    return merged_weight(w, a[...], getattr(module, name + _B)[...], module.lora_scale)


# ----------------------------------------------------------------------------- pure dicts


def is_adapter_key(key: Any) -> bool:
    """Whether a pure-dict key names an adapter leaf."""
    return isinstance(key, str) and (key.endswith(_A) or key.endswith(_B))


def _path_is_adapter(path) -> bool:
    if not path:
        return False
    last = path[-1]
    return is_adapter_key(getattr(last, "key", getattr(last, "name", None)))


def has_adapters(params: Any) -> bool:
    """Whether a params pytree (pure dict) holds any adapter leaf."""
    return any(_path_is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))


def labels(params: Any) -> Any:
    """``params`` with each leaf replaced by "adapter" or "base" (``optax.multi_transform``)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "adapter" if _path_is_adapter(p) else "base", params)


def freeze_base(params: Any) -> Any:
    """``params`` with ``stop_gradient`` on every non-adapter leaf (the same object when it
    holds no adapters, so LoRA-off programs are unchanged)."""
    if not has_adapters(params):
        return params
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if _path_is_adapter(p) else jax.lax.stop_gradient(x), params)


def trainable_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the adapter leaves, zero updates (and no state) for the rest."""
    return optax.multi_transform({"adapter": tx, "base": optax.set_to_zero()}, labels)


def _walk(tree: dict, fn) -> dict:
    """Rebuilds ``tree`` (nested dicts), calling ``fn(d) -> dict`` on every dict holding adapters."""
    out = {k: _walk(v, fn) if isinstance(v, dict) else v for k, v in tree.items()}
    return fn(out) if any(is_adapter_key(k) for k in out) else out


def merge(params: dict, lora: LoraConfig) -> dict:
    """Base-shaped params (the adapters folded in by :func:`merged_weight`, their keys dropped):
    what a model without LoRA computes exactly as the adapter model does. Jittable."""
    def fold(d):
        out = {k: v for k, v in d.items() if not is_adapter_key(k)}
        for k in d:
            if k.endswith(_A):
                name = k[:-len(_A)]
                out[name] = merged_weight(d[name], d[k], d[name + _B], lora.scale)
        return out

    return _walk(params, fold)


def adapters(params: dict) -> dict:
    """The adapter leaves only (same nesting, other keys and empty dicts dropped)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            sub = adapters(v)
            if sub:
                out[k] = sub
        elif is_adapter_key(k):
            out[k] = v
    return out


def strip(params: dict) -> dict:
    """The base leaves only (the adapter keys dropped; no merging)."""
    return {k: strip(v) if isinstance(v, dict) else v for k, v in params.items()
            if not is_adapter_key(k)}


def add_adapters(base: dict, model_cfg: Any) -> dict:
    """``base`` (base-shaped params, e.g. a full-weight warm start) with fresh adapters of
    ``model_cfg.lora`` added: A initialised as the module does (:func:`init_a`), B = 0, so the
    result computes exactly what ``base`` does. Adapters are created on the default device, in
    one jitted call (eager: a compile per op and shape)."""
    lora = model_cfg.lora
    out = jax.tree.map(lambda x: x, base)
    slots, specs = [], []
    for i, layer in out["layers"].items():
        for target in lora.targets:
            sub, name, _, split = TARGETS[target]
            w = layer[sub][name]
            slots.append((layer[sub], name))
            specs.append((int(i), target, w.shape, split, np.dtype(w.dtype)))
    for (block, name), (a, b) in zip(slots, _fresh_adapters(lora, tuple(specs))):
        block[name + _A], block[name + _B] = a, b
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fresh_adapters(lora: LoraConfig, specs: tuple) -> list[tuple[jax.Array, jax.Array]]:
    """[(A, B = 0)] for ``specs`` = ((layer, target, weight shape, split, dtype), ...)."""
    out = []
    for layer, target, w_shape, split, dtype in specs:
        a_shape, b_shape = adapter_shapes(w_shape, split, lora.rank)
        out.append((init_a(lora, layer, target, a_shape, dtype), jnp.zeros(b_shape, dtype)))
    return out


class AdapterError(UserError, ValueError):
    """A params tree's adapters cannot be merged as asked: no LoRA config gives their scale, or
    their rank / targets differ from the config's (the message names both)."""


def _adapter_leaves(params: Any) -> dict[str, list[tuple[int, ...]]]:
    """{target name -> shapes of its A leaves} of the adapters in ``params``."""
    by_weight = {w: t for t, (_, w, _, _) in TARGETS.items()}
    found: dict[str, list[tuple[int, ...]]] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        key = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
        if isinstance(key, str) and key.endswith(_A):
            target = by_weight.get(key[:-len(_A)], key[:-len(_A)])
            found.setdefault(target, []).append(tuple(x.shape))
    return found


def adapters_config(params: Any, lora: LoraConfig | None) -> LoraConfig | None:
    """The LoRA config to merge ``params``' adapters with: None when ``params`` holds none,
    else ``lora`` once checked against them (same targets, every A of rank ``lora.rank``).

    Raises:
      AdapterError: adapters but ``lora`` is None or off (their scale ``alpha / rank`` is
        unknown), or adapters whose rank or targets differ from ``lora``'s.
    """
    found = _adapter_leaves(params)
    if not found:
        return None
    ranks = sorted({shape[-1] for shapes in found.values() for shape in shapes})
    seen = ", ".join(sorted(found))
    leaves = 2 * sum(len(s) for s in found.values())
    if lora is None or not lora.enabled:
        raise AdapterError(
            f"the params hold {leaves} LoRA adapter leaves (*_lora_a / *_lora_b; rank "
            f"{'/'.join(map(str, ranks))}, targets {seen}) but no LoRA config gives their scale "
            f"alpha / rank; valid: the model's config.lora or lora=LoraConfig(rank={ranks[0]}, "
            "alpha=..., targets=...) as trained, to merge them (adapters are never dropped)")
    if ranks != [lora.rank] or set(found) != set(lora.targets):
        raise AdapterError(
            f"the params' adapters (rank {'/'.join(map(str, ranks))}, targets {seen}) do not "
            f"match LoraConfig(rank={lora.rank}, targets={','.join(lora.targets)}); valid: the "
            "LoraConfig the adapters were trained with")
    return lora


def trainable_summary(params: Any) -> tuple[int, int]:
    """(trainable parameter count, total parameter count) of a params pytree: with adapters
    only they train (:func:`trainable_only`), else every parameter does; the total counts the
    base and the adapters."""
    total = trainable = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        n = int(math.prod(x.shape))
        total += n
        trainable += n if _path_is_adapter(path) else 0
    return (trainable if has_adapters(params) else total), total


def describe_trainable(params: Any) -> str:
    """One run-log line saying which parameters train, e.g. ``"LoRA rank 8: 12,288 of
    1,234,567 parameters train (1.0%)"`` or ``"full fine-tuning: 85,184 of 85,184 parameters
    train (100%)"``."""
    trainable, total = trainable_summary(params)
    share = 100.0 * trainable / max(total, 1)
    pct = "100%" if trainable == total else (f"{share:.1f}%" if share >= 0.1 else f"{share:.2g}%")
    ranks = sorted({s[-1] for shapes in _adapter_leaves(params).values() for s in shapes})
    what = f"LoRA rank {'/'.join(map(str, ranks))}" if ranks else "full fine-tuning"
    return f"{what}: {trainable:,} of {total:,} parameters train ({pct})"


def param_bytes(params: Any) -> int:
    """Bytes of the leaves of ``params``."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------- PEFT format


def peft_config(model_cfg: Any) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter for ``model_cfg.lora`` (CAUSAL_LM)."""
    lora = model_cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(TARGETS[t][2].split(".")[-1] for t in lora.targets),
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": None, "revision": None}


def peft_tensors(params: dict, model_cfg: Any, host=jax.device_get) -> dict:
    """{PEFT key -> host array}: ``base_model.model.model.layers.<i>.<module>.lora_A.weight``
    [r, in] = A.reshape(in, r).T and ``lora_B.weight`` [out, r] = B.reshape(r, out).T (the
    torch Linear layout of the Hugging Face checkpoint, whose weight is [out, in])."""
    out = {}
    for i in range(model_cfg.n_layers):
        layer = params["layers"][i] if i in params["layers"] else params["layers"][str(i)]
        for target in model_cfg.lora.targets:
            sub, name, module, _ = TARGETS[target]
            a, b = host(layer[sub][name + _A]), host(layer[sub][name + _B])
            r = a.shape[-1]
            key = f"base_model.model.model.layers.{i}.{module}"
            out[key + ".lora_A.weight"] = np.ascontiguousarray(np.asarray(a).reshape(-1, r).T)
            out[key + ".lora_B.weight"] = np.ascontiguousarray(np.asarray(b).reshape(r, -1).T)
    return out


def save_adapter(model_or_params: Any, model_cfg: Any, path: str, host=jax.device_get) -> dict:
    """Writes ``path/adapter_config.json`` + ``path/adapter_model.safetensors`` (PEFT's LoRA
    format: ``peft.PeftModel.from_pretrained(hf_base_model, path)`` loads it) and returns the
    merged base-shaped params (:func:`merge`) for the full checkpoint. ``host`` gathers an
    array to the host (every process calls this; process 0 writes)."""
    import json
    import os

    from safetensors.numpy import save_file

    params = model_or_params
    if isinstance(params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    tensors = peft_tensors(params, model_cfg, host)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(peft_config(model_cfg), f, indent=2, sort_keys=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    return jax.jit(functools.partial(merge, lora=model_cfg.lora))(params)
