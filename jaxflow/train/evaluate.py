"""Held-out exact-match accuracy of the LM on a verifiable task, by greedy KV-cache decoding."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.data.arithmetic import AdditionTask, eval_prompts
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.distributed import to_host
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.sampler import SamplingConfig, make_sampler
from jaxflow.train.lm_state import LMFunctions


class ExactMatchEvaluator:
    """Greedy-decodes ``n`` fixed held-out prompts and scores the completions.

    Prompts are replicated on ``mesh`` so every process sees the same (global) answers.
    ``decode_kernel``: the sampler's decode attention on TPU / GPU (the drivers pass
    ``DecodeKernel(jaxflow.rollout.paged_attention.paged_attention)``: jaxflow.train sits below
    jaxflow.rollout); None decodes with XLA everywhere (on CPU both are the same program).
    """

    def __init__(self, fns: LMFunctions, task: AdditionTask, tokenizer: CharTokenizer, *, n: int, mesh,
                 decode_kernel: DecodeKernel | None = None):
        self.fns, self.task, self.tokenizer = fns, task, tokenizer
        prompts, lengths, self.answers = eval_prompts(task, tokenizer, n=n)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.prompts = jax.device_put(prompts, replicated)
        self.lengths = jax.device_put(lengths, replicated)
        self.prompt_texts = [tokenizer.decode(p) for p in prompts]
        cfg = SamplingConfig(max_new_tokens=task.max_answer_len + 1, temperature=0.0,
                             eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        self._sample = make_sampler(fns.graphdef, cfg, decode_kernel=decode_kernel)
        self._key = jax.random.key(0)

    def __call__(self, params) -> float:
        """Fraction of held-out problems answered exactly (answer followed by EOS)."""
        out = self._sample(self.fns.nnx_state(params), self.prompts, self.lengths, self._key)
        tokens = to_host(out.tokens)
        correct = 0
        for row, answer in zip(tokens, self.answers):
            ids = list(row)
            if self.tokenizer.eos_id not in ids:
                continue
            correct += self.tokenizer.decode(ids) == answer
        return correct / len(self.answers)
