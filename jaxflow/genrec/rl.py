"""RL stage of the generative recommender: unified reward mapping + SA-GCPO on sampled items
(the stage is run by :class:`jaxflow.genrec.system.OxygenRECSystem`).

Per request, a group of ``group_size`` items comes from the trie-constrained policy: its top
beams (``group="beam"``, the default: SA-GCPO on the beams the service would show) or
samples (``group="sample"``). Each scenario's
business reward is a weighted sum of three signals,

* hit: the sampled item is the request's held-out target;
* match: the item fulfils the instruction (``genre``: the instructed genre; ``new``: a new
  release; ``different``: the instructed genre, which the user's history does not contain);
* novelty: the item is not in the user's history,

and the *unified mapping* divides by the largest attainable value, so every scenario's reward
is in [0, 1] on one scale. A request's target reward (``RLConfig.target_reward``, on that
scale) decides which samples may be reinforced (SA-GCPO): the default 0.5 lies above the
reward of an instruction-following miss ((match + novelty) / total = 0.29) and below any hit,
so only hits get positive advantages, while samples that ignore the instruction are pushed
down hardest.

Advantages and loss are the project's SA-GCPO: :func:`jaxflow.rl.advantages.sa_gcpo_advantages`
(group-normalised, positives zeroed below the target reward) and
:func:`jaxflow.rl.policy_loss.policy_loss` with ``algo="sa_gcpo"`` (the SAPO soft gate, mean
over sequences of the token mean).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.config_domains import COUNT, FINITE, POSITIVE, domains
from jaxflow.genrec import beam as beam_lib
from jaxflow.genrec.data.requests import RecData, Requests
from jaxflow.genrec.train import ENCODER_KEYS
from jaxflow.rl.policy_loss import PolicyLossConfig, policy_loss
from jaxflow.train.state import TrainState


@domains(steps=COUNT, batch_size=COUNT, group_size=COUNT, updates_per_batch=COUNT, lr=POSITIVE, hit_weight=FINITE,
         match_weight=FINITE, novelty_weight=FINITE, tau_pos=POSITIVE, tau_neg=POSITIVE, target_reward=FINITE)
@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The SA-GCPO RL stage: steps, requests per step, group size, updates per batch, learning rate, the unified
    reward's weights and the target-gated advantages' temperatures and target."""
    steps: int = 40
    batch_size: int = 32  # requests per step (each gives group_size samples)
    group_size: int = 8
    updates_per_batch: int = 2  # the second update is off-policy by one step (rho != 1)
    lr: float = 3e-4
    hit_weight: float = 1.0
    match_weight: float = 0.3
    novelty_weight: float = 0.1
    tau_pos: float = 2.0
    tau_neg: float = 5.0
    target_reward: float = 0.5  # on the unified [0, 1] scale
    group: str = "beam"  # "beam": the top group_size beams; "sample": policy samples

    def __post_init__(self):
        if self.group not in ("beam", "sample"):
            raise ValueError(f"rl.group={self.group!r}; valid: beam, sample")
        if not 0 <= self.target_reward <= 1:
            raise ValueError(f"rl.target_reward={self.target_reward}: must be in [0, 1] (the "
                             "unified reward scale)")
        if min(self.hit_weight, self.match_weight, self.novelty_weight) < 0 or \
                self.hit_weight + self.match_weight + self.novelty_weight <= 0:
            raise ValueError("rl reward weights must be >= 0 with a positive sum, got "
                             f"{self.hit_weight}, {self.match_weight}, {self.novelty_weight}")


def instructed_genre(instruction: np.ndarray, n_scenarios: int) -> np.ndarray:
    """int[R] genre named by the instruction's second token, -1 when none."""
    tok = instruction[:, 1] if instruction.shape[1] > 1 else np.zeros(len(instruction), int)
    return np.where(tok > n_scenarios, tok - 1 - n_scenarios, -1)


def unified_reward(items, requests: Requests, data: RecData, config: RLConfig) -> np.ndarray:
    """Rewards f32[R, G] in [0, 1] of sampled items int[R, G] (see the module docstring)."""
    items = np.asarray(items)
    genre = data.item_genre[np.maximum(items, 0)]
    hist = requests.history
    in_hist = (items[:, :, None] == hist[:, None, :]).any(-1)
    hist_genres = np.where(hist >= 0, data.item_genre[np.maximum(hist, 0)], -1)
    genre_seen = (genre[:, :, None] == hist_genres[:, None, :]).any(-1)
    asked = instructed_genre(requests.instruction, len(data.scenarios))[:, None]
    name = np.asarray(data.scenarios)[requests.scenario][:, None]
    match = np.where(name == "new", data.item_new[np.maximum(items, 0)],
                     np.where(name == "different", (genre == asked) & ~genre_seen,
                              genre == asked))
    hit = items == requests.target[:, None]
    raw = (config.hit_weight * hit + config.match_weight * match
           + config.novelty_weight * ~in_hist)
    top = config.hit_weight + config.match_weight + config.novelty_weight
    return np.where(items >= 0, raw / top, 0.0).astype(np.float32)


def _policy_loss(logp, old_logp, advantages, mask, config: RLConfig):
    loss_config = PolicyLossConfig(algo="sa_gcpo", gate_tau_pos=config.tau_pos,
                                   gate_tau_neg=config.tau_neg)
    return policy_loss(logp, old_logp, advantages, mask, config=loss_config)


def make_rl_fns(graphdef, config: RLConfig):
    """Jitted ``sample(params, trie, key, *enc) -> (items, codes, logp)`` and
    ``update(state, trie, batch) -> (state, metrics)``.

    ``enc``: the encoder inputs [B, ...] (``ENCODER_KEYS``); items int32[B, G], codes
    int32[B, G, L], logp f32[B, G, L]. ``state``: a :class:`TrainState` (its ``tx`` the
    optimizer); ``batch``: the encoder inputs plus codes / old_logp [B, G, L], advantages f32[B, G]
    and valid bool[B, G]; metrics: the SA-GCPO loss and its diagnostics."""
    G = config.group_size

    @jax.jit
    def sample(params, trie, key, *enc):
        model = nnx.merge(graphdef, params)
        if config.group == "sample":
            return beam_lib.constrained_sample(model, trie, *enc, samples=G, key=key)
        items, codes, _ = beam_lib.beam_search(model, trie, *enc, beam_size=G)
        codes = jnp.where(items[..., None] >= 0, codes, 0)
        b, _, levels = codes.shape
        rep = [jnp.repeat(x, G, axis=0) for x in enc]
        logp = beam_lib.constrained_logp(model, trie, *rep, codes.reshape(b * G, levels))
        return items, codes, logp.reshape(b, G, levels)

    @jax.jit
    def update(state: TrainState, trie, batch):
        enc = [jnp.repeat(batch[k], G, axis=0) for k in ENCODER_KEYS]
        codes = batch["codes"].reshape(-1, batch["codes"].shape[-1])
        old = batch["old_logp"].reshape(codes.shape)
        adv = batch["advantages"].reshape(-1)

        def loss_fn(p):
            logp = beam_lib.constrained_logp(nnx.merge(graphdef, p), trie, *enc, codes)
            valid = jnp.broadcast_to(batch["valid"].reshape(-1, 1), codes.shape)
            return _policy_loss(logp, old, adv, valid, config)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads), {"loss": loss, **metrics}

    return sample, update
