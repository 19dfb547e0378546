"""The traps a notebook user hit composing the README's APIs, each closed and tested:
per-token log-probs of a live model (``jaxflow.models.token_logprobs``, the RL code's
numbers), masks of any dtype (the sampler's float32 ``out.mask`` straight into the losses),
``save_pretrained`` writing the tokenizer, ``from_pretrained`` taking jnp / numpy dtypes, and
``sync.encode`` warning on an empty delta (a tree encoded against itself)."""
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow import sync
from jaxflow.align import figa_loss, sequence_logp, sft_loss
from jaxflow.mesh import make_mesh
from jaxflow.models import (
    HFTokenizer,
    SamplingConfig,
    Transformer,
    TransformerConfig,
    from_pretrained,
    predicted_mask,
    sample,
    save_pretrained,
    token_logprobs,
)
from jaxflow.rl import PolicyLossConfig, policy_loss
from jaxflow.rl.grpo_step import response_hidden
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.masks import as_bool_mask
from jaxflow.rl.metrics import masked_percentile
from jaxflow.train.lm_state import lm_functions

CFG = TransformerConfig(vocab_size=23, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=32)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def _hand_logprobs(model, tokens, temperature=1.0):
    """log_softmax of the model's own logits, gathered at the next token ([B, T - 1])."""
    logits = model(tokens[:, :-1]) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None],
                               axis=-1)[..., 0]


# ------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_is_the_log_softmax_gather(model, temperature):
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, CFG.vocab_size)
    logp, mask = token_logprobs(model, tokens, temperature=temperature, return_mask=True)
    assert logp.shape == (3, 9) and logp.dtype == jnp.float32
    np.testing.assert_array_equal(logp[:, 0], 0.0)  # position 0: nothing to predict it from
    np.testing.assert_array_equal(mask, np.arange(9)[None].repeat(3, 0) >= 1)
    # the fused tiled logsumexp vs a materialised log_softmax: f32 rounding only
    np.testing.assert_allclose(logp[:, 1:], _hand_logprobs(model, tokens, temperature),
                               rtol=0, atol=2e-6)
    assert float(jnp.max(logp[:, 1:])) < 0.0


def test_token_logprobs_packed_segments_score_each_sequence_alone(model):
    a = jnp.array([[3, 7, 1, 9, 4]], jnp.int32)
    b = jnp.array([[5, 2, 8]], jnp.int32)
    packed = jnp.array([[3, 7, 1, 9, 4, 5, 2, 8, 0, 0]], jnp.int32)
    seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]], jnp.int32)
    logp, mask = token_logprobs(model, packed, positions=pos, segment_ids=seg, return_mask=True)
    assert mask.tolist() == [[False, True, True, True, True, False, True, True, False, False]]
    np.testing.assert_array_equal(predicted_mask(packed, seg), mask)
    np.testing.assert_array_equal(logp[~mask], 0.0)
    np.testing.assert_allclose(logp[0, :5], token_logprobs(model, a)[0], rtol=0, atol=2e-6)
    np.testing.assert_allclose(logp[0, 5:8], token_logprobs(model, b)[0], rtol=0, atol=2e-6)


def test_token_logprobs_equals_the_rl_trainers_logprobs(model):
    """old_stats' pi_old log-probs (response_hidden + fused_logprobs) read off
    token_logprobs(model, prompt ++ response): the same forward, the same numbers."""
    prompts = jnp.array([[1, 5, 6, 0], [1, 7, 0, 0]], jnp.int32)
    lengths = jnp.array([3, 2], jnp.int32)
    response = jnp.array([[4, 9, 2, 0, 0], [8, 3, 3, 11, 2]], jnp.int32)
    fns = lm_functions(CFG, make_mesh({"data": 1}, devices=jax.devices()[:1]))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hidden, head = response_hidden(fns, params, prompts, lengths, response)
    rl = fused_logprobs(hidden, head, response).target_logp
    n = response.shape[1]
    slot = lengths[:, None] + jnp.arange(n)[None]
    seq = jnp.pad(prompts, ((0, 0), (0, n))).at[jnp.arange(2)[:, None], slot].set(response)
    mine = jnp.take_along_axis(token_logprobs(model, seq), slot, axis=1)
    np.testing.assert_array_equal(mine, rl)  # same input, same fused_logprobs: bit-exact


def test_token_logprobs_bad_input_names_the_value(model):
    with pytest.raises(ValueError, match=r"T >= 2"):
        token_logprobs(model, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids shape"):
        token_logprobs(model, jnp.zeros((2, 4), jnp.int32), segment_ids=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(model, jnp.zeros((2, 4), jnp.int32), temperature=0)


# ------------------------------------------------------------------------- masks of any dtype


@pytest.fixture(scope="module")
def rollout(model):
    prompts = jnp.array([[1, 5, 6, 0], [1, 7, 0, 0], [1, 4, 4, 9]], jnp.int32)
    out = sample(model, prompts, jnp.array([3, 2, 4]), key=jax.random.key(0),
                 config=SamplingConfig(max_new_tokens=8, temperature=1.0, eos_id=2))
    assert out.mask.dtype == jnp.float32  # the sampler's own dtype: what users pass on
    # a mask with zeros in it, whatever the sample did
    mask = out.mask.at[0, 5:].set(0.0).at[2, :3].set(0.0)
    return out._replace(mask=mask)


@pytest.mark.parametrize("algo,correction", [("grpo", "none"), ("dapo", "sis"),
                                             ("gspo", "tis"), ("cispo", "rs"),
                                             ("sa_gcpo", "none")])
def test_policy_loss_takes_the_samplers_float_mask(rollout, algo, correction):
    logp = rollout.logprobs + 0.05 * jax.random.normal(jax.random.key(2), rollout.logprobs.shape)
    k = jnp.zeros(logp.shape + (3,))
    cfg = PolicyLossConfig(algo=algo, correction=correction)
    adv = jnp.array([1.0, -0.5, 0.25])

    def run(mask):
        return policy_loss(logp, rollout.logprobs, adv, mask, config=cfg, key=jax.random.key(3),
                           old_topk_logp=k, new_topk_logp=k, behaviour_logp=rollout.logprobs)

    want_loss, want = run(rollout.mask > 0)
    for mask in (rollout.mask, rollout.mask.astype(jnp.int32), rollout.mask.astype(jnp.bfloat16),
                 np.asarray(rollout.mask, np.uint8), rollout.mask * 0.5):  # 0.5: nonzero = True
        loss, metrics = run(mask)
        assert float(loss) == float(want_loss), (mask.dtype, algo)
        assert {key: float(v) for key, v in metrics.items()} == \
            {key: float(v) for key, v in want.items()}


def test_every_mask_taking_function_takes_float_masks(rollout):
    logp, fmask = rollout.logprobs, rollout.mask
    bmask = fmask > 0
    for f in (sequence_logp, lambda lp, m: sft_loss(lp, m)[0],
              lambda lp, m: masked_percentile(lp, m, 50.0),
              lambda lp, m: figa_loss(lp, jnp.ones(lp.shape, jnp.int32), m,
                                      jnp.array([True, False, True]))[0]):
        np.testing.assert_array_equal(f(logp, fmask), f(logp, bmask))
        np.testing.assert_array_equal(f(logp, fmask * 0.5), f(logp, bmask))


def test_as_bool_mask_is_nonzero_and_refuses_non_numbers():
    got = as_bool_mask(np.array([0.0, 0.5, -1.0, 2.0], np.float32))
    assert got.dtype == jnp.bool_ and got.tolist() == [False, True, True, True]
    assert as_bool_mask([[1, 0]]).tolist() == [[True, False]]
    with pytest.raises(ValueError, match=r"mask must be bool or numeric.*<U1"):
        as_bool_mask(np.array(["a", "b"]))
    with pytest.raises(ValueError, match=r"mask shape \(2,\) does not match.*\(3,\)"):
        as_bool_mask(np.ones(2), shape=(3,))
    with pytest.raises(ValueError, match="mask must be bool or numeric"):
        policy_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros(1), np.array([["x", "y"]]),
                    config=PolicyLossConfig())


# ------------------------------------------------------------------------- checkpoints


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<pad>": 1, "<bos>": 2, **{w: i + 3 for i, w in enumerate(
        ["one", "two", "three", "plus", "is", "[UNK]"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(tok, eos_id=0, bos_id=2, pad_id=1)


def test_save_pretrained_writes_the_tokenizer_and_it_round_trips(model, tmp_path):
    from tokenizers import Tokenizer

    tok = _tiny_tokenizer()
    save_pretrained(model, str(tmp_path / "with"), tokenizer=tok)
    names = set(os.listdir(tmp_path / "with"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    text = "one plus two is three"
    back = HFTokenizer.from_pretrained(str(tmp_path / "with"))
    assert (back.eos_id, back.bos_id, back.pad_id) == (0, 2, 1)
    assert back.encode(text, bos=True, eos=True) == tok.encode(text, bos=True, eos=True) == \
        [2, 3, 6, 4, 7, 5, 0]
    raw = Tokenizer.from_file(str(tmp_path / "with" / "tokenizer.json"))
    assert raw.encode(text).ids == tok.tokenizer.encode(text).ids
    with open(tmp_path / "with" / "special_tokens_map.json") as f:
        assert json.load(f) == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    reloaded = from_pretrained(str(tmp_path / "with"))
    np.testing.assert_array_equal(reloaded.embedding[...], model.embedding[...])
    save_pretrained(model, str(tmp_path / "without"))
    assert "tokenizer.json" not in os.listdir(tmp_path / "without")


def test_saved_tokenizer_loads_in_transformers(model, tmp_path):
    transformers = pytest.importorskip("transformers", reason="parity extra not installed")
    save_pretrained(model, str(tmp_path), tokenizer=_tiny_tokenizer())
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("one plus two", add_special_tokens=False).input_ids == [3, 6, 4]
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (0, 2, 1)


def test_save_pretrained_refuses_a_tokenizer_that_does_not_fit(tmp_path):
    small = Transformer(TransformerConfig(vocab_size=5, d_model=16, n_layers=1, n_heads=2,
                                          n_kv_heads=2, d_ff=32, max_seq_len=8),
                        rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tokenizer has 9 tokens but the model's vocab_size is 5"):
        save_pretrained(small, str(tmp_path / "x"), tokenizer=_tiny_tokenizer())
    assert not os.path.exists(tmp_path / "x")  # checked before anything is written
    with pytest.raises(ValueError, match="valid: None, an HFTokenizer"):
        save_pretrained(small, str(tmp_path / "y"), tokenizer=object())


@pytest.mark.parametrize("dtype,want", [(jnp.float32, jnp.float32), (np.float32, jnp.float32),
                                        ("float32", jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                        (np.dtype("float32"), jnp.float32)])
def test_from_pretrained_takes_jnp_and_numpy_dtypes(model, tmp_path_factory, dtype, want):
    path = tmp_path_factory.getbasetemp() / "dtype_ckpt"
    if not (path / "config.json").exists():
        save_pretrained(model, str(path))
    loaded = from_pretrained(str(path), dtype=dtype)
    assert loaded.embedding[...].dtype == want


# ------------------------------------------------------------------------- sync.encode


def test_encode_against_itself_warns_and_stays_a_valid_empty_delta():
    layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    old = nnx.state(layer, nnx.Param)  # the trap: a view of the live variables
    nnx.update(layer, jax.tree.map(lambda x: x + 1, old))
    new = sync.to_bf16(nnx.state(layer, nnx.Param))
    with pytest.warns(UserWarning, match=r"0 of 15 elements changed.*nnx.to_pure_dict"):
        payload = sync.encode(sync.to_bf16(old), new, base_version=0, version=1)
    assert payload.sections == () and payload.version == 1
    back = sync.apply(sync.Payload.from_bytes(payload.to_bytes()), new, version=0)
    np.testing.assert_array_equal(back["kernel"], new["kernel"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a real change and a full payload: no warning
        snapshot = sync.to_bf16(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
        nnx.update(layer, jax.tree.map(lambda x: x * 2, nnx.state(layer, nnx.Param)))
        changed = sync.to_bf16(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
        delta = sync.encode(snapshot, changed, base_version=1, version=2)
        assert delta.sections
        sync.encode(changed, changed, base_version=2, version=3, codec="dense")
