"""OxygenREC (and its TIGER-style baselines and ablations) as a :class:`jaxflow.system.System`.

An *arm* (:class:`Arm`) says what the generative recommender is fed and trained with:
instruction tokens, Instruction-Guided Retrieval, the Q2I loss. :class:`OxygenRECSystem`
trains one arm in two stages on one seed's :class:`jaxflow.genrec.setup.GenRecSetup`:

- ``sft``: the behaviour-weighted generation loss (+ Q2I), Adam, batches of training requests
  drawn uniformly with replacement (:func:`sft_batches`), split over the "data" mesh;
- ``rl`` (:meth:`OxygenRECSystem.start_rl`: a fresh Adam around the SFT params): SA-GCPO on
  groups sampled from the trie-constrained policy (:mod:`jaxflow.genrec.rl`); each step's
  sampling key is split from the state's ``key`` stream (:func:`rl_step_fn`).

``evaluate`` is Recall / NDCG / unified reward at ``config.k`` of the constrained beam search
over the test requests (flat: ``recall``, ``<scenario>/recall``, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program
from jaxflow.genrec.data.requests import RecData, Requests
from jaxflow.genrec.metrics import recall_ndcg_at_k
from jaxflow.genrec.model import GenRec, GenRecConfig
from jaxflow.genrec.rl import make_rl_fns, unified_reward
from jaxflow.genrec.setup import GenRecSetup, build_setup
from jaxflow.genrec.train import (
    ENCODER_KEYS,
    adam_sft_step,
    data_mesh,
    init_model,
    model_inputs,
    recommend,
    replicated_state,
    shard_batch,
)
from jaxflow.rl.advantages import sa_gcpo_advantages
from jaxflow.system import static_field, system_state
from jaxflow.train.loop import last_row, run_steps
from jaxflow.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Arm:
    """What a generative arm feeds and trains: ``instructions`` (instruction tokens in the
    encoder), ``igr`` (Instruction-Guided Retrieval over the history), ``q2i`` (the Q2I loss)."""

    instructions: bool = True
    igr: bool = True
    q2i: bool = True


#: the generative arms of the ``oxygenrec`` experiment
ARMS = {"oxygenrec": Arm(True, True, True), "oxygenrec_no_igr": Arm(True, False, True),
        "oxygenrec_no_q2i": Arm(True, True, False), "tiger": Arm(False, False, False),
        "tiger_instruction": Arm(True, False, False)}


def model_config(config, data: RecData, *, levels: int, instructions: bool,
                 igr: bool) -> GenRecConfig:
    """The GenRec of one arm; ``levels`` is the semantic-ID length (k-means + dedup)."""
    m = config.model
    return GenRecConfig(levels=levels, width=m.width, instruction_vocab=data.instruction_vocab,
                        max_instruction=data.train.instruction.shape[1] if instructions else 0,
                        max_history=m.max_history, behaviours=len(data.behaviour_weights),
                        d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff,
                        encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers,
                        use_igr=igr)


def score(items: np.ndarray, data: RecData, requests: Requests, config) -> dict:
    """Recall / NDCG at ``config.k`` overall and per scenario, and the mean unified reward of
    the top k, of ranked items int[R, >= k] (-1 = none) for ``requests``."""
    recall, ndcg = recall_ndcg_at_k(items, requests.target, config.k)
    reward = unified_reward(items[:, :config.k], requests, data, config.rl).mean(1)
    out = {"recall": float(recall.mean()), "ndcg": float(ndcg.mean()),
           "reward": float(reward.mean()), "per_scenario": {}}
    for s, name in enumerate(data.scenarios):
        m = requests.scenario == s
        if m.any():
            out["per_scenario"][name] = {"recall": float(recall[m].mean()),
                                         "ndcg": float(ndcg[m].mean()), "n": int(m.sum())}
    return out


class RLBatch(NamedTuple):
    """One RL step's requests: ``requests`` (host, for the rewards) and ``encoder`` (their
    encoder inputs ``ENCODER_KEYS`` [B, ...], split over the mesh)."""

    requests: Requests
    encoder: dict


@system_state
class OxygenRECState:
    """The state of one arm.

    Attributes:
      train: the GenRec :class:`TrainState` (params replicated, Adam of the stage).
      key: the RL sampling stream (each RL step splits it once; unused in SFT).
      graphdef: the GenRec graphdef (static); config: the experiment config, its ``seed`` the
      arm's (static); setup: the seed's :class:`GenRecSetup` (static); arm: the :class:`Arm`
      (static); sft_step: the jitted SFT step (static); stage: ``"sft"`` or ``"rl"``
      (static); rl_fns: the jitted ``(sample, update)``
      of :func:`jaxflow.genrec.rl.make_rl_fns` in the RL stage, else None (static).
    """

    train: TrainState
    key: jax.Array
    graphdef: Any = static_field()
    config: Any = static_field()
    setup: GenRecSetup = static_field()
    arm: Arm = static_field()
    sft_step: Any = static_field(default=None)
    stage: str = static_field(default="sft")
    rl_fns: Any = static_field(default=None)


@dataclasses.dataclass(frozen=True)
class OxygenRECSystem:
    """One generative arm (default: full OxygenREC) as a :class:`jaxflow.system.System`."""

    arm: Arm = Arm()

    def init(self, config, meshes: Mapping[str, Any], key: jax.Array, *,
             setup: GenRecSetup | None = None) -> OxygenRECState:
        """The SFT-stage state: a fresh GenRec (seeded by ``config.seed``) with Adam at
        ``sft.lr``, replicated on ``meshes["mesh"]`` (default: all devices); ``key`` becomes
        the RL sampling stream. ``setup``: the seed's shared data / IDs / trie (built from
        ``config`` and ``config.seed`` when None)."""
        mesh = meshes["mesh"] if meshes.get("mesh") is not None else data_mesh()
        setup = setup if setup is not None else build_setup(config, config.seed, mesh)
        mc = model_config(config, setup.data, levels=setup.sid.levels,
                          instructions=self.arm.instructions, igr=self.arm.igr)
        graphdef, params = init_model(mc, seed=config.seed, mesh=setup.mesh)
        tx, sft_step = adam_sft_step(graphdef, *_sft_loss_args(config, self.arm))
        return OxygenRECState(replicated_state(tx, params, setup.mesh), key, graphdef, config,
                              setup, self.arm, sft_step)

    def start_rl(self, state: OxygenRECState) -> OxygenRECState:
        """The RL-stage state: the SFT params with a fresh Adam at ``rl.lr`` (replicated), the
        same key stream, the jitted sample / update."""
        rl = state.config.rl
        train = replicated_state(optax.adam(rl.lr), state.train.params, state.setup.mesh)
        return dataclasses.replace(state, train=train, stage="rl",
                                   rl_fns=make_rl_fns(state.graphdef, rl))

    def step(self, state: OxygenRECState, batch, *,
             key: jax.Array | None = None) -> tuple[OxygenRECState, dict]:
        """SFT stage: one Adam step on ``batch`` (:func:`sft_batches`; ``key`` unused);
        metrics ``loss``, ``generation_loss`` (, ``q2i_loss``) on device. RL stage: sample a
        group per request of ``batch`` (:class:`RLBatch`) with ``key``, unified rewards,
        SA-GCPO advantages, ``rl.updates_per_batch`` updates; metrics ``reward`` (mean sampled
        reward) and ``loss`` (the last update's) as floats."""
        if state.stage == "sft":
            train, metrics = state.sft_step(state.train, batch)
            return dataclasses.replace(state, train=train), metrics
        if key is None:
            raise ValueError("step(key=None) in the RL stage; valid: a PRNG key (the group "
                             "sampling's; rl_step_fn splits one from the state's stream)")
        rl, mesh, trie = state.config.rl, state.setup.mesh, state.setup.trie
        sample, update = state.rl_fns
        items, sampled, old_logp = sample(state.train.params, trie, key,
                                          *(batch.encoder[k] for k in ENCODER_KEYS))
        rewards = unified_reward(np.asarray(items), batch.requests, state.setup.data, rl)
        flat = jnp.asarray(rewards.reshape(-1))
        adv = sa_gcpo_advantages(flat, jnp.full(flat.shape, rl.target_reward, flat.dtype),
                                 rl.group_size).reshape(rewards.shape)
        valid = np.asarray(items) >= 0  # fewer items than the group: empty beams do not count
        full = {**batch.encoder, **shard_batch({"codes": np.asarray(sampled),
                                                "old_logp": np.asarray(old_logp),
                                                "advantages": np.where(valid, np.asarray(adv), 0.0),
                                                "valid": valid}, mesh)}
        train = state.train
        for _ in range(rl.updates_per_batch):
            train, metrics = update(train, trie, full)
        return (dataclasses.replace(state, train=train),
                {"reward": float(rewards.mean()), "loss": float(metrics["loss"])})

    def recommend(self, state: OxygenRECState, requests: Requests) -> np.ndarray:
        """Top-``beam_size`` items int32[R, beam_size] (-1: none) of the constrained beam
        search for ``requests``."""
        s = state.setup
        inputs = model_inputs(requests, s.sid.codes, s.data.behaviour_weights,
                              use_instruction=state.arm.instructions)
        return recommend(state.graphdef, state.train.params, s.trie, inputs,
                         beam_size=state.config.beam_size)

    def evaluate(self, state: OxygenRECState) -> dict:
        """Recall / NDCG / unified reward at k on the test requests, overall and per scenario
        (``<scenario>/recall``, ``<scenario>/ndcg``), as floats."""
        r = score(self.recommend(state, state.setup.data.test), state.setup.data,
                  state.setup.data.test, state.config)
        return {"recall": r["recall"], "ndcg": r["ndcg"], "reward": r["reward"],
                **{f"{sc}/{k}": float(v[k]) for sc, v in r["per_scenario"].items()
                   for k in ("recall", "ndcg")}}

    def programs(self, config, meshes: Mapping[str, Any]) -> list[Program]:
        """``sft/step`` and ``rl/update`` of this arm with abstract arguments on
        ``meshes["mesh"]`` (params and Adam state replicated, batches split over "data"):
        the seed's data and semantic IDs are built on the host (they fix the model's shapes),
        the model is only traced."""
        mesh = meshes["mesh"]
        setup = build_setup(config, config.seed, data_mesh([jax.devices()[0]]))
        mc = model_config(config, setup.data, levels=setup.sid.levels,
                          instructions=self.arm.instructions, igr=self.arm.igr)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: GenRec(mc, rngs=nnx.Rngs(config.seed))))
        replicated, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        on = lambda tree, sharding: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
        tx, sft_step = adam_sft_step(graphdef, *_sft_loss_args(config, self.arm))
        sft_state = TrainState.abstract(tx, params, jax.tree.map(lambda _: replicated, params))
        inputs = model_inputs(setup.data.train.take(np.arange(config.sft.batch_size)
                                                    % len(setup.data.train)),
                              setup.sid.codes, setup.data.behaviour_weights,
                              use_instruction=self.arm.instructions)
        rl, g = config.rl, config.rl.group_size
        _, update = make_rl_fns(graphdef, rl)
        rl_state = TrainState.abstract(optax.adam(rl.lr), params,
                                       jax.tree.map(lambda _: replicated, params))
        enc = model_inputs(setup.data.train.take(np.arange(rl.batch_size) % len(setup.data.train)),
                           setup.sid.codes, setup.data.behaviour_weights)
        b, levels = rl.batch_size, setup.sid.levels
        rl_batch = {**{k: enc[k] for k in ENCODER_KEYS},
                    "codes": np.zeros((b, g, levels), np.int32),
                    "old_logp": np.zeros((b, g, levels), np.float32),
                    "advantages": np.zeros((b, g), np.float32), "valid": np.ones((b, g), bool)}
        trie = on(setup.trie, replicated)
        return [Program("sft/step", sft_step, (sft_state, on(inputs, row)), mesh, kind="train",
                        tokens=config.sft.batch_size * levels),
                Program("rl/update", update, (rl_state, trie, on(rl_batch, row)), mesh,
                        kind="train", tokens=b * g * levels)]


def _sft_loss_args(config, arm: Arm) -> tuple[float, float, float]:
    """(lr, q2i_weight, q2i_temperature) of an arm's SFT (no Q2I term without ``arm.q2i``)."""
    sft = config.sft
    return sft.lr, (sft.q2i_weight if arm.q2i else 0.0), sft.q2i_temperature


def sft_batches(state: OxygenRECState, requests: Requests | None = None) -> Callable[[int], dict]:
    """``i -> batch`` of the SFT stage: ``sft.batch_size`` requests of ``requests`` (default the
    training requests) drawn uniformly with replacement from ``default_rng([seed, 1])`` (one
    draw per call, in call order), as model inputs split over the mesh."""
    s, sft = state.setup, state.config.sft
    requests = s.data.train if requests is None else requests
    if len(requests) == 0:
        raise ValueError("no training requests")
    if sft.batch_size % s.mesh.size:
        raise ValueError(f"sft.batch_size={sft.batch_size} is not divisible by {s.mesh.size} devices")
    inputs = model_inputs(requests, s.sid.codes, s.data.behaviour_weights,
                          use_instruction=state.arm.instructions)
    rng = np.random.default_rng([state.config.seed, 1])

    def batch(i: int) -> dict:
        idx = rng.integers(0, len(requests), sft.batch_size)
        return shard_batch({k: v[idx] for k, v in inputs.items()}, s.mesh)

    return batch


def rl_batches(state: OxygenRECState) -> Callable[[int], RLBatch]:
    """``i -> RLBatch`` of the RL stage: ``rl.batch_size`` training requests drawn uniformly
    with replacement from ``default_rng([seed, 3])`` (one draw per call, in call order)."""
    s = state.setup
    inputs = model_inputs(s.data.train, s.sid.codes, s.data.behaviour_weights)
    rng = np.random.default_rng([state.config.seed, 3])

    def batch(i: int) -> RLBatch:
        idx = rng.integers(0, len(s.data.train), state.config.rl.batch_size)
        return RLBatch(s.data.train.take(idx),
                       shard_batch({k: inputs[k][idx] for k in ENCODER_KEYS}, s.mesh))

    return batch


def rl_step_fn(system: OxygenRECSystem, batches: Callable[[int], RLBatch]):
    """A ``run_steps`` step of the RL stage: split the state's key stream once, step with the
    new subkey."""

    def step_fn(state: OxygenRECState, i: int):
        stream, sub = jax.random.split(state.key)
        return system.step(dataclasses.replace(state, key=stream), batches(i), key=sub)

    return step_fn


def train_stage(system: OxygenRECSystem, state: OxygenRECState, *, steps: int,
                requests: Requests | None = None, hooks=()) -> tuple[OxygenRECState, list[dict]]:
    """Runs ``steps`` steps of the state's stage (:func:`jaxflow.train.loop.run_steps`, rows =
    each step's metrics, ``hooks`` as ``run_steps`` takes them). Returns (state, rows as
    floats)."""
    if state.stage == "sft":
        batches = sft_batches(state, requests)
        step_fn = lambda st, i: system.step(st, batches(i))  # noqa: E731
    else:
        step_fn = rl_step_fn(system, rl_batches(state))
    result = run_steps(step_fn, state, steps=steps, summarize=last_row, hooks=hooks)
    return result.state, [{k: float(v) for k, v in row.items()} for row in jax.device_get(result.rows)]
