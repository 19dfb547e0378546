"""Pure step functions of both training modes (gradients, then jitted steps with updates).

  monolithic_grads  d loss / d (encoder, backbone) params of the whole VLM, one program
  encoder_forward   encoder embeddings + their vjp (residuals kept, returned as a pytree)
  backbone_grads    backbone loss, d loss / d backbone params and d loss / d image embeddings
  encoder_grads     the encoder's vjp applied to those cotangents

Decoupled == monolithic: encoder_grads(backbone_grads(encoder_forward(...))) sums the same
terms as monolithic_grads, in a different order (f32 round-off only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxflow.distributed import put, to_host
from jaxflow.flow.vit import ViTConfig, ViTEncoder
from jaxflow.flow.vlm import (
    AttentionBackend,
    SideFunctions,
    backbone_loss,
    init_side_state,
    side_functions,
    state_shardings,
)
from jaxflow.mesh import jit_on
from jaxflow.models.transformer import Transformer, TransformerConfig
from jaxflow.train.lm_state import OptimConfig, make_optimizer
from jaxflow.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Sides:
    """Encoder and backbone: functions, optimizers, and the meshes they live on."""

    vit: ViTConfig
    lm: TransformerConfig
    enc: SideFunctions
    bb: SideFunctions
    enc_tx: optax.GradientTransformation
    bb_tx: optax.GradientTransformation
    # The run's attention backend: the backbone's (causal) and the encoder's (bidirectional).
    backend: AttentionBackend = AttentionBackend.XLA
    # Jitted steps, built once per Sides so every trainer on these sides shares compilations.
    jitted: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def enc_state_shardings(self) -> TrainState:
        return state_shardings(self.enc, self.enc_tx)

    @property
    def bb_state_shardings(self) -> TrainState:
        return state_shardings(self.bb, self.bb_tx)

    def place(self, enc_state: TrainState, bb_state: TrainState) -> tuple[TrainState, TrainState]:
        """Fresh device copies of (host or device) states in these sides' state shardings, with
        these sides' optimizers (the states may come from other ``Sides`` of the same configs)."""
        def host(x):  # also a state on other processes' devices: gathered on every process
            return np.array(to_host(x))

        return (put(jax.tree.map(host, enc_state.replace(tx=self.enc_tx)),
                    self.enc_state_shardings),
                put(jax.tree.map(host, bb_state.replace(tx=self.bb_tx)), self.bb_state_shardings))

    def init(self, key: jax.Array) -> tuple[TrainState, TrainState]:
        k_enc, k_bb = jax.random.split(key)
        return (init_side_state(self.enc, lambda r: ViTEncoder(self.vit, rngs=r), self.enc_tx,
                                k_enc),
                init_side_state(self.bb, lambda r: Transformer(self.lm, rngs=r), self.bb_tx,
                                k_bb))


def build_sides(vit: ViTConfig, lm: TransformerConfig, enc_mesh: Mesh, bb_mesh: Mesh,
                optim: OptimConfig, total_steps: int,
                backend: AttentionBackend = AttentionBackend.XLA) -> Sides:
    """Each side gets its own optimizer (same hyper-parameters, own clipping) in every mode."""
    if vit.out_dim != lm.d_model:
        raise ValueError(f"vit.out_dim={vit.out_dim} must equal the LM's d_model={lm.d_model}")
    enc = side_functions(lambda r: ViTEncoder(vit, rngs=r), enc_mesh)
    bb = side_functions(lambda r: Transformer(lm, rngs=r), bb_mesh)
    return Sides(vit, lm, enc, bb, make_optimizer(optim, total_steps),
                 make_optimizer(optim, total_steps), backend)


def encoder_embeddings(sides: Sides, params: Any, patches: dict) -> jax.Array:
    """[R, L, P*P] patch rows -> flat [R * L, d_model] image-token embeddings (the encoder's
    attention on the run's backend, ``sides.backend``, as the backbone's)."""
    out = sides.enc.module(params)(patches["patches"], patches["segment_ids"],
                                   patches["rows"], patches["cols"], attention=sides.backend)
    return out.reshape(-1, out.shape[-1])


def monolithic_grads(sides: Sides, enc_params, bb_params, patches: dict, rows: dict, denom):
    def loss_fn(enc_params, bb_params):
        emb = encoder_embeddings(sides, enc_params, patches)
        return backbone_loss(sides.bb.module(bb_params), emb, rows, denom, backend=sides.backend)

    (loss, aux), (g_enc, g_bb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        enc_params, bb_params)
    return loss, aux, g_enc, g_bb


def encoder_forward(sides: Sides, enc_params, patches: dict):
    """(flat embeddings [R*L, d], vjp) — vjp maps a cotangent of the same shape to grads."""
    return jax.vjp(lambda p: encoder_embeddings(sides, p, patches), enc_params)


def encoder_grads(vjp_fn, cotangent: jax.Array):
    return vjp_fn(cotangent)[0]


def backbone_grads(sides: Sides, bb_params, image_embeds: jax.Array, rows: dict, denom):
    """(loss, aux, d loss / d backbone params, d loss / d image_embeds)."""
    def loss_fn(bb_params, emb):
        return backbone_loss(sides.bb.module(bb_params), emb, rows, denom, backend=sides.backend)

    (loss, aux), (g_bb, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        bb_params, image_embeds)
    return loss, aux, g_bb, g_emb


def _metrics(loss, aux, **norms):
    return {"loss": loss, "nll_sum": aux["nll_sum"], "correct": aux["correct"],
            **{k: optax.tree.norm(v) for k, v in norms.items()}}


def _cached(fn):
    def wrapper(sides: Sides):
        if fn.__name__ not in sides.jitted:
            sides.jitted[fn.__name__] = fn(sides)
        return sides.jitted[fn.__name__]

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


@_cached
def make_monolithic_step(sides: Sides):
    """jitted (enc_state, bb_state, patches, rows, denom) -> (enc_state, bb_state, metrics);
    the states are :class:`TrainState` (donated)."""
    def step(enc_state: TrainState, bb_state: TrainState, patches, rows, denom):
        loss, aux, g_enc, g_bb = monolithic_grads(sides, enc_state.params, bb_state.params,
                                                  patches, rows, denom)
        return (enc_state.apply_gradients(g_enc), bb_state.apply_gradients(g_bb),
                _metrics(loss, aux, enc_grad_norm=g_enc, bb_grad_norm=g_bb))

    out_shardings = (sides.enc_state_shardings, sides.bb_state_shardings, None)
    if sides.enc.mesh != sides.bb.mesh:  # both sides in one program: no one mesh context
        return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)
    return jit_on(sides.bb.mesh, step, donate_argnums=(0, 1), out_shardings=out_shardings)


@_cached
def make_backbone_step(sides: Sides):
    """jitted (bb_state, image_embeds, rows, denom) -> (bb_state, d image_embeds, metrics);
    ``bb_state`` a :class:`TrainState` (donated), image_embeds [E, d]."""
    def step(bb_state: TrainState, image_embeds, rows, denom):
        loss, aux, g_bb, g_emb = backbone_grads(sides, bb_state.params, image_embeds, rows,
                                                denom)
        return bb_state.apply_gradients(g_bb), g_emb, _metrics(loss, aux, bb_grad_norm=g_bb)

    return jit_on(sides.bb.mesh, step, donate_argnums=(0,),
                  out_shardings=(sides.bb_state_shardings, None, None))


@_cached
def make_encoder_fns(sides: Sides):
    """(forward: (params, patches) -> (embeds, vjp), update: (enc_state, vjp, cot) -> state)."""
    forward = jit_on(sides.enc.mesh, lambda params, patches: encoder_forward(sides, params, patches))

    def update(enc_state: TrainState, vjp_fn, cotangent):
        g = encoder_grads(vjp_fn, cotangent)
        return enc_state.apply_gradients(g), optax.tree.norm(g)

    return forward, jit_on(sides.enc.mesh, update, out_shardings=(sides.enc_state_shardings, None))


def eval_correct(sides: Sides, enc_params, bb_params, patches: dict, rows: dict):
    """Per-token argmax correctness (teacher forcing) on loss tokens: [R, T] bool."""
    emb = encoder_embeddings(sides, enc_params, patches)
    _, aux = backbone_loss(sides.bb.module(bb_params), emb, rows, jnp.float32(1.0),
                           backend=sides.backend)
    return aux["correct"]


@_cached
def make_eval_step(sides: Sides):
    """jitted ``(enc_params, bb_params, patches, rows) -> correct [R, T] bool`` (teacher-forced
    argmax == target on loss tokens, :func:`eval_correct`); under the backbone mesh's context
    when both sides share it (so ``auto`` attention can pick its kernel)."""
    def fn(e, b, p, r):
        return eval_correct(sides, e, b, p, r)

    return jit_on(sides.bb.mesh, fn) if sides.enc.mesh == sides.bb.mesh else jax.jit(fn)
