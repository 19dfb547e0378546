# ruff: noqa: E402
# title: SIS policy loss on sampled rows, with an optax step
# %% [markdown]
# # SIS policy loss on sampled rows, with an optax step
#
# A tiny LM samples G responses per prompt; we score them, take GRPO advantages, and
# minimise the GRPO policy loss with the SIS correction for a few optax steps on the same
# rows (so the later steps are off-policy, which is what SIS corrects). CPU, one device.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.models import SamplingConfig, Transformer, TransformerConfig, sample, token_logprobs
from jaxflow.rl import PolicyLossConfig, fused_logprobs, grpo_advantages, policy_loss

# %% [markdown]
# A decoder-only LM with a 16-token vocabulary; `sample` draws 6 new tokens for each of
# 2 prompts x G = 4 rows and returns the log-probs of the distribution it sampled from and a
# float32 mask (1 up to and including the first EOS).

# %%
cfg = TransformerConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                        max_seq_len=16)
model = Transformer(cfg, rngs=nnx.Rngs(0))
G, P, N, EOS = 4, 3, 6, 2  # responses per prompt, prompt length, new tokens, end-of-sequence id
prompts = jnp.array([[1, 5, 6], [1, 7, 8]], jnp.int32).repeat(G, axis=0)  # [B=8, P]
out = sample(model, prompts, jnp.full((8,), P), key=jax.random.key(0),
             config=SamplingConfig(max_new_tokens=N, temperature=1.0, top_k=0, eos_id=EOS))
print(out.tokens)
print(out.mask.dtype, out.mask.sum(axis=1))

# %% [markdown]
# The sampler's log-probs are the model's own: `token_logprobs(model, prompt ++ response)`
# scores every token from the ones before it (position 0 gets 0.0), so the response's
# log-probs are its last N columns.

# %%
seq = jnp.concatenate([prompts, out.tokens], axis=1)  # [B, P + N]
trainer_logp = token_logprobs(model, seq)[:, P:]       # [B, N]
on = out.mask > 0
print("max |sampler - trainer| log-prob:", float(jnp.max(jnp.abs(jnp.where(on, trainer_logp - out.logprobs, 0)))))
np.testing.assert_allclose(np.where(on, trainer_logp, 0), np.where(on, out.logprobs, 0), atol=1e-5)

# %% [markdown]
# A toy verifiable reward (how many 7s the response holds) and GRPO's group-normalised
# advantages, one per row.

# %%
rewards = jnp.sum((out.tokens == 7) * out.mask, axis=1)
adv = grpo_advantages(rewards, G)
print("rewards", rewards, "\nadvantages", adv.round(2))

# %% [markdown]
# SIS needs pi_old's log-probs at its own top-K tokens and the current policy's log-probs at
# the same tokens. `fused_logprobs` computes both from the final hidden states and the LM
# head (`own_topk=K` returns pi_old's top-K; `topk_indices=` scores given tokens).

# %%
K = 4


def response_logprobs(m, topk_indices=None, own_topk=0):
    """Log-probs of the response tokens (and at top-K tokens) under model ``m``: [B, N](, K)."""
    hidden = m.hidden_states(seq[:, :-1])[:, P - 1:]  # the states that predict response tokens
    return fused_logprobs(hidden, m.head_weight().astype(hidden.dtype), out.tokens, topk_indices,
                          own_topk=own_topk)


old = response_logprobs(model, own_topk=K)  # pi_old: frozen for the whole update
print(old.own_topk_indices.shape, old.own_topk_logp.shape)

# %% [markdown]
# The loss: GRPO with the SIS correction, the sampler's float mask passed as it is (any
# numeric mask works: nonzero = True). An optax Adam step updates the params; the step is
# jitted once and reused, each with a fresh PRNG key for SIS's uniforms.

# %%
loss_cfg = PolicyLossConfig(algo="grpo", correction="sis")
graphdef, params = nnx.split(model)
tx = optax.adam(1e-2)
opt_state = tx.init(params)


def loss_fn(params, key, correction_cfg):
    m = nnx.merge(graphdef, params)
    new = response_logprobs(m, topk_indices=old.own_topk_indices)
    return policy_loss(new.target_logp, old.target_logp, adv, out.mask, config=correction_cfg, key=key,
                       old_topk_logp=old.own_topk_logp, new_topk_logp=new.topk_logp)


@jax.jit
def train_step(params, opt_state, key):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, key, loss_cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics


history = []
key = jax.random.key(1)
start_params = params
for step in range(4):
    key, sub = jax.random.split(key)
    params, opt_state, loss, metrics = train_step(params, opt_state, sub)
    history.append({k: float(metrics[k]) for k in ("accept_rate", "clip_fraction", "d_original")})
    print(step, f"loss {float(loss):+.4f}", history[-1])

# %% [markdown]
# Checks: on the first step the policy is pi_old, so SIS accepts every token and its gradient
# is the plain GRPO gradient; after the policy moved, SIS rejects some tokens; and the update
# raised the advantage-weighted log-likelihood of the sampled responses.

# %%
assert history[0]["accept_rate"] == 1.0 and history[0]["d_original"] < 1e-5  # f32 rounding (jit vs eager)
assert history[-1]["accept_rate"] < 1.0, history
# eager, like `old` above: the same ops give the same log-probs, so every log-ratio is exactly 0
g_sis = jax.grad(lambda p: loss_fn(p, jax.random.key(9), loss_cfg)[0])(start_params)
g_grpo = jax.grad(lambda p: loss_fn(p, jax.random.key(9), PolicyLossConfig(algo="grpo"))[0])(start_params)
for a, b in zip(jax.tree.leaves(g_sis), jax.tree.leaves(g_grpo)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def weighted_loglik(p):
    logp = token_logprobs(nnx.merge(graphdef, p), seq)[:, P:]
    return float(jnp.sum(adv[:, None] * logp * out.mask))


before, after = weighted_loglik(start_params), weighted_loglik(params)
print(f"sum_i A_i log pi(y_i): {before:.3f} -> {after:.3f}")
assert after > before
