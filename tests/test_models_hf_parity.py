"""jaxflow == transformers (the reference implementation) on tiny random Llama-3, Qwen3 and
Qwen3-MoE checkpoints: f32 logits, greedy continuations, the MoE load-balancing loss, and
jaxflow-written checkpoints reloaded by transformers. Needs the ``parity`` extra (torch CPU,
transformers); it is part of the default suite and never skipped."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxflow.models import SamplingConfig, from_pretrained, make_sampler, save_pretrained
from jaxflow.models.moe import load_balancing_loss

# One intra-op thread: on a loaded 2-core machine torch's OpenMP pool is 10-20x slower than a
# single thread (measured 4-6 s vs 0.2-0.3 s per forward in bench_checkpoint).
torch.set_num_threads(1)

VOCAB = 89
LOGIT_ATOL = 1e-4  # the bound on f32 logits; measured max |diff| is ~1e-7
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _reference_models():
    return {
        # Llama-3.1 style: untied head, large theta and the "llama3" RoPE scaling (original
        # context 8 so the test positions reach the scaled band).
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **COMMON, rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8))),
        # Qwen3: head_dim 16 != hidden / heads, q/k RMSNorm, tied embeddings.
        "qwen3": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **COMMON, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True)),
        # Qwen3-MoE: 8 experts top-2 with renormalised weights; layer 1 dense.
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, head_dim=16, moe_intermediate_size=24, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[1], tie_word_embeddings=False)),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, model in _reference_models().items():
        model.eval()
        path = root / name
        model.save_pretrained(path)
        out[name] = (model, str(path), from_pretrained(str(path)))
    return out


def _tokens(seed, shape=(2, 16)):
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int64)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


@jax.jit
def _forward(graphdef_state, tokens):
    return nnx.merge(*graphdef_state)(tokens)


def _jax_logits(model, tokens):
    return np.asarray(_forward(nnx.split(model), jnp.asarray(tokens, jnp.int32)))


ARCHS = ("llama", "qwen3", "qwen3_moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(checkpoints, arch):
    ref, _, model = checkpoints[arch]
    tokens = _tokens(1)
    want = _torch_logits(ref, tokens)
    got = _jax_logits(model, tokens)
    assert got.shape == (2, 16, VOCAB) and got.dtype == np.float32
    assert np.abs(got - want).max() <= LOGIT_ATOL


def test_llama3_rope_scaling_is_exercised(checkpoints):
    """Without the llama3 scaling the logits leave the parity tolerance (measured ~2.6e-4
    on this tiny random model, vs ~1e-7 with it): the test above checks the scaled
    frequencies."""
    ref, path, _ = checkpoints["llama"]
    unscaled = from_pretrained(path, rope_scaling=None)
    assert unscaled.config.rope_scaling is None
    tokens = _tokens(1)
    assert np.abs(_jax_logits(unscaled, tokens) - _torch_logits(ref, tokens)).max() > LOGIT_ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_transformers(checkpoints, arch):
    """jaxflow's KV-cache sampler (temperature 0) vs the reference's step-by-step argmax;
    tokens must agree wherever the reference's top-2 logit margin exceeds 1e-3."""
    ref, _, model = checkpoints[arch]
    n_new = 8
    prompt = _tokens(2, (1, 6))
    seq = prompt.copy()
    margins = []
    for _ in range(n_new):
        last = _torch_logits(ref, seq)[0, -1]
        top2 = np.sort(last)[-2:]
        margins.append(top2[1] - top2[0])
        seq = np.concatenate([seq, [[int(np.argmax(last))]]], axis=1)
    want = seq[0, prompt.shape[1]:]
    graphdef, state = nnx.split(model)
    out = make_sampler(graphdef, SamplingConfig(max_new_tokens=n_new, temperature=0.0))(
        state, jnp.asarray(prompt, jnp.int32), jnp.asarray([prompt.shape[1]], jnp.int32),
        jax.random.key(0))
    got = np.asarray(out.tokens[0])
    compared = 0
    for t in range(n_new):
        if margins[t] <= 1e-3:
            break  # a near tie: the continuations may legitimately part here
        assert got[t] == want[t], (t, got, want, margins)
        compared += 1
    assert compared >= 4, margins  # the test compares a real continuation


def test_moe_load_balancing_loss_matches_transformers(checkpoints):
    ref, _, model = checkpoints["qwen3_moe"]
    tokens = _tokens(3)
    with torch.no_grad():
        want = float(ref(torch.from_numpy(tokens), output_router_logits=True).aux_loss)
    _, stats = jax.jit(lambda gs, t: nnx.merge(*gs).forward_with_aux(t))(
        nnx.split(model), jnp.asarray(tokens, jnp.int32))
    assert len(stats) == 1  # layer 1 is dense (mlp_only_layers)
    got = float(load_balancing_loss([s.router_logits for s in stats], k=2, n_experts=8))
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_by_jaxflow_reloads_in_transformers(checkpoints, arch, tmp_path):
    ref, _, model = checkpoints[arch]
    save_pretrained(model, str(tmp_path / arch))
    reloaded = type(ref).from_pretrained(str(tmp_path / arch))
    reloaded.eval()
    tokens = _tokens(4)
    np.testing.assert_array_equal(_torch_logits(reloaded, tokens), _torch_logits(ref, tokens))


def test_jaxflow_native_model_exports_as_llama(tmp_path):
    """jaxflow's own decoder (e.g. an lm_pretrain model) is a Llama: save_pretrained writes it
    as LlamaForCausalLM and transformers computes the same logits."""
    from jaxflow.models import PRESETS, Transformer

    model = nnx.jit(lambda: Transformer(PRESETS["tiny"], rngs=nnx.Rngs(3)))()
    save_pretrained(model, str(tmp_path / "native"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "native"))
    ref.eval()
    assert type(ref).__name__ == "LlamaForCausalLM"
    tokens = np.random.default_rng(5).integers(0, PRESETS["tiny"].vocab_size, (2, 16))
    assert np.abs(_jax_logits(model, tokens) - _torch_logits(ref, tokens)).max() <= LOGIT_ATOL
