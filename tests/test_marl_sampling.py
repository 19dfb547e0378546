"""FlexMARL samples through the paged rollout engine (``jaxflow.marl.sampling``): per agent the
same tokens and log-probs as :class:`jaxflow.rollout.RolloutEngine` called directly on the same
rows and keys, a well-formed scored RolloutBatch, samples independent of batching, and the
bucketed decode equal to the padded one with fewer row-steps."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.marl.pipeline import group_row_keys, rollout_inputs, version_keys
from jaxflow.marl.sampling import AgentSampler, replica_mesh, row_keys
from jaxflow.marl.workflow import solver_verifier_workflow
from jaxflow.mesh import role_meshes
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.rollout import EngineSettings
from jaxflow.rl.tasks import completion_text, encode_prompts, score_completions
from jaxflow.rollout import RolloutEngine
from jaxflow.train.lm_state import init_params

SOLVER = TransformerConfig(vocab_size=23, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                           d_ff=32, max_seq_len=32)
VERIFIER = TransformerConfig(vocab_size=23, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2,
                             d_ff=16, max_seq_len=32)
G, INPUTS = 3, 4
SETTINGS = EngineSettings(page_size=4, decode_steps=2)


@pytest.fixture(scope="module")
def agents():
    """Both agents' samplers and params on a one-device rollout mesh (a stand-in runtime:
    what :func:`rollout_inputs` reads of an AgentRuntime)."""
    wf = solver_verifier_workflow(SOLVER, VERIFIER, group_size=G, solver_tokens=9,
                                  verifier_tokens=2)
    mesh = role_meshes({"rollout": 1}, devices=jax.devices()[:1])["rollout"]
    tok, runtimes, params = CharTokenizer(), {}, {}
    for i, spec in enumerate(wf.agents):
        sampler = AgentSampler(spec.model, mesh, max_new_tokens=spec.max_new_tokens,
                               temperature=1.0, task=wf.task(spec.name), tokenizer=tok,
                               settings=SETTINGS)
        runtimes[spec.name] = types.SimpleNamespace(spec=spec, task=wf.task(spec.name),
                                                    tokenizer=tok, sampler=sampler)
        params[spec.name] = init_params(sampler.fns, spec.model, jax.random.key(i))
    return wf, runtimes, params


def test_rollout_inputs_equal_the_engine_called_directly_per_agent(agents):
    wf, runtimes, params = agents
    prompts = wf.task("solver").prompts(np.random.default_rng(0), INPUTS)
    key, ids = version_keys(0, 3)[0], list(range(INPUTS))
    out = rollout_inputs(wf, runtimes, params, prompts, key=key, input_ids=ids)
    texts = {"solver": prompts}
    solver_out = out["solver"]
    texts["verifier"] = [wf.task("verifier").from_upstream(
        p, completion_text(CharTokenizer(), solver_out.tokens[k * G])) for k, p in enumerate(prompts)]
    for name, rt in runtimes.items():
        s, batch = rt.sampler, out[name]
        rows = [p for p in texts[name] for _ in range(G)]
        toks, lens = encode_prompts(rt.tokenizer, rows, s.prompt_width)
        engine = RolloutEngine(s.model, params[name], s.engine_config(INPUTS * G), s.config,
                               mesh=s.mesh)
        keys = group_row_keys(key, ids, wf.turn(name), G)
        want = engine.generate(toks[::G], lens[::G], keys, group_size=G)
        np.testing.assert_array_equal(batch.tokens, want.tokens, err_msg=name)
        np.testing.assert_array_equal(batch.mask, want.mask, err_msg=name)
        np.testing.assert_array_equal(batch.behaviour_logp, want.logprobs, err_msg=name)
        # a well-formed RolloutBatch: encoded prompts, scored completions, one EOS ends a row
        n = rt.spec.max_new_tokens
        np.testing.assert_array_equal(batch.prompts, toks)
        np.testing.assert_array_equal(batch.prompt_lengths, lens)
        assert batch.tokens.shape == batch.mask.shape == batch.behaviour_logp.shape == (INPUTS * G, n)
        assert batch.tokens.dtype == np.int32 and batch.mask.dtype == np.float32
        np.testing.assert_array_equal(batch.rewards, score_completions(rt.task, rt.tokenizer, rows,
                                                                       batch.tokens))
        lengths = batch.mask.sum(1).astype(int)
        assert (np.diff(batch.mask, axis=1) <= 0).all() and lengths.min() >= 1  # 1s, then 0s
        assert (batch.behaviour_logp[batch.mask == 0] == 0).all()
        assert (batch.behaviour_logp[batch.mask == 1] < 0).all()
        assert (batch.tokens[batch.mask == 0] == rt.tokenizer.pad_id).all()
        ended = lengths < n
        assert (batch.tokens[ended, lengths[ended] - 1] == rt.tokenizer.eos_id).all()
        assert (batch.versions == -1).all()
    lens = out["solver"].mask.sum(1)
    assert lens.min() < lens.max()  # mixed lengths: rows leave the decode batch at different calls


def test_samples_do_not_depend_on_batching_and_stats_count_the_work(agents):
    wf, runtimes, params = agents
    s = runtimes["solver"].sampler
    texts = wf.task("solver").prompts(np.random.default_rng(1), INPUTS)
    keys = row_keys(jax.random.key(7), INPUTS * G)
    before = s.stats.calls, s.stats.useful_row_steps
    together = s.generate_rows(params["solver"], texts, keys, G)
    assert s.stats.calls == before[0] + 1
    assert s.stats.useful_row_steps - before[1] == int(together.mask.sum())
    for k, text in enumerate(texts):  # one prompt per call: the same rows (per-row keys)
        alone = s.generate_rows(params["solver"], [text], keys[k * G:(k + 1) * G], G)
        np.testing.assert_array_equal(alone.tokens, together.tokens[k * G:(k + 1) * G])
        np.testing.assert_array_equal(alone.mask, together.mask[k * G:(k + 1) * G])
    with pytest.raises(ValueError, match="row keys"):
        s.generate_rows(params["solver"], texts, keys[:-1], G)


def test_bucketed_decode_equals_padded_and_executes_fewer_row_steps(agents):
    wf, runtimes, params = agents
    s = runtimes["solver"].sampler
    padded = AgentSampler(SOLVER, s.rollout_mesh, max_new_tokens=s.config.max_new_tokens,
                          temperature=1.0, task=s.task, tokenizer=s.tokenizer, settings=SETTINGS,
                          bucket_rows=False)
    texts = wf.task("solver").prompts(np.random.default_rng(2), INPUTS * G)
    prompts, lengths = encode_prompts(s.tokenizer, texts, s.prompt_width)
    keys = row_keys(jax.random.key(3), len(texts))
    got, stats = s.sample(params["solver"], prompts, lengths, keys)
    want, full = padded.sample(params["solver"], prompts, lengths, keys)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.mask, want.mask)
    # XLA:CPU f32 matmuls depend on the batch shape (a smaller row bucket): rounding only
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    assert stats.padded_row_steps == full.padded_row_steps == len(texts) * s.config.max_new_tokens
    # every slot in every decode call vs only the running rows (a power-of-two bucket)
    assert stats.useful_row_steps == full.useful_row_steps == int(want.mask.sum())
    assert stats.useful_row_steps <= stats.row_steps < full.row_steps


def test_replica_mesh_is_one_local_tensor_parallel_replica():
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    replica = replica_mesh(Mesh(devices, ("data", "model")))
    assert dict(replica.shape) == {"data": 1, "model": 2}
    assert list(replica.devices.flat) == list(devices[0])
    model_only = Mesh(devices.reshape(-1), ("model",))
    assert replica_mesh(model_only) is model_only
    with pytest.raises(ValueError, match="settings="):
        AgentSampler(SOLVER, model_only, max_new_tokens=2, temperature=1.0,
                     task=solver_verifier_workflow(SOLVER, VERIFIER).task("solver"),
                     tokenizer=CharTokenizer(), settings={"page_size": 4})
