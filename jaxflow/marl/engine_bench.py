"""Bucketed vs padded decode of FlexMARL's sampler (the paged engine) on the same rows and keys.

:func:`engine_benchmark` samples the solver's prompts twice per round with two
:class:`~jaxflow.marl.sampling.AgentSampler` of the same shapes (built by
:func:`jaxflow.marl.system.bench_engine`): decode calls carrying only the running rows (finished
rows leave after each ``bench_chunk``-step decode call; ``bucket_rows``), and every slot in every
decode call until the last row ends (the padded batch decode); alternating, medians over
``reps`` rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxflow.marl.sampling import row_keys
from jaxflow.marl.speedup import bit_equal
from jaxflow.marl.system import bench_engine
from jaxflow.marl.workflow import Workflow
from jaxflow.rl.tasks import encode_prompts

__all__ = ["engine_benchmark"]


def engine_benchmark(config: Any, workflow: Workflow, meshes: Mapping[str, Any], params: Any,
                     log: Callable[[str], Any]) -> dict:
    """Bucketed vs padded decode of the solver (``params``, published for the sampler on the
    rollout mesh ``meshes["rollout"]``) on ``config.bench_rows`` prompts drawn from the seed's
    stream ``[seed, 0xE6]``: row-steps executed / saved, the median time ratio padded /
    bucketed and its spread, and whether tokens, masks and log-probs are identical (XLA CPU
    picks matmul kernels by batch size, so a smaller bucket's log-probs may differ from the
    padded batch's in the last bits: their max abs / rel difference). ``log``: one line."""
    task = workflow.task("solver")
    eng = bench_engine(config, workflow, meshes["rollout"])
    padded = bench_engine(config, workflow, meshes["rollout"], bucket_rows=False)
    texts = task.prompts(np.random.default_rng([config.seed, 0xE6]), config.bench_rows)
    prompts, lengths = encode_prompts(eng.tokenizer, texts, eng.prompt_width)
    keys = row_keys(jax.random.key(config.seed), len(texts))
    a, sa = eng.sample(params, prompts, lengths, keys)
    b, sb = padded.sample(params, prompts, lengths, keys)
    ratios, tc, tp = [], [], []
    for _ in range(config.reps):
        t0 = time.perf_counter()
        padded.sample(params, prompts, lengths, keys)
        t1 = time.perf_counter()
        eng.sample(params, prompts, lengths, keys)
        t2 = time.perf_counter()
        tp.append(t1 - t0)
        tc.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    out = {"rows": len(texts), "max_new_tokens": config.bench_tokens,
           "chunk": config.bench_chunk, "row_steps": sa.row_steps,
           "padded_row_steps": sb.row_steps, "useful_row_steps": sa.useful_row_steps,
           "saved_fraction": 1.0 - sa.row_steps / sb.row_steps if sb.row_steps else 0.0,
           "mean_length": float(a.mask.sum(1).mean()),
           "speedup_vs_padded": statistics.median(ratios),
           "speedup_spread": [min(ratios), max(ratios)],
           "compacted_s": statistics.median(tc), "padded_s": statistics.median(tp),
           "bit_identical": bit_equal(a, b),
           "tokens_identical": bool(np.array_equal(a.tokens, b.tokens)),
           "mask_identical": bool(np.array_equal(a.mask, b.mask)),
           "logprob_max_abs_diff": float(np.max(np.abs(a.logprobs - b.logprobs))),
           "logprob_max_rel_diff": float(np.max(np.abs(a.logprobs - b.logprobs)
                                                / np.maximum(np.abs(b.logprobs), 1e-30)))}
    log(f"engine: {out['saved_fraction']:.2f} of padded decode row-steps saved, "
        f"{out['speedup_vs_padded']:.2f}x vs padded, tokens identical "
        f"{out['tokens_identical']}, log-prob max rel diff {out['logprob_max_rel_diff']:.1e}")
    return out
