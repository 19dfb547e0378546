"""Several stop ids (a chat model's end-of-turn and end-of-text): the static sampler stops a row
right after the first of them, the paged engine draws the same rows; completions end at any of a
tokenizer's eos_ids; the tokenizer boundary names what a tokenizer lacks."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.data.tokenizer import CharTokenizer, Tokenizer, TokenizerError, check_tokenizer
from jaxflow.models import SamplingConfig, Transformer, TransformerConfig, make_sampler
from jaxflow.rl.tasks import completion_text, split_completion
from jaxflow.rollout import EngineConfig, RolloutEngine

CFG = TransformerConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,
                        max_seq_len=24)
P, N, EOS = 4, 10, 2


def test_static_sampler_and_engine_stop_at_any_stop_id():
    graphdef, state = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
    prompts = np.array([[1, 3, 4, 0], [1, 5, 0, 0], [1, 6, 7, 8], [1, 9, 0, 0]], np.int32)
    lengths = np.array([3, 2, 4, 2], np.int32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(1), jnp.arange(4))
    stops = (EOS, 7, 10)
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=EOS, eos_ids=stops)
    assert sampling.stop_ids == stops and SamplingConfig(eos_id=EOS).stop_ids == (EOS,)
    got = jax.device_get(make_sampler(graphdef, sampling, per_row_keys=True)(
        state, prompts, lengths, keys))
    ends = []
    for r in range(4):  # a row ends right after its first stop id, pad after it
        n = int(got.lengths[r])
        assert got.mask[r].sum() == n and (got.tokens[r][n:] == 0).all()
        assert not set(got.tokens[r][:n - 1].tolist()) & set(stops)
        assert n == N or got.tokens[r][n - 1] in stops
        ends.append(int(got.tokens[r][n - 1]))
    assert set(ends) & {7, 10}, ends  # the case is exercised: a row ended on a second stop id
    engine = RolloutEngine(graphdef, state, EngineConfig(
        slots=4, page_size=8, num_pages=16, prefill_chunk=P, max_seq_len=P + N,
        narrow_tables=False), sampling)
    out = engine.generate(prompts, lengths, keys)
    np.testing.assert_array_equal(out.tokens, got.tokens)
    np.testing.assert_array_equal(out.lengths, got.lengths)


def test_sampling_config_rejects_bad_stop_ids():
    with pytest.raises(ValueError, match=r"eos_ids=\(\): must be None or a non-empty tuple"):
        SamplingConfig(eos_ids=())
    with pytest.raises(ValueError, match=r"eos_id=3 is not eos_ids\[0\]=2"):
        SamplingConfig(eos_id=3, eos_ids=(2, 3))


def test_completion_ends_at_any_eos_id():
    tok = CharTokenizer()
    two = types.SimpleNamespace(eos_ids=(2, 20), eos_id=2, decode=tok.decode)
    ids = tok.encode("12") + [20, 7]
    assert split_completion(two, ids) == (ids[:2], False)
    assert completion_text(two, ids) == "12" and completion_text(tok, ids) is None


def test_tokenizer_boundary_names_what_is_missing():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer) and check_tokenizer(tok) is tok and tok.eos_ids == (tok.eos_id,)
    legacy = types.SimpleNamespace(encode=tok.encode, decode=tok.decode, eos_id=2, bos_id=1,
                                   pad_id=0, vocab_size=23)
    with pytest.raises(TokenizerError, match=r"^tokenizer SimpleNamespace has no eos_ids; valid: "):
        check_tokenizer(legacy)
    with pytest.raises(TypeError, match=r"eos_ids=\(\); valid: a non-empty sequence"):
        check_tokenizer(types.SimpleNamespace(**vars(legacy), eos_ids=()))
    with pytest.raises(TokenizerError, match=r"eos_id=2 is not eos_ids\[0\]=7"):
        check_tokenizer(types.SimpleNamespace(**vars(legacy), eos_ids=(7, 2)))
