"""FlexMARL's sampling through the paged rollout engine (:class:`jaxflow.rollout.RolloutEngine`).

:class:`AgentSampler` is what one agent needs beyond the engine: its prompts encoded from task
texts, scored into a :class:`~jaxflow.rl.rollout.RolloutBatch`, the engine built once on one
tensor-parallel replica of the agent's rollout mesh with weights swapped in per call, counters
of the decode work, and calls from several rollout-worker threads serialised (the engine's
scheduler is host state). The sampling itself (continuous batching over a paged KV pool, the G
rows of a prompt sharing its prefill, finished rows leaving the decode batch after each decode
call) is the engine's; no second decode loop lives in ``jaxflow.marl``.

Keys: row t of a prompt draws its token s with ``fold_in(row_key, s)`` (:func:`row_keys`), so a
row's sample is a function of (params, prompt, row key) only, whichever prompts share a call.

Replica: the engine runs one tensor-parallel replica (:func:`replica_mesh`: the rollout mesh's
first "data" index whose devices this process holds); rows are not split over "data" (the
paged engine has no data-parallel mode). Across processes each process runs its own replica on
its own devices: the same programs on the same rows and keys, so every process samples the
same tokens.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.models.sampler import SamplingConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.rollout import EngineSettings, RolloutBatch
from jaxflow.rl.tasks import Task, encode_prompts, score_completions
from jaxflow.rollout import EngineConfig, RolloutEngine
from jaxflow.train.lm_state import lm_functions

__all__ = ["AgentSampler", "Sampled", "SamplingStats", "replica_mesh", "row_keys"]


class Sampled(NamedTuple):
    """Host arrays: tokens [B, N] int32 (pad after EOS), logprobs [B, N] f32 (0 where masked),
    mask [B, N] f32 (1 up to and including EOS)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass
class SamplingStats:
    """Decode work in row-steps (one row through one 1-token decode step)."""

    row_steps: int = 0          # executed by the engine's decode calls (bucket padding included)
    padded_row_steps: int = 0   # a padded batch decode's: B * N (every token is a decode step)
    useful_row_steps: int = 0   # steps that produced a live token (up to and including EOS)
    calls: int = 0

    def add(self, other: "SamplingStats") -> None:
        """Add another sampler's counters to these, field by field (in place)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def saved_fraction(self) -> float:
        """Fraction of the padded decode's row-steps not executed."""
        return 1.0 - self.row_steps / self.padded_row_steps if self.padded_row_steps else 0.0


def row_keys(key: jax.Array, n: int) -> jax.Array:
    """Per-row keys ``fold_in(key, row)`` [n]."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(n, dtype=jnp.uint32))


def replica_mesh(mesh: Mesh) -> Mesh:
    """The sub-mesh of ``mesh`` at its first "data" index whose devices this process holds
    (every other axis whole): one tensor-parallel replica, where the engine runs. A mesh
    without a "data" axis is returned as it is; ValueError when no replica is local. A mesh of
    another runtime's devices (``--compile-only``'s abstract target, where no process runs
    it): the first replica whose devices one process holds, whichever."""
    if "data" not in mesh.axis_names:
        return mesh
    axis = mesh.axis_names.index("data")
    me = jax.process_index()
    ours = set(jax.devices())
    abstract = not any(d in ours for d in mesh.devices.flat)
    for i in range(mesh.devices.shape[axis]):
        devices = np.take(mesh.devices, [i], axis=axis)
        owner = me if not abstract else devices.flat[0].process_index
        if all(d.process_index == owner for d in devices.flat):
            return Mesh(devices, mesh.axis_names)
    raise ValueError(f"rollout mesh {dict(mesh.shape)}: no tensor-parallel replica lies on process "
                     f"{me}'s devices; valid: a 'model' axis within one process")


class AgentSampler:
    """One agent's sampling on its rollout mesh through the paged engine (module doc).

    Args:
      model_cfg, mesh: the agent's model and the rollout mesh (the engine runs on
        :func:`replica_mesh` of it: ``self.mesh``).
      max_new_tokens, temperature: sampling shape (temperature > 0).
      task, tokenizer: prompt width and scoring.
      settings: the engine's shapes (:class:`jaxflow.rl.rollout.EngineSettings`; slots default
        to the rows of the first call, so a call's rows all decode together).
      logits_hook: a stateless :class:`jaxflow.models.sampler.LogitsHook` on every step's
        logits; None: none.
      bucket_rows: :attr:`jaxflow.rollout.EngineConfig.bucket_rows` (True: a decode call
        carries only the running rows, padded to a power of two; False: every slot, the padded
        batch decode the engine benchmark compares against).
    """

    def __init__(self, model_cfg: TransformerConfig, mesh: Mesh, *, max_new_tokens: int,
                 temperature: float, task: Task, tokenizer: CharTokenizer,
                 settings: EngineSettings = EngineSettings(), logits_hook: Any = None,
                 bucket_rows: bool = True):
        if not isinstance(settings, EngineSettings):
            raise ValueError(f"settings={settings!r}: need a jaxflow.rl.rollout.EngineSettings")
        self.rollout_mesh, self.mesh = mesh, replica_mesh(mesh)
        self.model, self.task, self.tokenizer = model_cfg, task, tokenizer
        self.settings, self.logits_hook, self.bucket_rows = settings, logits_hook, bucket_rows
        self.fns = lm_functions(model_cfg, self.mesh)
        self.config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        self.prompt_width = task.max_prompt_len + 1  # + BOS
        self.stats = SamplingStats()
        self.engine: RolloutEngine | None = None  # built at the first call
        self._lock = threading.Lock()  # several rollout workers may share a sampler
        self._params: Any = None  # the params object the engine holds

    @property
    def param_shardings(self) -> Any:
        """The shardings the sampler's parameters must have (on :attr:`mesh`)."""
        return self.fns.param_shardings

    def engine_config(self, rows: int) -> EngineConfig:
        """The engine's shapes for calls of ``rows`` rows (``settings`` resolved)."""
        config = self.settings.engine_config(rows, self.prompt_width, self.config.max_new_tokens)
        return dataclasses.replace(config, bucket_rows=self.bucket_rows)

    def _engine(self, params: Any, rows: int) -> RolloutEngine:
        """The engine holding ``params`` (laid out by :attr:`param_shardings`; built at the
        first call, for ``rows`` rows)."""
        if params is not self._params:
            self._params = params
            if self.engine is None:
                self.engine = RolloutEngine(self.model, params, self.engine_config(rows),
                                            self.config, logits_hook=self.logits_hook,
                                            mesh=self.mesh)
            else:
                self.engine.update_weights(params, self.engine.version)
        assert self.engine is not None
        return self.engine

    def sample(self, params: Any, prompts: np.ndarray, lengths: np.ndarray, keys: jax.Array,
               group_size: int = 1) -> tuple[Sampled, SamplingStats]:
        """Samples ``max_new_tokens`` per row of prompts [B, W] (rows ``i*G .. i*G+G-1`` share
        prompt i, prefilled once), lengths [B]; ``keys`` [B] the per-row keys."""
        b, g, n = prompts.shape[0], group_size, self.config.max_new_tokens
        if b % g:
            raise ValueError(f"{b} rows are not groups of group_size={g}")
        with self._lock:
            eng = self._engine(params, b)
            before = eng.stats.decode_row_steps
            out = eng.generate(prompts[::g], np.asarray(lengths)[::g], keys, group_size=g)
            stats = SamplingStats(row_steps=eng.stats.decode_row_steps - before,
                                  padded_row_steps=b * n, calls=1,
                                  useful_row_steps=int(out.mask.sum()))
            self.stats.add(stats)
        return Sampled(out.tokens, out.logprobs, out.mask), stats

    def warm_up(self, params: Any, rows: int) -> None:
        """One call of ``rows`` one-token prompts (compiles the prefill and the full decode
        batch before anything is timed; smaller row buckets compile when first met)."""
        prompts = np.full((rows, self.prompt_width), self.config.pad_id, np.int32)
        prompts[:, 0] = self.tokenizer.bos_id
        before = dataclasses.replace(self.stats)
        self.sample(params, prompts, np.ones((rows,), np.int32), row_keys(jax.random.key(0), rows))
        with self._lock:
            self.stats = before

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
        """:meth:`generate` with the per-row keys [len(prompt_texts) * G] given; scored by the
        task (``versions`` left unknown: -1)."""
        texts = [p for p in prompt_texts for _ in range(group_size)]
        if keys.shape[0] != len(texts):
            raise ValueError(f"{keys.shape[0]} row keys for {len(texts)} rows")
        prompts, lengths = encode_prompts(self.tokenizer, texts, self.prompt_width)
        out, _ = self.sample(params, prompts, lengths, keys, group_size)
        rewards = score_completions(self.task, self.tokenizer, texts, out.tokens)
        return RolloutBatch(prompts, lengths, out.tokens, out.mask, out.logprobs, rewards)
