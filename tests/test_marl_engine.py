"""Rollout engine: compacting finished rows away changes no sample and saves decode steps."""

import jax
import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.marl.engine import RolloutEngine, row_keys
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.tasks import encode_prompts
from jaxflow.train.lm_state import init_params

TINY = TransformerConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                         d_ff=32, max_seq_len=32)


def test_compacted_decode_equals_padded_decode_and_saves_steps():
    wf = solver_verifier_workflow(TINY, TINY)
    tok = CharTokenizer()
    task = wf.task("solver")
    mesh = role_meshes({"rollout": 2})["rollout"]  # rows sharded over 2 devices when they divide
    n_new = 13
    eng = RolloutEngine(TINY, mesh, max_new_tokens=n_new, temperature=1.0, task=task,
                        tokenizer=tok, chunk=4)
    params = init_params(eng.fns, TINY, jax.random.key(0))
    texts = task.prompts(np.random.default_rng(0), 8)
    prompts, lengths = encode_prompts(tok, texts, eng.prompt_width)
    keys = row_keys(jax.random.key(3), len(texts))
    got, stats = eng.sample(params, prompts, lengths, keys)
    want, padded = eng.sample(params, prompts, lengths, keys, compact=False, chunk=n_new)
    # equal: tokens, log-probs and mask of every row, bit for bit
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    lens = want.mask.sum(1)
    assert lens.min() < n_new / 2 < lens.max()  # skewed lengths: some rows finish early
    assert padded.row_steps == padded.padded_row_steps == len(texts) * (n_new - 1)
    assert stats.row_steps < padded.row_steps  # compaction skipped finished rows
    assert stats.useful_row_steps == padded.useful_row_steps == int((want.mask[:, 1:]).sum())
    # a row's sample does not depend on its place in the batch or on its companions: the same
    # rows in reverse order (same compiled shapes) give every row bit for bit. (A batch of one
    # is a different XLA program -- a matrix-vector product -- whose rounding may differ.)
    order = np.arange(len(texts))[::-1]
    shuffled, _ = eng.sample(params, prompts[order], lengths[order], keys[order])
    for g, w in zip(shuffled, want):
        np.testing.assert_array_equal(g, w[order])
