"""R3 through the paged rollout engine: ``EngineConfig.record_routing`` records each MoE layer's
experts and gates per position, as the static sampler does.

* the engine's record equals the routing of a full forward over ``prompt ++ tokens`` with the
  same weights (exact expert ids), and the static sampler's record on the same tokens (ids
  exact, gates within f32 rounding, 1e-6: XLA:CPU's f32 matmuls depend on the batch shape);
* the multi-step decode loop records the same routing as single steps, bit for bit;
* with the record replayed, the trainer's log-probs equal the engine's sampled log-probs within
  f32 rounding (``LOGPROB_ATOL`` = 1e-5, the engine tests' tolerance);
* recording changes no draw (tokens and log-probs bit-identical to the engine without it); off,
  the record is empty; a dense model refuses to record.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.config import ConfigError
from jaxflow.models import SamplingConfig, Transformer, make_sampler
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo_step import response_hidden, routed_response_hidden
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rollout import EngineConfig, RolloutEngine

MOE = TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32, max_seq_len=24,
                        n_experts=8, n_experts_per_token=2, d_ff_expert=16)
G, P, N = 2, 6, 7
LENGTHS = np.array([6, 1, 4], np.int32)  # a 1-token prompt: nothing to prefill, all recorded by decode
EOS = 20  # drawn early by three rows of this seed: sequences end at EOS
SAMPLING = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS)
LOGPROB_ATOL = 1e-5


class _Fns:
    """The member of LMFunctions that response_hidden uses, over a live model."""

    def __init__(self, graphdef):
        self.graphdef = graphdef

    def model(self, state):
        return nnx.merge(self.graphdef, state)


@pytest.fixture(scope="module")
def setup():
    graphdef, state = nnx.split(Transformer(MOE, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts = np.zeros((len(LENGTHS), P), np.int32)
    for i, n in enumerate(LENGTHS):
        prompts[i, :n] = rng.integers(4, MOE.vocab_size, n)
    keys = jax.random.split(jax.random.key(5), len(LENGTHS) * G)

    def run(**kw):
        cfg = dict(slots=4, page_size=4, num_pages=24, prefill_chunk=3, prefill_rows=2,
                   max_seq_len=P + N, narrow_tables=False, record_routing=True)
        cfg.update(kw)
        engine = RolloutEngine(graphdef, state, EngineConfig(**cfg), SAMPLING)
        return engine.generate(prompts, LENGTHS, keys, group_size=G)

    return graphdef, state, prompts, keys, run, run()


def _rows(prompts):
    return np.repeat(prompts, G, axis=0), np.repeat(LENGTHS, G)


def _valid(lengths, mask):
    """[B, P + N - 1]: the positions the trainer's forward feeds real tokens."""
    end = lengths + mask.sum(1).astype(np.int32) - 1
    return np.arange(P + N - 1)[None] < end[:, None]


def test_engine_records_the_full_forwards_routing(setup):
    graphdef, state, prompts, keys, _, out = setup
    rows, lengths = _rows(prompts)
    assert out.routing_experts.shape == (len(rows), P + N - 1, 2, 2) and out.routing_experts.dtype == np.uint8
    assert out.routing_gates.shape == out.routing_experts.shape and out.routing_gates.dtype == np.float32
    assert out.mask.sum(1).min() < N  # some row ended early at EOS
    valid = _valid(lengths, out.mask)
    _, _, own = routed_response_hidden(_Fns(graphdef), state, jnp.asarray(rows), jnp.asarray(lengths),
                                       jnp.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(own)[valid], out.routing_experts[valid].astype(np.int32))
    assert not out.routing_experts[~valid].any() and not out.routing_gates[~valid].any()  # nothing fed there
    static = make_sampler(graphdef, SAMPLING, per_row_keys=True, record_routing=True)(
        state, jnp.asarray(rows), jnp.asarray(lengths), keys)
    np.testing.assert_array_equal(np.asarray(static.tokens), out.tokens)
    np.testing.assert_array_equal(np.asarray(static.routing_experts)[valid], out.routing_experts[valid])
    np.testing.assert_allclose(np.asarray(static.routing_gates)[valid], out.routing_gates[valid], rtol=0, atol=1e-6)


def test_decode_loop_records_as_single_steps_and_recording_changes_no_draw(setup):
    *_, run, out = setup
    looped = run(loop_steps=4)
    for field in out._fields:
        np.testing.assert_array_equal(getattr(looped, field), getattr(out, field), err_msg=field)
    plain = run(record_routing=False)
    assert plain.routing_experts.shape == (len(out.tokens), 0, 0, 0)
    assert plain.routing_gates.shape == (len(out.tokens), 0, 0, 0)
    for field in ("tokens", "logprobs", "mask", "versions"):
        np.testing.assert_array_equal(getattr(plain, field), getattr(out, field), err_msg=field)


def test_replayed_trainer_log_probs_equal_the_engines(setup):
    graphdef, state, prompts, _, _, out = setup
    rows, lengths = (jnp.asarray(x) for x in _rows(prompts))
    hidden, head = response_hidden(_Fns(graphdef), state, rows, lengths, jnp.asarray(out.tokens),
                                   jnp.asarray(out.routing_experts))
    logp = np.asarray(fused_logprobs(hidden, head, jnp.asarray(out.tokens), backend="xla").target_logp)
    live = out.mask > 0
    np.testing.assert_allclose(logp[live], out.logprobs[live], rtol=0, atol=LOGPROB_ATOL)


def test_dense_model_refuses_to_record():
    dense = dataclasses.replace(MOE, n_experts=0)
    with pytest.raises(ConfigError, match=r"^EngineConfig.record_routing=True needs an MoE model .*n_experts=0"):
        RolloutEngine(dense, nnx.split(Transformer(dense, rngs=nnx.Rngs(0)))[1],
                      EngineConfig(slots=2, page_size=4, num_pages=8, max_seq_len=8, record_routing=True),
                      SamplingConfig(max_new_tokens=2))


def test_rl_engine_programs_compile_with_the_record():
    """``--compile-only`` of an MoE RL run with R3 on and ``rl.sampler=engine``: the rollout
    worker's engine programs (abstract arguments) compile, and their outputs carry the record."""
    from jaxflow.compile_only.program import compile_ahead
    from jaxflow.data.tokenizer import CharTokenizer
    from jaxflow.mesh import role_meshes
    from jaxflow.rl.rollout import RolloutSpec, RolloutWorker
    from jaxflow.rl.tasks import AdditionRLTask

    tok = CharTokenizer()
    model = dataclasses.replace(MOE, vocab_size=tok.vocab_size)
    mesh = role_meshes({"trainer": 1, "rollout": 1}, devices=jax.devices()[:2])["rollout"]
    spec = RolloutSpec(group_size=2, max_new_tokens=3, sampler="engine", record_routing=True)
    worker = RolloutWorker(model, mesh, spec, AdditionRLTask(max_digits=1), tok)
    programs = {p.name: p for p in worker.sampler_programs(4)}
    assert set(programs) == {"rollout/engine/prefill", "rollout/engine/decode"}
    cfg = spec.engine.engine_config(4, worker.prompt_width, 3, record_routing=True)
    for name, program in programs.items():
        compiled, outputs = compile_ahead(program)
        assert compiled.compiled is not None, name
        if name.endswith("prefill"):
            experts, gates = outputs[1]
            assert experts.shape == (cfg.prefill_rows, cfg.prefill_chunk, 2, 2)
        else:
            experts, gates = outputs[1].routing_experts, outputs[1].routing_gates
            assert experts.shape == (cfg.decode_steps, cfg.slots, 2, 2)
        assert experts.dtype == np.uint8 and gates.dtype == np.float32 and gates.shape == experts.shape
