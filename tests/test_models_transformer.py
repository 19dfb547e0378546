"""Transformer: packing/padding/causality equivalences, KV-cache decode == forward, bf16,
config validation, sharding annotations, gradients. Uses the "tiny" preset (GQA 4:2)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.models import PRESETS, Transformer, TransformerConfig, logical_axes, param_count
from jaxflow.models.transformer import LOGICAL_AXIS_NAMES

TINY = PRESETS["tiny"]
F32_TOL = 1e-5
# bf16 keeps 8 mantissa bits (~4e-3 relative per rounding); through 2 layers and the head
# the logits of this tiny model (|logits| <= ~3.2) moved by at most 0.037 when measured.
BF16_ATOL = 5e-2


def _init(config, seed=0):
    # Jitted init: eager per-parameter RNG dispatch is several times slower on CPU.
    return nnx.jit(lambda: Transformer(config, rngs=nnx.Rngs(seed)))()


@pytest.fixture(scope="module")
def model():
    return _init(TINY)


T = 12  # one shared [2, T] shape keeps the number of XLA compiles (the test cost) low


def _forward(model, tokens, positions=None, segment_ids=None):
    graphdef, state = nnx.split(model)
    return _jit_forward(graphdef, state, tokens, positions, segment_ids)


@jax.jit(static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, segment_ids):
    return nnx.merge(graphdef, state)(tokens, positions=positions, segment_ids=segment_ids)


def _forward_2xT(model, tokens, segment_ids=None, positions=None):
    """Forward with explicit positions/segment ids so all [2, T] calls share one compile."""
    if segment_ids is None:
        segment_ids = jnp.ones((2, T), jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    return _forward(model, tokens, positions, segment_ids)


def _tokens(seed, shape=(2, T)):
    return jax.random.randint(jax.random.key(seed), shape, 1, TINY.vocab_size, jnp.int32)


def test_forward_shapes_defaults_and_head(model):
    tokens = _tokens(0)
    logits = _forward(model, tokens)  # default positions / segment ids
    assert logits.shape == (2, T, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, _forward_2xT(model, tokens), atol=F32_TOL)
    hidden = nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens)
    assert hidden.shape == (2, T, TINY.d_model)
    assert model.head_weight().shape == (TINY.d_model, TINY.vocab_size)
    np.testing.assert_allclose(hidden @ model.head_weight(), logits, atol=F32_TOL)


def test_inputs_embeds_equals_token_path_bitwise(model):
    tokens = _tokens(7)
    by_tokens = nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens)
    embeds = jnp.take(model.embedding[...], tokens, axis=0)
    by_embeds = nnx.jit(lambda m, e: m.hidden_states(inputs_embeds=e))(model, embeds)
    np.testing.assert_array_equal(np.asarray(by_embeds), np.asarray(by_tokens))
    with pytest.raises(ValueError, match="exactly one of tokens / inputs_embeds"):
        model.hidden_states(tokens, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="exactly one of tokens / inputs_embeds"):
        model.hidden_states()
    with pytest.raises(ValueError, match="d_model="):
        model.hidden_states(inputs_embeds=embeds[..., :-1])


def test_packed_equals_per_segment(model):
    alone = _tokens(1, (2, 5))  # two segments, each also run alone as a batch row
    packed = jnp.concatenate([alone[0], alone[1], jnp.zeros((2,), jnp.int32)])
    packed = jnp.stack([packed, _tokens(2, (T,))])
    segment_ids = jnp.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * T], jnp.int32)
    positions = jnp.array([list(range(5)) * 2 + [0] * 2, list(range(T))], jnp.int32)
    logits = _forward_2xT(model, packed, segment_ids, positions)
    reference = _forward(model, alone)
    np.testing.assert_allclose(logits[0, :5], reference[0], atol=F32_TOL)
    np.testing.assert_allclose(logits[0, 5:10], reference[1], atol=F32_TOL)
    assert np.isfinite(np.asarray(logits)).all()


def test_padding_does_not_affect_real_tokens(model):
    real = _tokens(3)
    segment_ids = jnp.array([[1] * 8 + [0] * 4, [0] * T], jnp.int32)  # row 1: all padding
    other = jnp.where(segment_ids == 0, 7, real)  # different token ids in the padding
    a = _forward_2xT(model, real, segment_ids)
    b = _forward_2xT(model, other, segment_ids)
    np.testing.assert_allclose(a[0, :8], b[0, :8], atol=F32_TOL)
    assert np.isfinite(np.asarray(a)).all()  # rows that see nothing give no NaN


def test_causal(model):
    tokens = _tokens(5)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % TINY.vocab_size)
    a, b = _forward_2xT(model, tokens), _forward_2xT(model, changed)
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=F32_TOL)
    assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-3


def test_decode_matches_forward_with_variable_prompt_lengths(model):
    lengths, n_steps = [7, 2], 5
    p = max(lengths)
    seqs = _tokens(6)  # [2, p + n_steps]
    prompt_len = jnp.array(lengths, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(p), (2, p))
    prompt_valid = positions < prompt_len[:, None]
    prompts = jnp.where(prompt_valid, seqs[:, :p], 0)
    decode = nnx.jit(lambda m, tok, c, pos, valid: m.decode(tok, c, positions=pos, valid=valid))
    cache = model.init_cache(2, p + n_steps)
    prefill_logits, cache = decode(model, prompts, cache, positions, prompt_valid)
    np.testing.assert_array_equal(cache.index, prompt_len)
    step_logits = []
    for t in range(n_steps):
        nxt = seqs[jnp.arange(2), prompt_len + t][:, None]
        logits, cache = decode(model, nxt, cache, (prompt_len + t)[:, None],
                               jnp.ones((2, 1), bool))
        step_logits.append(logits[:, 0])
    # Reference: one full forward; row i is its first n + n_steps tokens, then padding.
    seg = (jnp.arange(T)[None] < (prompt_len + n_steps)[:, None]).astype(jnp.int32)
    full = _forward_2xT(model, seqs, seg)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(prefill_logits[i, :n], full[i, :n], atol=F32_TOL)
        for t in range(n_steps):
            np.testing.assert_allclose(step_logits[t][i], full[i, n + t], atol=F32_TOL)


def test_bf16_compute_close_to_f32(model):
    cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
    graphdef16 = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg16, rngs=nnx.Rngs(0))))
    m16 = nnx.merge(graphdef16, nnx.state(model))  # same f32 params, bf16 compute
    tokens = _tokens(7)
    l32, l16 = _forward_2xT(model, tokens), _forward_2xT(m16, tokens)
    assert l16.dtype == jnp.float32
    assert jax.eval_shape(lambda: m16.hidden_states(tokens)).dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(l16)).all()
    np.testing.assert_allclose(l16, l32, atol=BF16_ATOL)
    assert np.abs(np.asarray(l16 - l32)).max() > 0  # really ran in bf16


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 0), ("n_layers", -1), ("n_kv_heads", 3), ("d_model", 66),
    ("dtype", "float16"), ("param_dtype", "int8"), ("norm_eps", 0.0),
])
def test_invalid_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{field: value})


def test_every_param_has_logical_axes_of_right_rank(model):
    state = nnx.state(model, nnx.Param)
    axes = logical_axes(state)
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    flat_axes = jax.tree.leaves(axes, is_leaf=is_names)
    flat_params = jax.tree.leaves(state)
    assert len(flat_axes) == len(flat_params) > 0
    assert jax.tree.structure(axes, is_leaf=is_names) == jax.tree.structure(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for names, param in zip(flat_axes, flat_params):
        assert len(names) == param.ndim
        assert set(names) <= set(LOGICAL_AXIS_NAMES)


def test_tied_embeddings_and_param_counts():
    tied = nnx.eval_shape(
        lambda: Transformer(dataclasses.replace(TINY, tie_embeddings=True), rngs=nnx.Rngs(0)))
    assert not hasattr(tied, "lm_head")
    assert param_count(tied) == param_count(nnx.eval_shape(lambda: _init(TINY))) - (
        TINY.d_model * TINY.vocab_size)
    counts = {name: param_count(nnx.eval_shape(lambda c=c: Transformer(c, rngs=nnx.Rngs(0))))
              for name, c in PRESETS.items()}
    assert 5e4 < counts["tiny"] < 2e5
    assert 1e6 < counts["small"] < 3e6
    assert 8e7 < counts["100m"] < 1.3e8


def test_gradient_flows_through_split_merge(model):
    graphdef, state = nnx.split(model)
    tokens = _tokens(8, (2, 6))

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state)
    assert np.isfinite(loss)
    for g in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(g)).all()
        assert np.abs(np.asarray(g)).max() > 0


@pytest.fixture(scope="module")
def scan_pair_state(model):
    """The 2-layer loop and scanned models' params, initialised once (remat does not change
    them; the loop's are the ``model`` fixture's): (loop state, scanned state)."""
    assert TINY.n_layers == 2  # 2 layers: the scan carries layer to layer
    return nnx.state(model), nnx.state(_init(dataclasses.replace(TINY, scan_layers=True)))


def _with_state(config, state):
    """A model of ``config`` holding ``state`` (no init program compiled for it)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_scan_layers_equals_the_layer_loop_bitwise(remat, scan_pair_state):
    """scan_layers=True runs the same arithmetic as the Python loop over blocks: loss and
    every gradient leaf bit-identical on CPU (packed rows, remat on and off)."""
    cfg = dataclasses.replace(TINY, remat=remat)
    loop_state, scanned_state = scan_pair_state
    loop = _with_state(cfg, loop_state)
    scanned = _with_state(dataclasses.replace(cfg, scan_layers=True), scanned_state)
    assert loop.config.remat == scanned.config.remat == remat
    tokens = _tokens(3)
    segments = jnp.ones((2, T), jnp.int32).at[1, 7:].set(2)

    def loss(m):
        return m(tokens, segment_ids=segments).mean()

    (a, ga), (b, gb) = (nnx.jit(nnx.value_and_grad(loss))(m) for m in (loop, scanned))
    assert np.asarray(a) == np.asarray(b)
    leaves_a, leaves_b = jax.tree.leaves(ga), jax.tree.leaves(gb)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(x, y)
    lowered = nnx.jit(loss).lower(scanned).as_text()
    assert "while" in lowered or "scan" in lowered  # really one loop over the layers


def test_scan_layers_refuses_a_moe_model():
    with pytest.raises(ValueError, match="scan_layers"):
        TransformerConfig(n_experts=4, d_ff_expert=64, scan_layers=True)
