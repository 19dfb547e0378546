"""FlexMARL's rollout engine behind ``paged=``: the paged rollout engine samples what the
compacting decode samples (same per-row keys), the G rows of a prompt sharing its prefill."""

import jax
import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.marl.engine import RolloutEngine, row_keys
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.rollout import EngineSettings
from jaxflow.train.lm_state import init_params

TINY = TransformerConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                         d_ff=32, max_seq_len=32)


def test_paged_marl_engine_samples_what_the_compacting_decode_samples():
    wf = solver_verifier_workflow(TINY, TINY)
    tok, task = CharTokenizer(), wf.task("solver")
    mesh = role_meshes({"rollout": 1}, devices=jax.devices()[:1])["rollout"]
    kw = dict(max_new_tokens=9, temperature=1.0, task=task, tokenizer=tok, chunk=4)
    compact = RolloutEngine(TINY, mesh, **kw)
    paged = RolloutEngine(TINY, mesh, **kw, paged=EngineSettings(page_size=4, decode_steps=2))
    params = init_params(compact.fns, TINY, jax.random.key(0))
    texts, g = task.prompts(np.random.default_rng(0), 4), 3
    keys = row_keys(jax.random.key(5), len(texts) * g)
    want = compact.generate_rows(params, texts, keys, g)
    got = paged.generate_rows(params, texts, keys, g)
    for name in ("prompts", "prompt_lengths", "tokens", "mask", "rewards"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    # XLA:CPU f32 matmuls depend on the batch shape they run in (jaxflow.rollout's docstring)
    np.testing.assert_allclose(got.behaviour_logp, want.behaviour_logp, rtol=0, atol=1e-5)
    lens = want.mask.sum(1)
    assert lens.min() < lens.max()  # mixed lengths: rows end at EOS at different steps
    eng = paged._paged_engine
    assert eng.stats.prefill_calls == 1 and eng.config.slots == len(texts) * g  # 4 prefills
    assert paged.stats.useful_row_steps == int(want.mask[:, 1:].sum())
