"""Sharded LM train state and a pure train step.

The train state is a :class:`jaxflow.train.state.TrainState` (params a pure dict, optax
state, int32 step): easy to checkpoint, to donate and to publish to another sub-mesh. Parameters
are placed by logical-axis rules (``jaxflow.mesh``): shardings come from ``jax.eval_shape``, and
the init is jitted with those ``out_shardings`` so no device ever holds an unsharded copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxflow.config import require_finite, require_positive, require_range
from jaxflow.config_domains import COUNT0, NON_NEGATIVE, POSITIVE, UNIT, Real, domains
from jaxflow.mesh import DEFAULT_RULES, LogicalRules, jit_on, shardings_from_logical
from jaxflow.models import lora
from jaxflow.models.fused_logprobs import fused_logprobs
from jaxflow.models.transformer import Transformer, TransformerConfig, logical_axes
from jaxflow.train.state import TrainState


@domains(lr=POSITIVE, warmup_steps=COUNT0, final_lr_fraction=UNIT, weight_decay=NON_NEGATIVE,
         b1=Real(0.0, 1.0, high_open=True), b2=Real(0.0, 1.0, high_open=True), grad_clip=POSITIVE)
@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``lr * final_lr_fraction``."""

    lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float = 1.0

    def __post_init__(self):
        require_finite(self, "lr", "grad_clip", positive=True)
        require_positive(self, "warmup_steps", allow_zero=True)
        require_range(self, "final_lr_fraction", 0.0, 1.0)
        require_finite(self, "weight_decay")
        require_range(self, "weight_decay", 0.0, float("inf"))
        require_range(self, "b1", 0.0, 1.0, high_open=True)
        require_range(self, "b2", 0.0, 1.0, high_open=True)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """optax chain: global-norm clipping + AdamW on a warm-up/cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup_steps, 1), max(total_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.final_lr_fraction,
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def model_optimizer(tx: optax.GradientTransformation,
                    model_cfg: TransformerConfig) -> optax.GradientTransformation:
    """``tx`` as it trains ``model_cfg``'s params: itself, or with LoRA on the adapters only
    (:func:`jaxflow.models.lora.trainable_only`: no moments and zero updates for the base)."""
    return lora.trainable_only(tx) if model_cfg.lora.enabled else tx


@dataclasses.dataclass(frozen=True)
class LMFunctions:
    """The model's static half: ``graphdef`` + abstract params, and how to rebuild the model."""

    graphdef: Any
    abstract_state: Any  # nnx.State with ShapeDtypeStruct leaves (keeps Variable metadata)
    param_shardings: Any  # pure dict of NamedSharding, same structure as params

    def nnx_state(self, params: Any) -> nnx.State:
        """The nnx.State (e.g. for ``jaxflow.models.make_sampler``) holding pure-dict ``params``."""
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return state

    def model(self, params: Any) -> Transformer:
        """The nnx model for a pure-dict ``params`` (inside or outside jit). With LoRA adapters
        in ``params`` the base leaves are behind ``stop_gradient`` (:func:`jaxflow.models.lora.freeze_base`)."""
        return nnx.merge(self.graphdef, self.nnx_state(lora.freeze_base(params)))

    def abstract_params(self) -> Any:
        """Pure-dict ``jax.ShapeDtypeStruct`` leaves with their trainer shardings (what
        ``Checkpointer.restore`` or ``jax.jit(..., out_shardings=)`` take); no allocation."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            nnx.to_pure_dict(self.abstract_state), self.param_shardings)


def lm_functions(model_cfg: TransformerConfig, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> LMFunctions:
    """Graph definition, abstract params and their NamedShardings on ``mesh``."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    axes = nnx.to_pure_dict(logical_axes(nnx.state(abstract, nnx.Param)))
    shardings = shardings_from_logical(nnx.to_pure_dict(state), axes, mesh, rules)
    return LMFunctions(graphdef, state, shardings)


def init_params(fns: LMFunctions, model_cfg: TransformerConfig, key: jax.Array) -> Any:
    """Freshly initialised params (pure dict), created directly in their shardings."""

    def init(key):
        model = Transformer(model_cfg, rngs=nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(model))

    return jax.jit(init, out_shardings=fns.param_shardings)(key)


def init_train_state(fns: LMFunctions, model_cfg: TransformerConfig, tx: optax.GradientTransformation,
                     key: jax.Array) -> tuple[TrainState, TrainState]:
    """(train state, its shardings as a ``TrainState`` of ``NamedSharding``); the optimizer
    state is sharded like the params it mirrors (:func:`jaxflow.train.state.opt_state_shardings`)."""
    params = init_params(fns, model_cfg, key)
    state = TrainState.create(tx, params, fns.param_shardings)
    return state, TrainState.shardings(tx, params, fns.param_shardings)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood: logits [B, T, V], targets [B, T] -> [B, T] f32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def make_train_step(fns: LMFunctions, tx: optax.GradientTransformation, shardings: TrainState,
                    batch_sharding: NamedSharding, *, microbatches: int = 1,
                    fused_loss: bool = False) -> Callable:
    """A jitted, donating ``(state, batch) -> (state, metrics)``.

    ``batch`` is a dict of [B, L] arrays: tokens, targets, loss_mask, segment_ids, positions.
    The loss is the mean NLL over tokens with ``loss_mask == 1``.

    ``microbatches`` k > 1: gradient accumulation. The rows are taken k at a time (row
    ``i * k + j`` goes to micro-batch j, so each device's rows feed every micro-batch), a
    ``lax.scan`` sums the micro-batches' masked NLL gradients and token counts, and one update
    applies their sum over the whole batch's token count: the same loss and gradient as k = 1
    up to float rounding, with a k times smaller activation footprint. B must divide by k.

    ``fused_loss``: the NLL and the accuracy's argmax come from
    :func:`jaxflow.models.fused_logprobs.fused_logprobs` on the final hidden states and the
    head (vocab tiles with an online logsumexp; the Pallas kernel on TPU / GPU), never holding
    the [B, L, V] f32 logits or their gradient: the same loss up to float rounding, for
    vocabularies whose logits dominate a step's memory (Llama-3's 128,256).
    """

    def nll_and_pred(params, batch):  # [B, L] f32 NLL, [B, L] int32 argmax
        model = fns.model(params)
        kw = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
        if not fused_loss:
            logits = model(batch["tokens"], **kw)
            return token_nll(logits, batch["targets"]), jnp.argmax(logits, axis=-1)
        hidden = model.hidden_states(batch["tokens"], **kw)
        head = model.head_weight().astype(hidden.dtype)
        out = fused_logprobs(hidden, head, batch["targets"], own_topk=1)
        return -out.target_logp, out.own_topk_indices[..., 0]

    def loss_fn(params, batch):
        nll, pred = nll_and_pred(params, batch)
        mask = batch["loss_mask"]
        n = jnp.maximum(mask.sum(), 1.0)
        loss = (nll * mask).sum() / n
        token_acc = ((pred == batch["targets"]) * mask).sum() / n
        return loss, {"loss": loss, "token_accuracy": token_acc, "tokens": mask.sum()}

    def sums_fn(params, batch):  # masked NLL and correct-token sums (one micro-batch)
        token_nll_, pred = nll_and_pred(params, batch)
        mask = batch["loss_mask"]
        nll = (token_nll_ * mask).sum()
        correct = ((pred == batch["targets"]) * mask).sum()
        return nll, (correct.astype(jnp.float32), mask.sum().astype(jnp.float32))

    def accumulated(params, batch):
        rows = batch["tokens"].shape[0]
        if rows % microbatches:
            raise ValueError(f"batch of {rows} rows in {microbatches} micro-batches; valid: a "
                             "row count divisible by the micro-batches")
        split = {k: jnp.swapaxes(v.reshape(rows // microbatches, microbatches, *v.shape[1:]), 0, 1)
                 for k, v in batch.items()}

        def body(carry, micro):
            (nll, (correct, count)), grads = jax.value_and_grad(sums_fn, has_aux=True)(params, micro)
            total = jax.tree.map(jnp.add, carry, (grads, nll, correct, count))
            return total, None

        zero = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0), jnp.float32(0), jnp.float32(0))
        (grads, nll, correct, count), _ = jax.lax.scan(body, zero, split)
        n = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / n).astype(g.dtype), grads)
        loss = nll / n
        return grads, {"loss": loss, "token_accuracy": correct / n, "tokens": count}

    def step(state: TrainState, batch):
        if microbatches == 1:
            grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params, batch)
        else:
            grads, metrics = accumulated(state.params, batch)
        metrics["grad_norm"] = optax.global_norm(grads)
        return state.apply_gradients(grads), metrics

    batch_shardings = {k: batch_sharding for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    return jit_on(batch_sharding.mesh, step, in_shardings=(shardings, batch_shardings),
                  out_shardings=(shardings, None), donate_argnums=(0,))
