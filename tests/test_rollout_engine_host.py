"""The engine's per-run host costs: a fresh engine on the same model object reuses its config and
compiled programs (found by identity, without hashing the GraphDef) and makes its pools in one
call (distinct zero buffers, donated separately); a decode call's empty fields are made on the
host, the rest fetched, equal to ``jax.device_get``. Draws themselves are covered by the
equivalence tests (test_rollout_engine, test_rollout_decode_loop)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import SamplingConfig, Transformer, TransformerConfig
from jaxflow.rollout import EngineConfig, RolloutEngine
from jaxflow.rollout.model_step import DecodeOut, by_identity, empty_pools, host_out

TINY = TransformerConfig(vocab_size=23, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64,
                         max_seq_len=24)
CONFIG = EngineConfig(slots=2, page_size=4, num_pages=20, prefill_chunk=4, loop_steps=8)


@pytest.fixture(scope="module")
def split_model():
    return nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))


def test_fresh_engine_reuses_programs_of_the_same_model_object(split_model):
    graphdef, state = split_model
    sampling = SamplingConfig(max_new_tokens=8, eos_id=5)
    a, b = (RolloutEngine(graphdef, state, CONFIG, sampling) for _ in range(2))
    assert a.steps is b.steps and a.loop is b.loop and a.model_config == b.model_config == TINY
    greedy = RolloutEngine(graphdef, state, CONFIG, SamplingConfig(max_new_tokens=8, temperature=0.0))
    assert greedy.steps is not a.steps and greedy.loop is not a.loop
    # another GraphDef object (equal, but not the same) gets its own entry, built by make()
    other, _ = nnx.split(Transformer(TINY, rngs=nnx.Rngs(1)))
    assert by_identity(other, ("probe",), lambda: "built") == "built"
    assert by_identity(other, ("probe",), lambda: "rebuilt") == "built"
    assert by_identity(graphdef, ("probe",), lambda: "mine") == "mine"


def test_pools_in_one_call_are_distinct_zero_buffers():
    pools = empty_pools(n_layers=2, n_kv_heads=2, num_pages=5, page_size=4, head_dim=8,
                        dtype=jnp.bfloat16)
    leaves = pools.k + pools.v
    assert len(leaves) == 4 and len({x.unsafe_buffer_pointer() for x in leaves}) == 4
    for x in leaves:
        assert x.shape == (2, 5, 4, 8) and x.dtype == jnp.bfloat16 and not np.asarray(x).any()


def test_host_out_fetches_the_filled_fields_and_makes_the_empty_ones():
    n, b = 3, 2
    out = DecodeOut(jnp.arange(n * b, dtype=jnp.int32).reshape(n, b), jnp.full((n, b), -0.5),
                    jnp.zeros((n, b, 0)), jnp.zeros((n, b, 0), jnp.int32),
                    jnp.ones((n, b), bool), jnp.zeros((n, b, 0, 0), jnp.uint8),
                    jnp.zeros((n, b, 0, 0)))
    got, want = host_out(out), jax.device_get(out)
    for field in DecodeOut._fields:
        x, y = getattr(got, field), getattr(want, field)
        assert isinstance(x, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype, field
        np.testing.assert_array_equal(x, y, err_msg=field)
