"""RolloutEngine: continuous batching over a paged KV cache, shared group prefixes, weights in place.

    engine = RolloutEngine(model_cfg, params, EngineConfig(slots=8, page_size=16, num_pages=256,
                           prefill_chunk=32), SamplingConfig(max_new_tokens=64, eos_id=2))
    out = engine.generate(prompts, prompt_lengths, keys, group_size=8)   # EngineOutput

or streaming: ``rid = engine.add_request(prompt, keys)``; ``engine.step()`` until
``engine.idle()``; ``engine.result(rid)``. Each :meth:`RolloutEngine.step` runs prefill chunk
calls (``prefill_rows`` prompts each) while fewer prefilled sequences wait than slots are free,
at most ``prefill_calls`` of them (so a long prompt does not stall decoding: chunked prefill),
and one decode call (``decode_steps`` steps) of every running sequence; between steps the host
scheduler (:mod:`jaxflow.rollout.scheduler`) retires finished sequences, frees their pages and
admits waiting requests into the free slots.

Sequence b of a request draws its token t with ``fold_in(keys[b], t)`` from the arithmetic of the
static sampler (:func:`jaxflow.models.make_sampler` with ``per_row_keys=True``), so its tokens
depend only on its own key and, on CPU, equal the static sampler's bit for bit.

Weights: :meth:`RolloutEngine.update_weights` swaps the parameter tree the next step uses (no
copy: the replica's arrays themselves); :meth:`RolloutEngine.follow` makes every step pick up
the current params of a SparseRL-Sync :class:`jaxflow.sync.replica.Replica`. In-flight sequences
continue with the new weights; every token records the version that produced it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.errors import UserError
from jaxflow.models.sampler import LogitsHook, SamplingConfig, _check_options
from jaxflow.models.transformer import Transformer, TransformerConfig
from jaxflow.rollout.decode_loop import loop_min_live, make_decode_loop
from jaxflow.rollout.model_step import by_identity, empty_pools, host_out, make_steps
from jaxflow.rollout.paged_attention import PAGED_BACKENDS
from jaxflow.rollout.pages import pages_for, pool_head_dim
from jaxflow.rollout.records import EngineOutput, RequestOutput, RoutingRecord
from jaxflow.rollout.scheduler import Request, Scheduler, copy_batches, hook_init_arrays, request_arrays
from jaxflow.rollout.scheduler import Sequence as Seq


class RolloutConfigError(UserError, ValueError):
    """A bad engine config or request; the message names the value and what is valid."""


def _int_at_least(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise RolloutConfigError(f"EngineConfig.{name}={value!r}: must be an int >= {low}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Shapes of the engine (fixed: the programs compile once).

    Attributes:
      slots: decode rows (sequences decoded together per step).
      page_size: tokens per KV page.
      num_pages: pages in the pool, the null page 0 included (KV memory = num_pages *
        page_size tokens per layer).
      prefill_chunk: prompt tokens per prefill row per step.
      prefill_rows: prompts prefilled together per prefill call.
      prefill_calls: the most prefill calls per engine step.
      narrow_tables: page tables only as wide as the call's longest row needs (the next power
        of two pages): attention reads what the rows hold, at up to log2(pages_per_seq) + 1
        compiled widths per program. False: always pages_per_seq wide (one shape each).
      bucket_rows: decode calls carry only the running sequences and prefill calls only the
        prompts being prefilled, each padded to the next power of two (at most ``slots`` /
        ``prefill_rows``; up to log2 + 1 compiled row counts per program), so a call's work
        follows the sequences in flight. False: always ``slots`` / ``prefill_rows`` rows. A
        logits hook with per-row state decodes all slots (its state is kept per slot).
      decode_steps: decode steps per decode call (one host round trip); a sequence that ends
        inside a call idles for the rest of it, and its slot is refilled after the call.
      loop_steps: > 0: while no request waits for a slot, decode calls run up to this many
        steps in one compiled loop (:mod:`jaxflow.rollout.decode_loop`: draws bit-identical to
        ``decode_steps=1``); other calls run ``decode_steps``. 0: off.
      loop_refill: with work queued, a loop returns once this many slots have freed (1: the
        single-step schedule; more: fewer round trips, ended rows idle until then; the same
        draws bit for bit on fixed shapes, ``narrow_tables`` and ``bucket_rows`` False).
      max_seq_len: the longest sequence (prompt + new tokens) a row can hold; its page table
        has ceil(max_seq_len / page_size) entries. None: the model's max_seq_len.
      attention: decode attention backend of :func:`jaxflow.rollout.paged_attention.paged_attention`
        (``PAGED_BACKENDS``: "xla" gathers the pages and runs the static sampler's masked
        attention; "tpu" / "gpu" the upstream paged-attention kernels; "auto" the platform's).
      interpret: run a Pallas attention kernel in interpret mode.
      top_logprobs: K of the per-token top-K log-probs (0: none).
      sampled_topk: the top-K of the distribution each token was drawn from (temperature, logit
        noise, hook, top-k / top-p: the behaviour policy's, as ``sis_b`` needs) instead of the
        model's raw log_softmax (:func:`jaxflow.rollout.model_step.make_steps`).
      record_routing: MoE models: each MoE layer's experts and gates at every position fed, in
        ``RequestOutput.routing_*`` (R3; :mod:`jaxflow.rollout.records`).
    """

    slots: int = 8
    page_size: int = 16
    num_pages: int = 256
    prefill_chunk: int = 32
    prefill_rows: int = 4
    prefill_calls: int = 2
    decode_steps: int = 1
    loop_steps: int = 0
    loop_refill: int = 1
    narrow_tables: bool = True
    bucket_rows: bool = True
    max_seq_len: int | None = None
    attention: str = "auto"
    interpret: bool = False
    top_logprobs: int = 0
    sampled_topk: bool = False
    record_routing: bool = False

    def __post_init__(self):
        _int_at_least("slots", self.slots, 1)
        _int_at_least("page_size", self.page_size, 1)
        _int_at_least("num_pages", self.num_pages, 2)
        _int_at_least("prefill_chunk", self.prefill_chunk, 1)
        _int_at_least("prefill_rows", self.prefill_rows, 1)
        _int_at_least("prefill_calls", self.prefill_calls, 1)
        _int_at_least("decode_steps", self.decode_steps, 1)
        _int_at_least("loop_steps", self.loop_steps, 0)
        _int_at_least("loop_refill", self.loop_refill, 1)
        _int_at_least("top_logprobs", self.top_logprobs, 0)
        if self.max_seq_len is not None:
            _int_at_least("max_seq_len", self.max_seq_len, 2)
        if self.attention not in PAGED_BACKENDS:
            raise RolloutConfigError(f"EngineConfig.attention={self.attention!r}; valid: "
                                     f"{PAGED_BACKENDS}")


@dataclasses.dataclass
class EngineStats:
    """Counters since construction: decode / prefill calls (``loop_calls`` of the decode calls
    ran the multi-step loop), row-steps executed by decode calls (rows x steps run per call),
    tokens generated, page copies, peak pages in use."""

    decode_calls: int = 0
    loop_calls: int = 0
    prefill_calls: int = 0
    decode_row_steps: int = 0
    tokens: int = 0
    page_copies: int = 0
    peak_pages: int = 0


def _graphdef_and_config(model) -> tuple[nnx.GraphDef, TransformerConfig | None, Any]:
    """(graphdef, model config or None, a template nnx.State or None)."""
    if isinstance(model, TransformerConfig):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0))))
        return graphdef, model, state
    if isinstance(model, Transformer):
        graphdef, state = nnx.split(model)
        return graphdef, model.config, state
    if isinstance(model, nnx.GraphDef):
        return model, None, None
    raise TypeError(f"model: need a TransformerConfig, Transformer or its nnx.GraphDef; got "
                    f"{type(model).__name__}")


class RolloutEngine:
    """Continuous-batching sampler over a paged KV pool (see the module docstring).

    Args:
      model: a TransformerConfig, a Transformer, or the GraphDef half of ``nnx.split(model)``.
      params: the state half of ``nnx.split(model)`` (an nnx.State) or its pure dict
        (``nnx.to_pure_dict``; e.g. a SparseRL-Sync replica's bf16 tree). Held, not copied.
      config: EngineConfig; sampling: SamplingConfig (``max_new_tokens`` is the output width).
      logit_noise_std, logits_hook: as :func:`jaxflow.models.make_sampler`. The hook's
        ``apply`` gets ``step`` as [B] (each row's own token index) and ``args`` None; a state
        (``init``) must be per row: every leaf [B, ...]. ``init`` runs when a sequence takes a
        slot, on its prompt [1, max_seq_len] right-padded; ``update`` after each real token.
      version: the version of ``params``.
      mesh: run on this mesh (one tensor-parallel replica): K/V pools sharded over its "model"
        axis by heads (:func:`jaxflow.rollout.model_step.pool_sharding`), ``auto`` attention
        per shard; params as given (e.g. already on the mesh with the model's shardings; host
        leaves are replicated). Decode rows are not split over other axes (they repeat the
        work). None: the default device.
    """

    def __init__(self, model, params: Any, config: EngineConfig = EngineConfig(),
                 sampling: SamplingConfig = SamplingConfig(), *, logit_noise_std: float = 0.0,
                 logits_hook: LogitsHook | None = None, version: int = 0,
                 mesh: Mesh | None = None):
        _check_options(sampling, logit_noise_std, logits_hook)
        if logits_hook is not None and logits_hook.update is not None and logits_hook.init is None:
            raise RolloutConfigError("logits_hook with update but no init: the engine keeps a "
                                     "per-row hook state, which init creates")
        self.graphdef, model_cfg, template = _graphdef_and_config(model)
        self.config, self.sampling, self.mesh = config, sampling, mesh
        self._template = params if isinstance(params, nnx.State) else template
        if self._template is None:
            raise TypeError("params as a pure dict need the model as a TransformerConfig or "
                            "Transformer (its structure); with a GraphDef pass an nnx.State")
        self._state = self._as_state(params)
        if model_cfg is None:
            model_cfg = by_identity(self.graphdef, ("config",),
                                     lambda: nnx.merge(self.graphdef, self._state).config)
        self.model_config = model_cfg
        max_len = model_cfg.max_seq_len if config.max_seq_len is None else config.max_seq_len
        if max_len > model_cfg.max_seq_len:
            raise RolloutConfigError(f"EngineConfig.max_seq_len={max_len} exceeds the model's "
                                     f"max_seq_len={model_cfg.max_seq_len}")
        self.max_seq_len = max_len
        width = pages_for(max_len, config.page_size)
        if config.num_pages - 1 < width:
            raise RolloutConfigError(
                f"EngineConfig.num_pages={config.num_pages}: the pool must hold at least one "
                f"sequence of max_seq_len={max_len} tokens, i.e. >= {width + 1} pages of "
                f"page_size={config.page_size} (page 0 is reserved)")
        self.version = int(version)
        step_options = dict(page_size=config.page_size, attention=config.attention,
                            interpret=config.interpret, top_logprobs=config.top_logprobs,
                            logit_noise_std=float(logit_noise_std), logits_hook=logits_hook,
                            vocab_size=model_cfg.vocab_size, mesh=mesh,
                            sampled_topk_of=config.sampled_topk, record_routing=config.record_routing)
        self.steps = by_identity(self.graphdef, ("steps", sampling, *step_options.items()),
                                  lambda: make_steps(self.graphdef, sampling, **step_options))
        loop_options = dict(page_size=config.page_size, pages_per_seq=width,
                            narrow=config.narrow_tables, max_steps=config.loop_steps, mesh=mesh)
        self.loop = None if not config.loop_steps else by_identity(
            self.graphdef, ("loop", self.steps.one_step, sampling, *loop_options.items()),
            lambda: make_decode_loop(self.graphdef, self.steps.one_step, sampling, **loop_options))
        self.pool_head_dim = pool_head_dim(  # 128 lanes where decode runs the TPU kernel
            n_heads=model_cfg.n_heads, n_kv_heads=model_cfg.n_kv_heads, head_dim=model_cfg.head_dim,
            rows=config.slots, num_pages=config.num_pages, page_size=config.page_size,
            pages_per_seq=width, dtype=model_cfg.compute_dtype, backend=config.attention,
            interpret=config.interpret, mesh=mesh)
        self.pools = empty_pools(n_layers=model_cfg.n_layers, n_kv_heads=model_cfg.n_kv_heads,
                                 num_pages=config.num_pages, page_size=config.page_size,
                                 head_dim=self.pool_head_dim, dtype=model_cfg.compute_dtype,
                                 mesh=mesh)
        self.scheduler = Scheduler(slots=config.slots, page_size=config.page_size,
                                   num_pages=config.num_pages, pages_per_seq=width,
                                   prefill_chunk=config.prefill_chunk,
                                   prefill_rows=config.prefill_rows,
                                   narrow_tables=config.narrow_tables,
                                   bucket_rows=config.bucket_rows)
        self.routing = RoutingRecord(model_cfg, max_len, on=config.record_routing)
        self.hook_state = None
        if logits_hook is not None and logits_hook.init is not None:
            self.hook_state = self.steps.init_hook_rows(
                None, np.arange(config.slots, dtype=np.int32),
                np.zeros((config.slots, max_len), np.int32), np.zeros((config.slots, max_len), bool))
        self.stats = EngineStats()
        self._next_rid = 0
        self._done: dict[int, Request] = {}
        self._replica = None
        self._key_shape: tuple[int, ...] | None = None

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page over all layers (keys and values): peak KV bytes of a run are
        ``stats.peak_pages * page_bytes``; the pool's ``config.num_pages * page_bytes`` (at the
        pool's stored head width, ``pool_head_dim``)."""
        c = self.model_config
        return (2 * c.n_layers * c.n_kv_heads * self.config.page_size * self.pool_head_dim
                * np.dtype(c.compute_dtype).itemsize)

    # -- weights ---------------------------------------------------------------------------

    def _as_state(self, params) -> nnx.State:
        """``params`` as an nnx.State of device arrays: jax leaves as they are (no copy), host
        (numpy) leaves put on the device (replicated on the mesh) once here rather than on
        every step."""
        where = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, where), params)
        if isinstance(params, nnx.State):
            return params
        state = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(state, params)
        return state

    def update_weights(self, params: Any, version: int) -> None:
        """The params the next step uses (an nnx.State or pure dict of the same structure and
        shapes; any float dtype the model casts, e.g. the bf16 replica). Not copied (host numpy
        leaves are put on the device once). Sequences in flight continue with these weights
        from their next token on; each token's version is in ``RequestOutput.versions``. A
        change of leaf dtypes (f32 -> bf16) compiles the programs once more."""
        state = self._as_state(params)
        (old, old_def), (new, new_def) = (jax.tree.flatten(x) for x in (self._state, state))
        if old_def != new_def or [np.shape(x) for x in old] != [np.shape(x) for x in new]:
            raise RolloutConfigError("update_weights: the params' tree structure or leaf shapes "
                                     "differ from the engine's model (need the same model's "
                                     "params)")
        self._state, self.version = state, int(version)

    def follow(self, replica) -> None:
        """Every step uses ``replica``'s current params and version (a
        :class:`jaxflow.sync.replica.Replica` that SparseRL-Sync's receiver advances in place);
        None stops following."""
        self._replica = replica
        if replica is not None:
            self._sync_replica()

    def _sync_replica(self) -> None:
        rep = self._replica
        while True:
            version = rep.version
            params = rep.params
            if rep.version == version:
                break
        if version != self.version:
            self.update_weights(params, version)

    # -- requests --------------------------------------------------------------------------

    def add_request(self, prompt, keys: jax.Array | np.ndarray, *,
                    max_new_tokens: int | None = None) -> int:
        """Queues one prompt [L] int (L >= 1) sampled G = len(keys) times (a group sharing the
        prompt's KV pages). ``keys``: [G] per-sequence PRNG keys (typed keys, or their
        ``jax.random.key_data`` [G, ...] uint32 for the default PRNG implementation). Returns
        the request id."""
        return self._queue(_token_ids(prompt, self.model_config.vocab_size, "prompt"), keys,
                           max_new_tokens)

    def _queue(self, prompt: np.ndarray, keys, max_new_tokens: int | None = None) -> int:
        """:meth:`add_request` of checked token ids [L] int32."""
        n_new = self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or not (
                1 <= n_new <= self.sampling.max_new_tokens):
            raise RolloutConfigError(f"max_new_tokens={n_new!r}: must be an int in [1, "
                                     f"{self.sampling.max_new_tokens}] (SamplingConfig's)")
        if prompt.size < 1 or prompt.size + n_new > self.max_seq_len:
            raise RolloutConfigError(
                f"prompt length {prompt.size} + max_new_tokens {n_new} = {prompt.size + n_new}: "
                f"must be in [{1 + n_new}, max_seq_len={self.max_seq_len}]")
        key_data = _key_data(keys)
        if self._key_shape is None:
            self._key_shape = key_data.shape[1:]
        rid = self._next_rid
        req = Request(rid=rid, prompt=prompt, max_new_tokens=int(n_new), sequences=[])
        req.sequences = [Seq(request=req, member=g, key_data=key_data[g])
                         for g in range(key_data.shape[0])]
        need = self.scheduler.admission_pages(req)
        if need > self.scheduler.pages.capacity:
            raise RolloutConfigError(
                f"EngineConfig.num_pages={self.config.num_pages} too small for a prompt of "
                f"{prompt.size} tokens + {n_new} new: one sequence needs {need} pages of "
                f"{self.config.page_size} tokens (+1 null page)")
        self._next_rid += 1
        self.scheduler.add(req)
        return rid

    def idle(self) -> bool:
        """No request waiting or in flight."""
        return self.scheduler.idle()

    def step(self) -> list[int]:
        """One engine step: admit, prefill chunk calls, fill slots, one decode call of every
        running sequence. Returns the ids of the requests that completed."""
        if self._replica is not None:
            self._sync_replica()
        sched = self.scheduler
        sched.admit()
        for _ in range(self.config.prefill_calls):
            if not sched.prefilling or len(sched.ready) >= sched.free_slots():
                break
            reqs, tokens, start, n_valid, table = sched.prefill_batch()
            self.pools = self.routing.prefilled(
                self.steps.prefill(self._state, self.pools, tokens, start, n_valid, table), reqs, start, n_valid)
            sched.finish_prefill(reqs)
            self.stats.prefill_calls += 1
        sched.assign_slots()
        sched.admit()  # sequences that took slots make room in the prefill look-ahead
        assigned = sched.take_assigned()
        if assigned and self.hook_state is not None:
            self._init_hook_rows(assigned)
        copies = sched.take_copies()
        if copies:
            self._copy(copies)
        completed: list[Request] = []
        if sched.running():
            by_slot = self.hook_state is not None
            min_live = None if self.loop is None else loop_min_live(
                sched, packed=self.config.bucket_rows and not by_slot,
                refill=self.config.loop_refill)
            looped = min_live is not None
            n_steps = self.config.loop_steps if looped else self.config.decode_steps
            args = sched.decode_batch(self.sampling.pad_id, self._key_shape, n_steps,
                                      by_slot=by_slot, ahead=looped)
            self.pools, out, self.hook_state = (
                self.loop(self._state, self.pools, *args, min_live, self.hook_state) if looped
                else self.steps.decode(self._state, self.pools, *args, n_steps, self.hook_state))
            out = host_out(out)
            self.routing.decoded(sched.decode_rows, out)
            completed = sched.finish_decode(out, self.version, self.sampling.stop_ids,
                                            trim=looped)
            self.stats.decode_calls += 1
            self.stats.loop_calls += looped
            self.stats.decode_row_steps += len(args[0]) * (
                int(out.live.any(axis=1).sum()) if looped else n_steps)
            self.stats.tokens += int(out.live.sum())
        self.stats.peak_pages = sched.pages.peak_in_use
        for req in completed:
            self._done[req.rid] = req
        return [req.rid for req in completed]

    def _init_hook_rows(self, assigned) -> None:
        rows, prompts, valid = hook_init_arrays(assigned, len(self.scheduler.slots),
                                                self.max_seq_len, self.sampling.pad_id)
        self.hook_state = self.steps.init_hook_rows(self.hook_state, rows, prompts, valid)

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copy_batches(copies, len(self.scheduler.slots)):
            self.pools = self.steps.copy_pages(self.pools, src, dst)
        self.stats.page_copies += len(copies)

    def run(self) -> None:
        """Steps until idle."""
        while not self.idle():
            self.step()

    def result(self, rid: int) -> RequestOutput:
        """The outputs of a completed request (removed from the engine)."""
        if rid not in self._done:
            raise KeyError(f"request {rid} has not completed (or its result was taken)")
        return self._output(self._done.pop(rid))

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(*request_arrays(req, self.sampling.pad_id, self.config.top_logprobs),
                             *self.routing.arrays(req))

    def generate(self, prompts, prompt_lengths, keys: jax.Array, group_size: int = 1
                 ) -> EngineOutput:
        """Samples G = ``group_size`` continuations of each prompt.

        Args:
          prompts: [R, P] int32, right-padded; prompt_lengths: [R] int32 in [1, P].
          keys: [R * G] per-row PRNG keys; row i * G + g (prompt i's sequence g) draws its
            token t with ``fold_in(keys[i * G + g], t)`` (``make_sampler(per_row_keys=True)``
            on the prompts repeated G times samples the same).
          group_size: G, sequences per prompt sharing its prefilled KV pages.

        Returns:
          EngineOutput with leading axis R * G and N = max_new_tokens.
        """
        prompts = np.asarray(prompts)
        lengths = np.asarray(prompt_lengths).reshape(-1)
        if prompts.ndim != 2 or lengths.shape[0] != prompts.shape[0]:
            raise RolloutConfigError(f"prompts {prompts.shape} / prompt_lengths {lengths.shape}: "
                                     "need [R, P] and [R]")
        g = _int_at_least("group_size", group_size, 1)
        r = prompts.shape[0]
        keys = _key_data(keys)
        if keys.shape[0] != r * g:
            raise RolloutConfigError(f"keys: {keys.shape[0]} keys for {r} prompts x group_size "
                                     f"{g}; need {r * g}")
        bad = (lengths < 1) | (lengths > prompts.shape[1])
        if bad.any():
            raise RolloutConfigError(f"prompt_lengths={lengths[bad][0]}: must be in [1, "
                                     f"{prompts.shape[1]}] (the prompts' width)")
        # every row checked before any is queued
        ids = [_token_ids(prompts[i, :lengths[i]], self.model_config.vocab_size, f"prompts[{i}]")
               for i in range(r)]
        rids = [self._queue(ids[i], keys[i * g:(i + 1) * g]) for i in range(r)]
        self.run()
        outs = [self.result(rid) for rid in rids]
        return EngineOutput(*(np.concatenate([getattr(o, f) for o in outs])
                              for f in RequestOutput._fields))


def _token_ids(prompt, vocab_size: int, what: str) -> np.ndarray:
    """int32 [L] ids, checked before a cast could wrap or truncate them (RolloutConfigError)."""
    raw, valid = np.asarray(prompt).reshape(-1), f"valid: integers in [0, {vocab_size}) (the model's vocab_size)"
    if raw.size and raw.dtype.kind not in "iu":
        raise RolloutConfigError(f"{what}: token ids of dtype {raw.dtype} ({raw[0]!r}, ...); {valid}")
    if (bad := np.flatnonzero((raw < 0) | (raw >= vocab_size))).size:
        raise RolloutConfigError(f"{what}: token id {raw[bad[0]]} at position {bad[0]}; {valid}")
    return raw.astype(np.int32)


def _key_data(keys) -> np.ndarray:
    """Host key data [G, ...] uint32 of typed keys [G] (or of key data given as such)."""
    if isinstance(keys, jax.Array) and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        impl, default = jax.random.key_impl(keys), jax.random.key_impl(jax.random.key(0))
        if str(impl) != str(default):
            raise RolloutConfigError(f"keys of PRNG implementation {impl}: the engine draws with "
                                     f"the default implementation {default}")
        keys = jax.random.key_data(keys)
    data = np.asarray(keys)
    if data.dtype != np.uint32 or data.ndim < 2 or data.shape[0] < 1:
        raise RolloutConfigError(f"keys: need [G >= 1] PRNG keys (or their uint32 key data "
                                 f"[G, ...]); got {data.dtype}{list(data.shape)}")
    return data


__all__: Sequence[str] = ["EngineConfig", "EngineOutput", "EngineStats", "RequestOutput",
                          "RolloutConfigError", "RolloutEngine"]
