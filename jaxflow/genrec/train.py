"""Supervised training and constrained retrieval for the generative recommender.

Pure pieces a notebook composes: ``model_inputs`` (host arrays for a batch of requests),
``make_sft_step`` (jitted ``(state, batch) -> (state, metrics)`` on a
:class:`jaxflow.train.state.TrainState`: behaviour-weighted generation loss + ``q2i_weight`` x
Q2I loss), ``fit`` (:func:`jaxflow.train.loop.run_steps` over that step, batches sharded over a
data-parallel mesh, parameters replicated) and ``recommend`` (constrained beam search, top-K
items per request).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.config_domains import COUNT, NON_NEGATIVE, POSITIVE, domains
from jaxflow.genrec import beam as beam_lib
from jaxflow.genrec.data.requests import RecData, Requests
from jaxflow.genrec.losses import generation_loss, q2i_loss
from jaxflow.genrec.model import GenRec, GenRecConfig
from jaxflow.genrec.trie import Trie
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


@domains(steps=COUNT, batch_size=COUNT, lr=POSITIVE, q2i_weight=NON_NEGATIVE, q2i_temperature=POSITIVE)
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """steps, batch_size, lr: the Adam loop; q2i_weight, q2i_temperature: the Q2I term;
    use_instruction: False feeds no instruction tokens (TIGER-style)."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    q2i_weight: float = 0.1
    q2i_temperature: float = 0.1
    use_instruction: bool = True


def model_inputs(requests: Requests, codes: np.ndarray, behaviour_weights, *,
                 use_instruction: bool = True) -> dict:
    """Host arrays for the model.

    Args:
      requests: R requests; codes: int32[N, L] semantic IDs; behaviour_weights: per type.
      use_instruction: False gives a zero-width instruction.

    Returns:
      dict of numpy arrays: instruction int32[R, I or 0], history_codes int32[R, H, L],
      history_behaviour int32[R, H], history_valid bool[R, H], target_codes int32[R, L],
      weight f32[R], target int32[R].
    """
    valid = requests.history >= 0
    instruction = requests.instruction if use_instruction else requests.instruction[:, :0]
    return {
        "instruction": instruction.astype(np.int32),
        "history_codes": codes[np.maximum(requests.history, 0)].astype(np.int32),
        "history_behaviour": requests.behaviour.astype(np.int32),
        "history_valid": valid,
        "target_codes": codes[requests.target].astype(np.int32),
        "weight": np.asarray(behaviour_weights, np.float32)[requests.target_behaviour],
        "target": requests.target.astype(np.int32),
    }


ENCODER_KEYS = ("instruction", "history_codes", "history_behaviour", "history_valid")


def sft_loss(model: GenRec, batch: dict, *, q2i_weight: float, q2i_temperature: float):
    """(loss, metrics) of one batch: generation loss + q2i_weight * Q2I (when weight > 0 and
    the batch has instructions)."""
    logits = model(*(batch[k] for k in ENCODER_KEYS), batch["target_codes"])
    gen = generation_loss(logits, batch["target_codes"], batch["weight"])
    metrics = {"generation_loss": gen}
    loss = gen
    if q2i_weight > 0 and batch["instruction"].shape[1] > 0:
        q2i = q2i_loss(model.query_vector(batch["instruction"]),
                       model.item_key(batch["target_codes"]), item_ids=batch["target"],
                       temperature=q2i_temperature)
        metrics["q2i_loss"] = q2i
        loss = loss + q2i_weight * q2i
    return loss, metrics


def make_sft_step(graphdef, config: SFTConfig):
    """Jitted SFT step ``(state, batch) -> (state, metrics)``.

    ``state``: a :class:`TrainState` of GenRec params (its ``tx`` the optimizer); ``batch``:
    :func:`model_inputs` arrays [B, ...]; metrics: scalar ``loss``, ``generation_loss`` (and
    ``q2i_loss``). Only ``config.q2i_weight`` / ``q2i_temperature`` are read (the step is pure).
    """

    def step(state: TrainState, batch):
        def loss_fn(p):
            return sft_loss(nnx.merge(graphdef, p), batch, q2i_weight=config.q2i_weight,
                            q2i_temperature=config.q2i_temperature)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads), {"loss": loss, **metrics}

    return jax.jit(step)


def data_mesh(devices=None) -> jax.sharding.Mesh:
    """1-D data-parallel mesh ("data",) over ``devices`` (default: all)."""
    devices = jax.devices() if devices is None else devices
    return jax.sharding.Mesh(np.asarray(devices), ("data",))


def shard_batch(batch: dict, mesh) -> dict:
    """Puts every array's leading (batch) axis on the mesh's "data" axis."""
    return {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch.items()}


def replicate(tree, mesh):
    """``tree`` replicated on ``mesh``: the shardings the jitted steps return, so the second
    call hits the first call's compiled program."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def init_model(config: GenRecConfig, *, seed: int, mesh=None):
    """(graphdef, params) of a fresh GenRec: one jitted init (replicated on ``mesh``)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: GenRec(config, rngs=nnx.Rngs(seed))))
    out = None if mesh is None else NamedSharding(mesh, P())
    params = jax.jit(lambda: nnx.split(GenRec(config, rngs=nnx.Rngs(seed)))[1],
                     out_shardings=out)()
    return graphdef, params


def fit(data: RecData, codes: np.ndarray, model_config: GenRecConfig, sft: SFTConfig, *,
        seed: int, requests: Requests | None = None, mesh=None, params=None, graphdef=None,
        log=None):
    """Trains a GenRec on ``requests`` (default ``data.train``) for ``sft.steps`` steps.

    Batches are drawn uniformly with replacement from a generator seeded by ``seed``; the
    batch (its size divisible by the mesh size) is sharded over the mesh's "data" axis
    (default: all devices). ``graphdef`` + ``params`` continue from a trained model.

    Returns:
      (graphdef, params, history) with history a list of per-step loss floats.
    """
    requests = data.train if requests is None else requests
    if len(requests) == 0:
        raise ValueError("no training requests")
    mesh = data_mesh() if mesh is None else mesh
    if sft.batch_size % mesh.size:
        raise ValueError(f"batch_size={sft.batch_size} is not divisible by {mesh.size} devices")
    if params is None:
        graphdef, params = init_model(model_config, seed=seed, mesh=mesh)
    elif graphdef is None:
        raise ValueError("fit(params=...) continues training and needs graphdef= as well")
    tx, step = adam_sft_step(graphdef, sft.lr, sft.q2i_weight, sft.q2i_temperature)
    state = replicated_state(tx, params, mesh)
    inputs = model_inputs(requests, codes, data.behaviour_weights,
                          use_instruction=sft.use_instruction)
    rng = np.random.default_rng([seed, 1])

    def step_fn(state, i):
        idx = rng.integers(0, len(requests), sft.batch_size)
        return step(state, shard_batch({k: v[idx] for k, v in inputs.items()}, mesh))

    result = run_steps(step_fn, state, steps=sft.steps, summarize=last_row,
                       hooks=[log_hook(log, every=100, steps=sft.steps)] if log is not None else ())
    history = jax.device_get([row["loss"] for row in result.rows])
    return graphdef, result.state.params, [float(x) for x in history]


def replicated_state(tx: optax.GradientTransformation, params, mesh, *, extra=None) -> TrainState:
    """A fresh :class:`TrainState` around ``params`` (and ``extra``), every leaf replicated on
    ``mesh`` (the layout the jitted steps return, so later steps reuse the first one's program)."""
    return replicate(TrainState.create(tx, params, extra=extra), mesh)


def log_hook(log, *, every: int, steps: int, prefix: str = ""):
    """A ``run_steps`` hook calling ``log(done, {prefix + name: float})`` with the row of every
    ``every``-th step and of the last (``steps``)."""

    def hook(done, state, row):
        if done % every == 0 or done == steps:
            log(done, {prefix + k: float(v) for k, v in row.items()})

    return hook


@functools.lru_cache(maxsize=32)
def adam_sft_step(graphdef, lr: float, q2i_weight: float, q2i_temperature: float):
    """(Adam at ``lr``, :func:`make_sft_step` of that loss), cached: one compiled program per
    model / loss (fits of equal shapes reuse it)."""
    tx = optax.adam(lr)
    sft = SFTConfig(lr=lr, q2i_weight=q2i_weight, q2i_temperature=q2i_temperature)
    return tx, make_sft_step(graphdef, sft)


@functools.lru_cache(maxsize=32)
def make_recommender(graphdef, beam_size: int):
    """Jitted ``(params, trie, encoder inputs...) -> (items, codes, scores)`` beam search."""

    def run(params, trie, instruction, history_codes, history_behaviour, history_valid):
        return beam_lib.beam_search(nnx.merge(graphdef, params), trie, instruction,
                                    history_codes, history_behaviour, history_valid,
                                    beam_size=beam_size)

    return jax.jit(run)


def recommend(graphdef, params, trie: Trie, inputs: dict, *, beam_size: int,
              batch_size: int = 256, recommender=None) -> np.ndarray:
    """Top-``beam_size`` items int32[R, K] (-1 where fewer valid items exist) for host inputs
    from :func:`model_inputs` (the last batch is padded to a fixed shape)."""
    run = recommender or make_recommender(graphdef, beam_size)
    r = inputs["target"].shape[0]
    out = []
    for start in range(0, r, batch_size):
        idx = np.arange(start, start + batch_size) % r
        items, _, _ = run(params, trie, *(inputs[k][idx] for k in ENCODER_KEYS))
        out.append(np.asarray(items)[: min(batch_size, r - start)])
    return np.concatenate(out)
