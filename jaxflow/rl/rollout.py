"""Rollouts: G sampled responses per prompt on the rollout sub-mesh, scored by the task.

The sampler is the foundation's jitted KV-cache sampler (:func:`jaxflow.models.make_sampler`):
its per-token log-probs are those of the distribution actually sampled from, i.e. the
*behaviour* policy mu that TIS / MIS correct for. Train/inference mismatch knobs (the trainer
always runs in f32):

  "none"        the sampler computes exactly like the trainer (f32).
  "bf16"        the sampler's activations / matmuls run in bfloat16 (params cast on the fly).
  "noise<s>"    Gaussian noise of std ``s`` is added to the raw logits at every sampled step
                (e.g. "noise0.1"); behaviour log-probs are those of the noisy distribution.
  "bf16+noise<s>" both: a bf16 sampler whose logits get the noise (an inference engine whose
                kernels and numerics differ from the trainer's by more than the cast).

Temperature: the sampler divides the logits by ``temperature``; the trainer must use the same
value (``jaxflow.rl.grpo`` passes one number to both).

Samplers (``RolloutSpec.sampler``, ``--set rl.sampler=...``):

  "static"          the static-batch sampler with one key per rollout (the historical stream).
  "static_per_row"  the static sampler with per-row keys ``split(key, B)`` (row b's token t drawn
                    with ``fold_in(keys[b], t)``): the engine's random stream, static arithmetic.
  "engine"          :class:`jaxflow.rollout.RolloutEngine` with the same per-row keys: paged KV
                    cache, continuous batching, the G responses of a prompt share its prefill
                    (copy-on-write pages). Its tokens equal "static_per_row"'s; its log-probs
                    agree to ~1e-6 (XLA:CPU f32 matmuls depend on the batch shape).

Every :class:`RolloutBatch` carries ``versions`` [B, N]: the weights version that sampled each
token (-1 where masked). The engine records it per token (an update between engine steps shows
up mid-sequence); the static samplers stamp the version they were given.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.config_domains import COUNT, domains
from jaxflow.data.tokenizer import Tokenizer
from jaxflow.distributed import put, to_host
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.sampler import SampleOutput, SamplingConfig, make_sampler
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.tasks import (
    TRUNCATED_REWARDS,
    Task,
    completion_tokens,
    encode_prompts,
    prompt_tokens,
    score_completions,
    stop_ids,
)
from jaxflow.train.lm_state import lm_functions

SAMPLERS = ("static", "static_per_row", "engine")
_NOISE = re.compile(r"^(bf16\+)?noise([0-9]*\.?[0-9]+)$")


def parse_mismatch(mismatch: str) -> tuple[str, float]:
    """``"none"`` / ``"bf16"`` / ``"noise<std>"`` / ``"bf16+noise<std>"`` -> (kind, noise std);
    kind is the string up to the std ("none", "bf16", "noise" or "bf16+noise")."""
    if mismatch in ("none", "bf16"):
        return mismatch, 0.0
    m = _NOISE.match(mismatch)
    if m and float(m.group(2)) > 0:
        return ("bf16+noise" if m.group(1) else "noise"), float(m.group(2))
    raise ValueError(f"unknown mismatch {mismatch!r}; valid: 'none', 'bf16', 'noise<std>' or "
                     "'bf16+noise<std>' with std > 0 (e.g. 'noise0.1', 'bf16+noise0.5')")


class _RolloutFields(NamedTuple):
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    behaviour_logp: np.ndarray
    rewards: np.ndarray
    versions: np.ndarray
    behaviour_topk_logp: np.ndarray
    behaviour_topk_ids: np.ndarray
    routing_experts: np.ndarray
    routing_gates: np.ndarray


class RolloutBatch(_RolloutFields):
    """One rollout, host numpy arrays; the G responses of a prompt are contiguous rows.

    prompts [B, P] int32 (``[BOS] prompt`` right-padded), prompt_lengths [B] int32,
    tokens [B, N] int32 (pad after EOS), mask [B, N] float32 (1 up to and including EOS),
    behaviour_logp [B, N] float32 (sampler's log-probs, 0 where masked), rewards [B] float32,
    versions [B, N] int32 (the weights version that sampled each token, -1 where masked or
    unknown; omitted: all -1), behaviour_topk_logp [B, N, K] float32 and behaviour_topk_ids
    [B, N, K] int32 (the K largest log-probs of the distribution each token was drawn from and
    their ids, 0 where masked; recorded for ``sis_b``, :attr:`RolloutSpec.behaviour_topk`),
    routing_experts [B, P + N - 1, L, k] (:func:`jaxflow.models.moe.expert_index_dtype`, e.g.
    uint8) and routing_gates [B, P + N - 1, L, k] float32 (each MoE layer's experts and gates at
    each position of ``prompt[:len] ++ tokens``, what R3 replays; :attr:`RolloutSpec.record_routing`).

    Optional records not taken are empty (K = 0: [B, N, 0]; routing [B, 0, 0, 0]), not None, so every row operation
    (slicing, selecting groups, concatenating generation batches) treats all fields alike;
    :attr:`has_behaviour_topk` says whether they were recorded.
    """

    __slots__ = ()

    def __new__(cls, prompts, prompt_lengths, tokens, mask, behaviour_logp, rewards,
                versions=None, behaviour_topk_logp=None, behaviour_topk_ids=None, routing_experts=None,
                routing_gates=None):
        shape = np.shape(tokens)
        if versions is None:
            versions = np.full(shape, -1, np.int32)
        if (behaviour_topk_logp is None) != (behaviour_topk_ids is None):
            given = "behaviour_topk_logp" if behaviour_topk_ids is None else "behaviour_topk_ids"
            raise ValueError(f"RolloutBatch: behaviour_topk_logp and behaviour_topk_ids go together; "
                             f"got only {given}")
        if behaviour_topk_logp is None:
            behaviour_topk_logp = np.zeros(shape + (0,), np.float32)
            behaviour_topk_ids = np.zeros(shape + (0,), np.int32)
        if routing_experts is None:
            routing_experts = np.zeros((shape[0], 0, 0, 0), np.uint8)
            routing_gates = np.zeros((shape[0], 0, 0, 0), np.float32)
        return super().__new__(cls, prompts, prompt_lengths, tokens, mask, behaviour_logp,
                               rewards, versions, behaviour_topk_logp, behaviour_topk_ids, routing_experts,
                               routing_gates)

    @property
    def has_routing(self) -> bool:
        """Whether the sampler recorded the MoE routing (R3)."""
        return np.size(self.routing_experts) > 0

    def routing_record(self, needed_by: str) -> np.ndarray:
        """routing_experts [B, P + N - 1, L, k]; ValueError naming ``needed_by`` when the
        sampler recorded none."""
        if not self.has_routing:
            raise ValueError(f"{needed_by} needs a rollout with the MoE routing recorded "
                             "(RolloutSpec.record_routing=True); this batch has none")
        return self.routing_experts

    @property
    def has_behaviour_topk(self) -> bool:
        """Whether the sampler recorded the behaviour policy's top-K (K > 0)."""
        return np.shape(self.behaviour_topk_ids)[-1] > 0

    def behaviour_topk(self, needed_by: str) -> list[np.ndarray]:
        """[behaviour_topk_logp, behaviour_topk_ids] ([B, N, K] each); ValueError naming
        ``needed_by`` when the sampler recorded none."""
        if not self.has_behaviour_topk:
            raise ValueError(f"{needed_by} needs a rollout with the behaviour top-K recorded "
                             "(RolloutSpec.behaviour_topk > 0); this batch has none")
        return [self.behaviour_topk_logp, self.behaviour_topk_ids]


def stamp_versions(mask: np.ndarray, version: int) -> np.ndarray:
    """[B, N] int32: ``version`` where ``mask`` > 0, -1 elsewhere (a static sampler's tokens
    all come from the one version it was given)."""
    return np.where(np.asarray(mask) > 0, np.int32(version), np.int32(-1)).astype(np.int32)


@functools.lru_cache(maxsize=16)
def make_noisy_sampler(graphdef: nnx.GraphDef, config: SamplingConfig, noise_std: float) -> Callable:
    """Like :func:`jaxflow.models.make_sampler`, with N(0, noise_std^2) added to the raw logits
    of every sampled step (the train/inference-mismatch knob). Same signature and outputs;
    log-probs are those of the noisy distribution. Needs temperature > 0."""
    if config.temperature == 0.0:
        raise ValueError("make_noisy_sampler needs temperature > 0 (greedy has no distribution)")
    return make_sampler(graphdef, config, float(noise_std))


def batch_sharding(mesh: Mesh, batch_size: int) -> NamedSharding:
    """Rows over the mesh's "data" axis when it divides ``batch_size``, else replicated."""
    n = mesh.shape.get("data", 1)
    spec = PartitionSpec("data") if n > 1 and batch_size % n == 0 else PartitionSpec()
    return NamedSharding(mesh, spec)


@domains(slots=COUNT, page_size=COUNT, num_pages=COUNT, prefill_chunk=COUNT, prefill_rows=COUNT,
         prefill_calls=COUNT, decode_steps=COUNT)
@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The rollout engine's shapes for ``sampler="engine"`` (``--set rl.engine.X=...``); see
    :class:`jaxflow.rollout.EngineConfig`. None picks the static sampler's budget:

    Attributes:
      slots: decode rows; None = every row of a generation batch (prompts x G).
      page_size: tokens per KV page.
      num_pages: pages in the pool (null page included); None = ``slots`` sequences of the
        static sampler's cache width (prompt width + max_new_tokens) + 1, i.e. the static
        sampler's KV budget (the engine's peak is below it: prompts are shared, pages freed).
      prefill_chunk: prompt tokens per prefill row per step; None = the prompt width (one chunk).
      prefill_rows, prefill_calls, decode_steps, attention: as EngineConfig.
    """

    slots: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    prefill_chunk: int | None = None
    prefill_rows: int = 4
    prefill_calls: int = 2
    decode_steps: int = 1
    attention: str = "auto"

    def __post_init__(self):
        for name in ("slots", "num_pages", "prefill_chunk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"engine.{name}={v!r}: need an int >= 1 or None")
        for name in ("page_size", "prefill_rows", "prefill_calls", "decode_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"engine.{name}={v!r}: need an int >= 1")
        from jaxflow.rollout.paged_attention import PAGED_BACKENDS

        if self.attention not in PAGED_BACKENDS:
            raise ValueError(f"engine.attention={self.attention!r}; valid: {PAGED_BACKENDS}")

    def engine_config(self, rows: int, prompt_width: int, max_new_tokens: int, behaviour_topk: int = 0,
                      record_routing: bool = False):
        """The :class:`jaxflow.rollout.EngineConfig` for generation batches of ``rows``
        sequences, prompts ``prompt_width`` wide, ``max_new_tokens`` new tokens; with
        ``behaviour_topk=K > 0`` the engine records the sampled distribution's top-K, with
        ``record_routing`` each MoE layer's routing (R3)."""
        from jaxflow.rollout import EngineConfig
        from jaxflow.rollout.pages import pool_pages

        width = prompt_width + max_new_tokens
        slots = rows if self.slots is None else self.slots
        num_pages = (pool_pages(slots, width, self.page_size) if self.num_pages is None
                     else self.num_pages)
        return EngineConfig(slots=slots, page_size=self.page_size, num_pages=num_pages,
                            prefill_chunk=self.prefill_chunk or prompt_width,
                            prefill_rows=self.prefill_rows, prefill_calls=self.prefill_calls,
                            decode_steps=self.decode_steps, max_seq_len=width,
                            attention=self.attention, top_logprobs=behaviour_topk,
                            sampled_topk=behaviour_topk > 0, record_routing=record_routing)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What a rollout samples: G responses per prompt, temperature, length (tokens), mismatch
    knob, which sampler (:data:`SAMPLERS`, module doc), the engine's settings, how a
    response that hit ``max_new_tokens`` without an EOS is rewarded (``truncated_reward``:
    "zero", or "score" it like the others; :func:`jaxflow.rl.tasks.score_with_truncation`),
    ``behaviour_topk``: K > 0 records, per token, the sampled distribution's top-K
    log-probs and ids (``RolloutBatch.behaviour_topk_*``, what ``sis_b`` needs); 0: off; and
    ``record_routing``: record each MoE layer's experts and gates per position
    (``RolloutBatch.routing_*``, R3; every sampler)."""

    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 5
    mismatch: str = "none"
    sampler: str = "static"
    engine: EngineSettings = EngineSettings()
    truncated_reward: str = "zero"
    behaviour_topk: int = 0
    record_routing: bool = False

    def __post_init__(self):
        if isinstance(self.behaviour_topk, bool) or not isinstance(self.behaviour_topk, int) \
                or self.behaviour_topk < 0:
            raise ValueError(f"behaviour_topk={self.behaviour_topk!r}: need an int >= 0 (0 = off)")
        if self.truncated_reward not in TRUNCATED_REWARDS:
            raise ValueError(f"truncated_reward={self.truncated_reward!r}; valid: "
                             f"{', '.join(TRUNCATED_REWARDS)}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size={self.group_size!r}: need an int >= 2 (GRPO groups)")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: need > 0 for RL sampling")
        parse_mismatch(self.mismatch)
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r}; valid: {', '.join(SAMPLERS)}")
        if not isinstance(self.engine, EngineSettings):
            raise ValueError(f"engine={self.engine!r}: need an EngineSettings")


class RolloutWorker:
    """Samples and scores on the rollout sub-mesh; evaluates held-out greedy accuracy.

    Params passed in are pure dicts already on the rollout mesh (see
    :func:`jaxflow.rl.publish.publish_weights`). Prompts are ``[BOS] prompt`` rows
    ``prompt_tokens(task) + 1`` tokens wide; a row stops at any of ``tokenizer.eos_ids``.
    ``last_reward_s``: host seconds the last :meth:`generate` spent scoring.
    """

    def __init__(self, model_cfg: TransformerConfig, mesh: Mesh, spec: RolloutSpec, task: Task,
                 tokenizer: Tokenizer):
        self.mesh, self.spec, self.task, self.tokenizer = mesh, spec, task, tokenizer
        self.fns = lm_functions(model_cfg, mesh)  # f32: the policy itself (eval, shardings)
        kind, noise = parse_mismatch(spec.mismatch)
        self.behaviour_topk = min(spec.behaviour_topk, model_cfg.vocab_size)  # K recorded for sis_b
        stops = stop_ids(tokenizer)
        sampling = SamplingConfig(max_new_tokens=spec.max_new_tokens,
                                  temperature=spec.temperature, eos_id=stops[0],
                                  pad_id=tokenizer.pad_id,
                                  eos_ids=stops if len(stops) > 1 else None)
        sampler_cfg = dataclasses.replace(model_cfg, dtype="bfloat16") if kind.startswith(
            "bf16") else model_cfg
        self._sampler_fns = lm_functions(sampler_cfg, mesh) if kind.startswith("bf16") else self.fns
        self._sampler_cfg, self._sampling, self._noise = sampler_cfg, sampling, noise
        from jaxflow.rollout.paged_attention import paged_attention

        # on TPU / GPU each decode step attends through the paged decode kernel (CPU: XLA), in
        # the rollout sampler and the held-out evaluation's greedy and pass@1 samplers alike
        kernel = DecodeKernel(paged_attention)
        self._sample = make_sampler(self._sampler_fns.graphdef, sampling, noise,
                                    per_row_keys=spec.sampler != "static",
                                    behaviour_topk=self.behaviour_topk, record_routing=spec.record_routing,
                                    decode_kernel=kernel)
        if spec.sampler == "engine" and jax.process_count() > 1:
            raise ValueError(f"sampler='engine' runs in one process (its scheduler is host "
                             f"state); this job has {jax.process_count()} processes: use "
                             "sampler='static' or 'static_per_row'")
        self.engine: Any = None  # the RolloutEngine (sampler="engine"), built at the first rollout
        self._following: Any = None  # the replica the engine follows (None: given params)
        greedy = dataclasses.replace(sampling, temperature=0.0,
                                     max_new_tokens=completion_tokens(task) + 1)
        self._greedy = make_sampler(self.fns.graphdef, greedy, decode_kernel=kernel)
        self._eval_sample = make_sampler(self.fns.graphdef, sampling, decode_kernel=kernel)
        self.prompt_width = prompt_tokens(task) + 1  # + BOS
        self.last_reward_s = 0.0
        self._heldout: dict[tuple[int, int], tuple] = {}

    @property
    def param_shardings(self) -> Any:
        """The shardings the worker's parameters must have (on the rollout mesh)."""
        return self.fns.param_shardings

    def _place(self, x: np.ndarray) -> jax.Array:
        return put(x, batch_sharding(self.mesh, x.shape[0]))

    def _put_key(self, key: jax.Array) -> jax.Array:
        """``key`` replicated on the mesh, placed per process (the mesh may span processes)."""
        data = np.asarray(jax.random.key_data(key))
        return jax.random.wrap_key_data(put(data, NamedSharding(self.mesh, PartitionSpec())))

    def row_keys(self, key: jax.Array, rows: int) -> jax.Array:
        """The per-row keys [rows] of a rollout key (samplers "static_per_row" and "engine"):
        ``split(key, rows)``; row b draws its token t with ``fold_in(keys[b], t)``."""
        return jax.random.split(key, rows)

    def sample(self, params: Any, prompts: np.ndarray, prompt_lengths: np.ndarray,
               key: jax.Array) -> SampleOutput:
        """Raw static-sampler call (device arrays) on token prompts [B, P]: one key with
        sampler "static", per-row keys ``row_keys(key, B)`` otherwise."""
        state = self._sampler_fns.nnx_state(params)
        if self.spec.sampler == "static":
            key = self._put_key(key)
        else:
            data = np.asarray(jax.random.key_data(self.row_keys(key, prompts.shape[0])))
            key = jax.random.wrap_key_data(self._place(data))
        return self._sample(state, self._place(prompts), self._place(prompt_lengths), key)

    def engine_for(self, params: Any, rows: int, *, version: int = 0) -> Any:
        """The worker's :class:`jaxflow.rollout.RolloutEngine` (built once, for generation
        batches of ``rows`` sequences; ``params`` its first weights)."""
        from jaxflow.rollout import RolloutEngine

        if self.engine is None:
            cfg = self.spec.engine.engine_config(rows, self.prompt_width, self.spec.max_new_tokens,
                                                 self.behaviour_topk, self.spec.record_routing)
            self.engine = RolloutEngine(self._sampler_cfg, params, cfg, self._sampling,
                                        logit_noise_std=self._noise, version=version,
                                        mesh=self.mesh)
        return self.engine

    def sample_engine(self, params: Any, prompts: np.ndarray, prompt_lengths: np.ndarray,
                      key: jax.Array, *, version: int = 0, replica: Any = None) -> Any:
        """The engine on token prompts [B, P] (rows ``i*G .. i*G+G-1`` the same prompt i, which
        is prefilled once): keys ``row_keys(key, B)``. ``replica``: a
        :class:`jaxflow.sync.replica.Replica` the engine follows in place (its params and
        version; ``params`` / ``version`` unused); otherwise the engine samples ``params`` as
        ``version``. Returns the engine's EngineOutput (host arrays [B, N])."""
        g = self.spec.group_size
        rows = prompts.shape[0]
        if rows % g or not (prompts[::g].repeat(g, 0) == prompts).all():
            raise ValueError(f"sample_engine: the {rows} rows are not groups of {g} equal prompts")
        engine = self.engine_for(replica.params if replica is not None else params, rows,
                                 version=version)
        if replica is not None:
            if self._following is not replica:
                engine.follow(replica)
        else:
            if self._following is not None:
                engine.follow(None)
            engine.update_weights(params, version)
        self._following = replica
        keys = self.row_keys(key, rows)
        return engine.generate(prompts[::g], prompt_lengths[::g], keys, group_size=g)

    def generate(self, params: Any, prompt_texts: Sequence[str], key: jax.Array, *,
                 version: int = -1, replica: Any = None) -> RolloutBatch:
        """G samples per prompt (rows ``i*G .. i*G+G-1`` answer prompt ``i``), scored.

        ``version``: the version of ``params``, recorded per token in ``versions`` (the engine
        records the version of the weights each step used). ``replica`` (sampler "engine"
        only): sample through the engine following this SparseRL-Sync replica in place.
        """
        g = self.spec.group_size
        texts = [p for p in prompt_texts for _ in range(g)]
        prompts, lengths = encode_prompts(self.tokenizer, texts, self.prompt_width)
        if self.spec.sampler == "engine":
            out = self.sample_engine(params, prompts, lengths, key, version=version,
                                     replica=replica)
            tokens, mask, logp, versions = out.tokens, out.mask, out.logprobs, out.versions
            topk = (out.topk_logprobs, out.topk_indices) if self.spec.behaviour_topk else (None, None)
            if self.spec.record_routing:  # [B, max_seq_len - 1, ...] -> the static sampler's P + N - 1
                width = prompts.shape[1] + self.spec.max_new_tokens - 1
                topk += (out.routing_experts[:, :width], out.routing_gates[:, :width])
        else:
            if replica is not None:
                raise ValueError(f"generate(replica=...) needs sampler='engine'; this worker's "
                                 f"is {self.spec.sampler!r}")
            out = self.sample(params, prompts, lengths, key)
            tokens, mask, logp = (to_host(x) for x in (out.tokens, out.mask, out.logprobs))
            versions = stamp_versions(mask, version)
            topk = ((to_host(out.topk_logprobs), to_host(out.topk_indices))
                    if self.spec.behaviour_topk else (None, None))
            if self.spec.record_routing:
                topk += (to_host(out.routing_experts), to_host(out.routing_gates))
        start = time.perf_counter()
        rewards = score_completions(self.task, self.tokenizer, texts, tokens,
                                    truncated_reward=self.spec.truncated_reward)
        self.last_reward_s = time.perf_counter() - start
        return RolloutBatch(prompts, lengths, np.asarray(tokens, np.int32),
                            np.asarray(mask, np.float32), np.asarray(logp, np.float32), rewards,
                            np.asarray(versions, np.int32),
                            *(None if x is None else np.asarray(x, d)
                              for x, d in zip(topk, (np.float32, np.int32, None, np.float32))))

    def sampler_programs(self, rows: int, *, prefix: str = "", model_flops: float = 0.0,
                         note: str = "") -> list:
        """``--compile-only``: the programs one generation batch of ``rows`` sequences runs on
        the rollout mesh, with abstract arguments (the published f32 params: a synced replica's
        bf16 values upcast). Sampler "static" / "static_per_row": the prefill + decode scan
        (``prefix + "rollout/sample"``: prompts [rows, prompt_width] int32, lengths [rows],
        the key); "engine": the paged engine's prefill and decode calls
        (:func:`jaxflow.rollout.programs.engine_programs`, ``prefix + "rollout/engine/*"``)."""
        from jaxflow.compile_only.program import Program

        width, n = self.prompt_width, self.spec.max_new_tokens
        if self.spec.sampler == "engine":
            from jaxflow.rollout.programs import engine_programs

            engine_cfg = self.spec.engine.engine_config(rows, width, n, self.behaviour_topk,
                                                        self.spec.record_routing)
            return engine_programs(self._sampler_cfg, self.mesh, engine_cfg, self._sampling,
                                   prompt_len=width, param_dtype=None,
                                   prefix=prefix + "rollout/engine/")
        row = batch_sharding(self.mesh, rows)
        key = jax.eval_shape(lambda: jax.random.key(0))
        state = self._sampler_fns.nnx_state(self.fns.abstract_params())
        args = (state, jax.ShapeDtypeStruct((rows, width), np.int32, sharding=row),
                jax.ShapeDtypeStruct((rows,), np.int32, sharding=row),
                jax.ShapeDtypeStruct(key.shape, key.dtype,
                                     sharding=NamedSharding(self.mesh, PartitionSpec())))
        return [Program(prefix + "rollout/sample", self._sample, args, self.mesh, kind="sample",
                        model_flops=model_flops, tokens=rows * n,
                        note=note + f"; prefill + {n - 1}-step decode scan, {rows} sequences")]

    def _heldout_batch(self, n: int, repeats: int) -> tuple:
        if (n, repeats) not in self._heldout:
            texts = [p for p in self.task.heldout_prompts(n) for _ in range(repeats)]
            prompts, lengths = encode_prompts(self.tokenizer, texts, self.prompt_width)
            self._heldout[n, repeats] = (texts, self._place(prompts), self._place(lengths))
        return self._heldout[n, repeats]

    def heldout_accuracy(self, params: Any, n: int, *, samples: int = 0) -> float:
        """Held-out exact-match rate of the policy itself (f32, no mismatch knob).

        ``samples=0``: greedy decoding of ``n`` fixed held-out prompts. ``samples=s > 0``:
        pass@1 at the RL temperature, averaged over ``s`` samples of each prompt, with a
        fixed key (common random numbers across runs, so runs differ only by their params).
        """
        texts, prompts, lengths = self._heldout_batch(n, max(samples, 1))
        fn = self._greedy if samples == 0 else self._eval_sample
        key = self._put_key(jax.random.key(0))
        out = fn(self.fns.nnx_state(params), prompts, lengths, key)
        rewards = score_completions(self.task, self.tokenizer, texts, to_host(out.tokens))
        return float(np.mean(rewards))
