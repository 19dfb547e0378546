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
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import put, to_host
from jaxflow.models.sampler import SampleOutput, SamplingConfig, make_sampler
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.tasks import Task, encode_prompts, score_completions
from jaxflow.train.lm_state import lm_functions

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


class RolloutBatch(NamedTuple):
    """One rollout, host numpy arrays; the G responses of a prompt are contiguous rows.

    prompts [B, P] int32 (``[BOS] prompt`` right-padded), prompt_lengths [B] int32,
    tokens [B, N] int32 (pad after EOS), mask [B, N] float32 (1 up to and including EOS),
    behaviour_logp [B, N] float32 (sampler's log-probs, 0 where masked), rewards [B] float32.
    """

    prompts: np.ndarray
    prompt_lengths: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    behaviour_logp: np.ndarray
    rewards: np.ndarray


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


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What a rollout samples: G responses per prompt, temperature, length, mismatch knob."""

    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 5
    mismatch: str = "none"

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size={self.group_size!r}: need an int >= 2 (GRPO groups)")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: need > 0 for RL sampling")
        parse_mismatch(self.mismatch)


class RolloutWorker:
    """Samples and scores on the rollout sub-mesh; evaluates held-out greedy accuracy.

    Params passed in are pure dicts already on the rollout mesh (see
    :func:`jaxflow.rl.publish.publish_weights`).
    """

    def __init__(self, model_cfg: TransformerConfig, mesh: Mesh, spec: RolloutSpec, task: Task,
                 tokenizer: CharTokenizer):
        self.mesh, self.spec, self.task, self.tokenizer = mesh, spec, task, tokenizer
        self.fns = lm_functions(model_cfg, mesh)  # f32: the policy itself (eval, shardings)
        kind, noise = parse_mismatch(spec.mismatch)
        sampling = SamplingConfig(max_new_tokens=spec.max_new_tokens,
                                  temperature=spec.temperature, eos_id=tokenizer.eos_id,
                                  pad_id=tokenizer.pad_id)
        if kind.startswith("bf16"):
            self._sampler_fns = lm_functions(dataclasses.replace(model_cfg, dtype="bfloat16"), mesh)
        else:
            self._sampler_fns = self.fns
        if noise > 0:
            self._sample = make_noisy_sampler(self._sampler_fns.graphdef, sampling, noise)
        else:
            self._sample = make_sampler(self._sampler_fns.graphdef, sampling)
        greedy = dataclasses.replace(sampling, temperature=0.0,
                                     max_new_tokens=task.max_completion_len + 1)
        self._greedy = make_sampler(self.fns.graphdef, greedy)
        self._eval_sample = make_sampler(self.fns.graphdef, sampling)
        self.prompt_width = task.max_prompt_len + 1  # + BOS
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

    def sample(self, params: Any, prompts: np.ndarray, prompt_lengths: np.ndarray,
               key: jax.Array) -> SampleOutput:
        """Raw sampler call (device arrays) on token prompts [B, P]."""
        state = self._sampler_fns.nnx_state(params)
        key = self._put_key(key)
        return self._sample(state, self._place(prompts), self._place(prompt_lengths), key)

    def generate(self, params: Any, prompt_texts: Sequence[str], key: jax.Array) -> RolloutBatch:
        """G samples per prompt (rows ``i*G .. i*G+G-1`` answer prompt ``i``), scored."""
        g = self.spec.group_size
        texts = [p for p in prompt_texts for _ in range(g)]
        prompts, lengths = encode_prompts(self.tokenizer, texts, self.prompt_width)
        out = self.sample(params, prompts, lengths, key)
        tokens, mask, logp = (to_host(x) for x in (out.tokens, out.mask, out.logprobs))
        rewards = score_completions(self.task, self.tokenizer, texts, tokens)
        return RolloutBatch(prompts, lengths, tokens.astype(np.int32), mask.astype(np.float32),
                            logp.astype(np.float32), rewards)

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
