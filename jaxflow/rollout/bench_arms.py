"""bench_rollout's workloads and its two arms: the paged engine and the static sampler, both
sampling the same sequences (driver ``jaxflow/main/bench_rollout.py``,
the cases in :mod:`jaxflow.rollout.bench`).

Output lengths are forced, identically for every arm, by a stateless :class:`LogitsHook`: at
token t the hook gives EOS probability ``hazard[t]`` and the model's own distribution over the
other tokens the rest (renormalised without EOS). Every arm draws token t of a sequence with
``fold_in(key, t)`` from the same hooked distribution, so a sequence's tokens and length are the
same in every arm, and its length is an independent draw from the pmf the hazard encodes
(``hazard[t] = P(L = t + 1) / P(L >= t + 1)``; ``hazard[N - 1] = 1``, the cap).

KV budget (equal for every arm): ``slots`` rows of ``P + N`` tokens. The static sampler runs the
sequences in waves of ``slots`` rows with a ``[slots, P + N]`` cache each;
the paged engine gets ``slots`` decode rows and a pool of ``slots * ceil((P + N) / page_size)``
pages plus its null page.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.models.sampler import LogitsHook, SamplingConfig, make_sampler
from jaxflow.rollout import EngineConfig, RolloutEngine
from jaxflow.rollout.pages import pages_for, pool_pages

EOS_ID, PAD_ID = 2, 0
FIRST_PROMPT_TOKEN = 3  # prompt tokens are drawn from [3, vocab): no PAD / BOS / EOS


# -- length distributions -------------------------------------------------------------------

def length_pmf(kind: str, cap: int, *, median_frac: float, sigma: float) -> np.ndarray:
    """P(L = l) for l = 1..cap as [cap] f64. ``equal``: every length is ``cap``. ``long_tail``:
    a lognormal with median ``median_frac * cap`` and log-std ``sigma``, discretised
    (P(L = l) = F(l) - F(l - 1)) with the mass above the cap at the cap."""
    if kind == "equal":
        pmf = np.zeros(cap)
        pmf[-1] = 1.0
        return pmf
    if kind != "long_tail":
        raise ValueError(f"length distribution {kind!r}; valid: equal, long_tail")
    mu = math.log(median_frac * cap)

    def cdf(x: float) -> float:
        return 0.0 if x <= 0 else 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))

    pmf = np.array([cdf(lv) - cdf(lv - 1) for lv in range(1, cap + 1)])
    pmf[-1] += 1.0 - pmf.sum()
    return pmf


def hazard(pmf: np.ndarray) -> np.ndarray:
    """EOS probability at token t given no EOS before: [N] f32, the last entry 1."""
    survival = np.cumsum(pmf[::-1])[::-1]  # P(L >= t + 1)
    h = np.where(survival > 0, pmf / np.maximum(survival, 1e-300), 1.0)
    h[-1] = 1.0
    return np.clip(h, 0.0, 1.0).astype(np.float32)


def forced_length_hook(h: np.ndarray, eos_id: int = EOS_ID) -> LogitsHook:
    """A stateless hook: the logits [B, V] become log-probs with P(eos) = ``h[step]`` and the
    model's distribution over the other tokens scaled to 1 - h[step]. ``step`` is a scalar (the
    static sampler) or [B] (the engine: each row's own token index)."""
    table = jnp.asarray(h, jnp.float32)

    def apply(logits, state, step, args):
        del state, args
        p_eos = jnp.reshape(table[step], (-1, 1))
        others = jax.nn.log_softmax(logits.astype(jnp.float32).at[:, eos_id].set(-jnp.inf), axis=-1)
        out = others + jnp.log1p(-p_eos)
        return out.at[:, eos_id].set(jnp.log(p_eos)[:, 0])

    return LogitsHook(apply=apply)


# -- workloads ------------------------------------------------------------------------------

class Workload(NamedTuple):
    """R prompts [R, P] (right-padded; lengths [R] uniform in [P // 2, P]) sampled G times each:
    S = R * G sequences, sequence i * G + g keyed ``keys[i * G + g]``."""

    name: str
    prompts: np.ndarray
    prompt_lengths: np.ndarray
    group_size: int
    keys: jax.Array
    pmf: np.ndarray
    hook: LogitsHook

    @property
    def sequences(self) -> int:
        """S = R * G."""
        return self.prompts.shape[0] * self.group_size

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The baselines' rows: every prompt repeated G times ([S, P], [S])."""
        g = self.group_size
        return np.repeat(self.prompts, g, axis=0), np.repeat(self.prompt_lengths, g)


def make_workload(name: str, *, sequences: int, group_size: int, prompt_len: int, max_new: int,
                  vocab: int, median_frac: float, sigma: float, seed: int) -> Workload:
    """The case ``name``: equal (G = 1, every answer ``max_new`` tokens), long_tail (G = 1,
    lognormal lengths) or grpo (G = ``group_size`` sharing a prompt, lognormal lengths)."""
    g = group_size if name == "grpo" else 1
    if name not in ("equal", "long_tail", "grpo"):
        raise ValueError(f"case {name!r}; valid: equal, long_tail, grpo")
    if sequences % g:
        raise ValueError(f"requests={sequences} must be a multiple of group_size={g}")
    rng = np.random.default_rng(seed)
    r = sequences // g
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, r).astype(np.int32)
    prompts = rng.integers(FIRST_PROMPT_TOKEN, vocab, (r, prompt_len)).astype(np.int32)
    prompts[np.arange(prompt_len)[None, :] >= lengths[:, None]] = PAD_ID
    kind = "equal" if name == "equal" else "long_tail"
    pmf = length_pmf(kind, max_new, median_frac=median_frac, sigma=sigma)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed),
                                                           jnp.arange(sequences))
    return Workload(name, prompts, lengths, g, keys, pmf,
                    _cached_hook(kind, max_new, median_frac, sigma))


@functools.lru_cache(maxsize=16)
def _cached_hook(kind: str, cap: int, median_frac: float, sigma: float) -> LogitsHook:
    """One hook object per distribution: the samplers' programs are cached by the hook, so
    cases sharing a distribution (long_tail, grpo) share their compiled programs."""
    return forced_length_hook(hazard(length_pmf(kind, cap, median_frac=median_frac, sigma=sigma)))


# -- arms -----------------------------------------------------------------------------------

class ArmOutput(NamedTuple):
    """Host tokens [S, N] int32 and mask [S, N] f32 (1 up to and including EOS)."""

    tokens: np.ndarray
    mask: np.ndarray


def kv_bytes_per_token(model_cfg) -> int:
    """K and V bytes of one token over all layers."""
    return (2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim
            * np.dtype(model_cfg.compute_dtype).itemsize)


def sampling_config(max_new: int, temperature: float) -> SamplingConfig:
    """The sampling every arm uses (EOS 2, PAD 0)."""
    return SamplingConfig(max_new_tokens=max_new, temperature=temperature, eos_id=EOS_ID,
                          pad_id=PAD_ID)


class StaticArm:
    """:func:`make_sampler` (per-row keys, the hook) over waves of ``slots`` rows."""

    name = "static"

    def __init__(self, graphdef, state, sampling: SamplingConfig, slots: int):
        self.graphdef, self.state, self.sampling, self.slots = graphdef, state, sampling, slots

    def run(self, w: Workload) -> ArmOutput:
        """Samples every sequence of ``w`` (host outputs)."""
        fn = make_sampler(self.graphdef, self.sampling, per_row_keys=True, logits_hook=w.hook)
        prompts, lengths = w.rows()
        outs = [fn(self.state, prompts[i:i + self.slots], lengths[i:i + self.slots],
                   w.keys[i:i + self.slots]) for i in range(0, w.sequences, self.slots)]
        outs = jax.device_get([(o.tokens, o.mask) for o in outs])
        return ArmOutput(np.concatenate([t for t, _ in outs]), np.concatenate([m for _, m in outs]))

    def peak_kv_bytes(self, w: Workload, model_cfg) -> int:
        """The wave's cache: slots x (P + N) tokens."""
        return self.slots * (w.prompts.shape[1] + self.sampling.max_new_tokens) * \
            kv_bytes_per_token(model_cfg)


class EngineArm:
    """:class:`jaxflow.rollout.RolloutEngine` with ``slots`` rows and the baselines' KV bytes as
    its pool; a fresh engine per run (built outside the timed region)."""

    name = "engine"

    def __init__(self, graphdef, state, sampling: SamplingConfig, *, slots: int, page_size: int,
                 prompt_len: int, prefill_rows: int, prefill_calls: int, decode_steps: int,
                 loop_steps: int = 0, loop_refill: int = 1):
        self.graphdef, self.state, self.sampling = graphdef, state, sampling
        max_len = prompt_len + sampling.max_new_tokens
        self.config = EngineConfig(
            slots=slots, page_size=page_size, num_pages=pool_pages(slots, max_len, page_size),
            prefill_chunk=prompt_len, prefill_rows=prefill_rows, prefill_calls=prefill_calls,
            decode_steps=decode_steps, loop_steps=min(loop_steps, sampling.max_new_tokens),
            loop_refill=loop_refill, max_seq_len=max_len, attention="xla")
        self.last: RolloutEngine | None = None
        self.prompt_trace: list[tuple[int, int, int]] = []

    def build(self, w: Workload) -> RolloutEngine:
        """A fresh engine for ``w`` (its programs are cached: no recompilation)."""
        return RolloutEngine(self.graphdef, self.state, self.config, self.sampling,
                             logits_hook=w.hook)

    def run(self, w: Workload, engine: RolloutEngine | None = None) -> ArmOutput:
        """Samples every sequence of ``w`` with ``engine.generate`` (host outputs)."""
        engine = self.build(w) if engine is None else engine
        out = engine.generate(w.prompts, w.prompt_lengths, w.keys, group_size=w.group_size)
        self.last = engine
        return ArmOutput(out.tokens, out.mask)

    def run_traced(self, w: Workload) -> ArmOutput:
        """:meth:`run` step by step, recording after every step in ``prompt_trace``: (pages
        holding the running sequences' prompt tokens, those plus the prefix pages of requests
        prefilled ahead whose sequences have not all taken a slot, running sequences, their
        prompt tokens)."""
        engine = self.build(w)
        g = w.group_size
        rids = [engine.add_request(w.prompts[i, :w.prompt_lengths[i]], w.keys[i * g:(i + 1) * g])
                for i in range(w.prompts.shape[0])]
        sched, ps = engine.scheduler, self.config.page_size
        self.prompt_trace = []
        while not engine.idle():
            engine.step()
            running = sched.running()
            pages = set()
            for seq in running:
                pages.update(seq.pages[:pages_for(len(seq.request.prompt), ps)])
            ahead = set()
            pending = {id(s.request): s.request for s in sched.ready}
            pending.update({id(r): r for r in sched.prefilling})
            for req in pending.values():
                if req.unassigned > 0:
                    ahead.update(req.prefix_pages)
            self.prompt_trace.append((len(pages), len(pages | ahead), len(running),
                                      sum(len(s.request.prompt) for s in running)))
        self.last = engine
        outs = [engine.result(rid) for rid in rids]
        return ArmOutput(np.concatenate([o.tokens for o in outs]),
                         np.concatenate([o.mask for o in outs]))

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page (all layers)."""
        assert self.last is not None
        return self.last.page_bytes

    def peak_kv_bytes(self) -> int:
        """Peak pages in use in the last run x page bytes."""
        assert self.last is not None
        return self.last.stats.peak_pages * self.last.page_bytes


def timed(arm, w: Workload) -> tuple[float, ArmOutput]:
    """(seconds, output) of one run of ``arm`` on ``w`` (the engine built before the clock)."""
    wall, _, out = timed_cpu(arm, w)
    return wall, out


def timed_cpu(arm, w: Workload) -> tuple[float, float, ArmOutput]:
    """(wall seconds, CPU seconds of this process (every thread), output) of one run of ``arm``
    on ``w`` (the engine built before the clocks)."""
    engine = arm.build(w) if isinstance(arm, EngineArm) else None
    start, cpu = time.perf_counter(), time.process_time()
    out = arm.run(w, engine) if engine is not None else arm.run(w)
    return time.perf_counter() - start, time.process_time() - cpu, out


def describe_lengths(lengths: np.ndarray, cap: int) -> dict[str, Any]:
    """Summary of realised output lengths [S]."""
    return {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
            "min": int(lengths.min()), "at_cap": int((lengths == cap).sum()),
            "over_half_cap": int((lengths > cap // 2).sum())}
