"""Rollout engine: per-row-keyed KV-cache sampling that stops decoding finished sequences.

The foundation sampler (:func:`jaxflow.models.make_sampler`) decodes every row for all
``max_new_tokens`` steps in one scan. This engine

* gives every row its own key (``fold_in(row_key, t)`` at step t; the draw is a per-row
  ``categorical``), so a row's sample is a function of (params, prompt, row key) only;
* decodes in chunks of ``chunk`` steps and, between chunks, **compacts** the batch to the rows
  still live (padded up to a multiple of batch/8, see :func:`bucket`, to bound the number of
  compiled shapes; padding slots are marked done). Rows that finished (EOS) cost at most ``chunk - 1`` wasted
  steps instead of all remaining ones.

``compact=False, chunk=max_new_tokens`` is the padded batch decode (one scan, no host sync):
the reference the compacted decode is tested against (same tokens, log-probs and mask for the
same keys) and the count :attr:`EngineStats.padded_row_steps` is measured against.

Prefill and decode steps are the foundation sampler's (:func:`jaxflow.models.sampler.make_decoder`
with ``per_row_keys``); this engine adds the chunking, compaction and host bookkeeping.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import put
from jaxflow.marl.processes import host_tree, put_global
from jaxflow.models.sampler import SamplingConfig, make_decoder
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.rollout import RolloutBatch, batch_sharding
from jaxflow.rl.tasks import Task, encode_prompts, score_completions
from jaxflow.train.lm_state import lm_functions


class Sampled(NamedTuple):
    """Host arrays: tokens [B, N] int32 (pad after EOS), logprobs [B, N] f32 (0 where masked),
    mask [B, N] f32 (1 up to and including EOS)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass
class EngineStats:
    """Decode work in row-steps (one row through one 1-token decode step)."""

    row_steps: int = 0          # executed (incl. padding slots and finished rows in a chunk)
    padded_row_steps: int = 0   # what the padded batch decode would execute: B * (N - 1)
    useful_row_steps: int = 0   # steps that produced a live token
    calls: int = 0

    def add(self, other: "EngineStats") -> None:
        """Add another engine's counters to these, field by field (in place)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def saved_fraction(self) -> float:
        """Fraction of the padded decode's row-steps not executed."""
        return 1.0 - self.row_steps / self.padded_row_steps if self.padded_row_steps else 0.0


def bucket(n: int, batch: int) -> int:
    """Compacted batch size for ``n`` live rows of a ``batch``-row decode: ``n`` rounded up to
    a multiple of ``max(1, batch // 8)`` (at most 8 distinct shapes, so few compilations)."""
    g = max(1, batch // 8)
    return min(batch, -(-n // g) * g)


def row_keys(key: jax.Array, n: int) -> jax.Array:
    """Per-row keys ``fold_in(key, row)`` [n]."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(n, dtype=jnp.uint32))


@functools.lru_cache(maxsize=32)
def _functions(graphdef, config: SamplingConfig, logits_hook=None):
    """Jitted prefill / chunked decode (the foundation sampler's, per-row keys, optionally a
    stateless ``LogitsHook``) and a row gather for compaction."""
    dec = make_decoder(graphdef, config, per_row_keys=True, logits_hook=logits_hook)

    def prefill(state, prompts, lengths, keys):
        return dec.prefill(state, prompts, lengths, keys)

    def decode(state, carry, lengths, keys, t0, n_steps):
        return dec.decode(state, carry, lengths, keys, None, t0, n_steps)

    def gather(tree, idx):
        return jax.tree.map(lambda x: x[idx], tree)

    return jax.jit(prefill), jax.jit(decode, static_argnums=5), jax.jit(gather)


class RolloutEngine:
    """One agent's sampler on a rollout mesh (see module doc).

    Args:
      model_cfg, mesh: the agent's model and the rollout sub-mesh its params live on.
      max_new_tokens, temperature: sampling shape (temperature > 0).
      task, tokenizer: prompt width and scoring.
      chunk: decode steps between compactions; compact: drop finished rows between chunks.
      logits_hook: a stateless :class:`jaxflow.models.sampler.LogitsHook` applied to every
        step's logits (e.g. bench_rollout's forced output lengths); None: none.
      paged: sample through :class:`jaxflow.rollout.RolloutEngine` instead (paged KV cache,
        continuous batching, the G rows of a prompt share its prefill; one process only): the
        same per-row keys, so the same tokens and masks (log-probs within ~1e-6). ``paged`` is
        a :class:`jaxflow.rl.rollout.EngineSettings` (True: its defaults); slots default to
        the first call's rows. Calls are serialised (the engine's scheduler is host state).
    """

    def __init__(self, model_cfg: TransformerConfig, mesh: Mesh, *, max_new_tokens: int,
                 temperature: float, task: Task, tokenizer: CharTokenizer, chunk: int = 2,
                 compact: bool = True, paged: Any = None, logits_hook: Any = None):
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: need >= 1")
        self.mesh, self.task, self.tokenizer = mesh, task, tokenizer
        self.fns = lm_functions(model_cfg, mesh)
        self.config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        self.chunk, self.compact = chunk, compact
        self.prompt_width = task.max_prompt_len + 1  # + BOS
        self._prefill, self._decode, self._gather = _functions(self.fns.graphdef, self.config,
                                                               logits_hook)
        self.stats = EngineStats()
        self._stats_lock = threading.Lock()  # several rollout workers may share an engine
        self._cached = None
        self._model_cfg, self._paged_engine, self._paged_lock = model_cfg, None, threading.Lock()
        if paged is True:
            from jaxflow.rl.rollout import EngineSettings

            paged = EngineSettings()
        if paged not in (None, False) and jax.process_count() > 1:
            raise ValueError(f"paged: the paged engine runs in one process; this job has "
                             f"{jax.process_count()}")
        self.paged = paged or None

    @property
    def param_shardings(self) -> Any:
        """The shardings the engine's parameters must have (on the rollout mesh)."""
        return self.fns.param_shardings

    @property
    def prefill_fn(self) -> Any:
        """The jitted prefill ``(nnx_state, prompts [B, W] int32, lengths [B] int32, keys [B])
        -> (carry, (token, logp, live) each [B])`` (what :meth:`sample` runs first)."""
        return self._prefill

    @property
    def decode_fn(self) -> Any:
        """The jitted decode chunk ``(nnx_state, carry, lengths [B], keys [B], t0 [] int32,
        n_steps static) -> (carry, (tokens, logps, live) each [n_steps, B])``."""
        return self._decode

    def _put(self, x):
        return put(x, batch_sharding(self.mesh, x.shape[0]))

    def _state(self, params):
        """nnx state of ``params``, cached for the last params object (a published version is
        sampled many times)."""
        cached = self._cached
        if cached is not None and cached[0] is params:
            return cached[1]
        state = self.fns.nnx_state(params)
        self._cached = (params, state)
        return state

    def sample(self, params: Any, prompts: np.ndarray, lengths: np.ndarray, keys: jax.Array,
               *, chunk: int | None = None, compact: bool | None = None
               ) -> tuple[Sampled, EngineStats]:
        """Samples ``max_new_tokens`` per row; ``keys`` [B] are the per-row keys."""
        if self.paged is not None:
            return self._sample_paged(params, prompts, lengths, keys, group_size=1)
        chunk = self.chunk if chunk is None else chunk
        compact = self.compact if compact is None else compact
        cfg, n = self.config, self.config.max_new_tokens
        b = prompts.shape[0]
        state = self._state(params)
        lengths = self._put(np.asarray(lengths, np.int32))
        keys = put_global(keys, NamedSharding(self.mesh, PartitionSpec()))
        carry, (token, logp, live) = self._prefill(state, self._put(prompts), lengths, keys)
        tokens = np.full((b, n), cfg.pad_id, np.int32)
        logps = np.zeros((b, n), np.float32)
        mask = np.zeros((b, n), np.float32)
        tokens[:, 0], logps[:, 0], mask[:, 0], done_h = host_tree(
            (token, logp, live, carry.done))
        stats = EngineStats(padded_row_steps=b * (n - 1), calls=1)
        slots = np.arange(b)  # original row of each batch slot; -1: padding
        t = 1
        while t < n:
            if compact:  # done_h: the done flags fetched with the last outputs (one sync)
                active = np.nonzero(~done_h & (slots >= 0))[0]
                if active.size == 0:
                    break
                size = bucket(active.size, b)
                if size < len(slots):
                    idx = np.concatenate([active, np.full(size - active.size, active[0])])
                    pad = np.arange(size) >= active.size
                    carry = self._gather(carry, self._put(idx))
                    carry = carry._replace(done=carry.done | self._put(pad))  # padding never emits
                    lengths, keys = self._gather((lengths, keys), self._put(idx))
                    slots = np.where(pad, -1, slots[idx])
            steps = min(chunk, n - t)
            carry, out = self._decode(state, carry, lengths, keys, jnp.int32(t), steps)
            (tok, lp, lv), done_h = host_tree((out, carry.done))  # [steps, slots]
            real = slots >= 0
            rows = slots[real]
            tokens[rows, t:t + steps] = tok[:, real].T
            logps[rows, t:t + steps] = lp[:, real].T
            mask[rows, t:t + steps] = lv[:, real].T
            stats.row_steps += len(slots) * steps
            stats.useful_row_steps += int(lv[:, real].sum())
            t += steps
        with self._stats_lock:
            self.stats.add(stats)
        return Sampled(tokens, logps, mask), stats

    def _sample_paged(self, params: Any, prompts: np.ndarray, lengths: np.ndarray,
                      keys: jax.Array, *, group_size: int) -> tuple[Sampled, EngineStats]:
        """:meth:`sample` through the paged engine; rows ``i*G .. i*G+G-1`` share prompt i."""
        from jaxflow.rollout import RolloutEngine

        b, g, n = prompts.shape[0], group_size, self.config.max_new_tokens
        with self._paged_lock:
            if self._paged_engine is None:
                cfg = self.paged.engine_config(b, self.prompt_width, n)
                self._paged_engine = RolloutEngine(self._model_cfg, params, cfg, self.config)
            eng = self._paged_engine
            eng.update_weights(params, eng.version)
            before = dataclasses.replace(eng.stats)
            out = eng.generate(prompts[::g], np.asarray(lengths)[::g], keys, group_size=g)
            stats = EngineStats(row_steps=eng.stats.decode_row_steps - before.decode_row_steps,
                                padded_row_steps=b * (n - 1), calls=1,
                                useful_row_steps=int(out.mask[:, 1:].sum()))
        with self._stats_lock:
            self.stats.add(stats)
        return Sampled(out.tokens, out.logprobs, out.mask), stats

    def precompile(self, params: Any, batch: int) -> int:
        """Compiles every shape a ``batch``-row :meth:`sample` can hit (each compacted size and
        chunk length), so timed runs never compile. Returns the number of sizes."""
        n, chunk = self.config.max_new_tokens, self.chunk
        steps = sorted({min(chunk, n - t) for t in range(1, n, chunk)})
        prompts = np.full((batch, self.prompt_width), self.config.pad_id, np.int32)
        lengths = self._put(np.ones((batch,), np.int32))
        keys = put_global(row_keys(jax.random.key(0), batch),
                          NamedSharding(self.mesh, PartitionSpec()))
        state = self._state(params)
        carry, _ = self._prefill(state, self._put(prompts), lengths, keys)
        sizes = sorted({bucket(m, batch) for m in range(1, batch + 1)})
        for size in sizes:
            idx = self._put(np.arange(size) % batch)
            part = self._gather(carry, idx)
            part = part._replace(done=part.done | self._put(np.zeros(size, bool)))
            lk = self._gather((lengths, keys), idx)
            for k in steps:
                jax.block_until_ready(self._decode(state, part, *lk, jnp.int32(1), k))
        return len(sizes)

    def generate(self, params: Any, prompt_texts: Sequence[str], keys: jax.Array | Sequence,
                 group_size: int) -> RolloutBatch:
        """G samples per prompt (rows ``i*G .. i*G+G-1``). ``keys``: one key per prompt (or a
        single key for a single prompt); row t of prompt i is keyed ``fold_in(keys[i], t)``, so
        prompts batched together sample exactly what they sample one at a time."""
        if isinstance(keys, jax.Array) and keys.ndim == 0:
            keys = [keys]
        if len(keys) != len(prompt_texts):
            raise ValueError(f"{len(keys)} keys for {len(prompt_texts)} prompts; need one each")
        return self.generate_rows(params, prompt_texts,
                                  jnp.concatenate([row_keys(k, group_size) for k in keys]),
                                  group_size)

    def generate_rows(self, params: Any, prompt_texts: Sequence[str], keys: jax.Array,
                      group_size: int) -> RolloutBatch:
        """:meth:`generate` with the per-row keys [len(prompt_texts) * G] given."""
        texts = [p for p in prompt_texts for _ in range(group_size)]
        if keys.shape[0] != len(texts):
            raise ValueError(f"{keys.shape[0]} row keys for {len(texts)} rows")
        prompts, lengths = encode_prompts(self.tokenizer, texts, self.prompt_width)
        if self.paged is not None:  # G rows per prompt: one prefill each
            out, _ = self._sample_paged(params, prompts, lengths, keys, group_size=group_size)
        else:
            out, _ = self.sample(params, prompts, lengths, keys)
        rewards = score_completions(self.task, self.tokenizer, texts, out.tokens)
        return RolloutBatch(prompts, lengths, out.tokens, out.mask, out.logprobs, rewards)
