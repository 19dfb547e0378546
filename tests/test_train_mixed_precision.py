"""bf16 params + f32 optimizer state: the master copy follows the f32 optimizer exactly and
the bf16 params are its rounding, bit for bit, through several AdamW steps of a bf16 model."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.models import Transformer, TransformerConfig
from jaxflow.train.mixed_precision import f32_master

CFG = TransformerConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                        d_ff=64, max_seq_len=16, dtype="bfloat16", param_dtype="bfloat16")


def test_bf16_params_follow_the_f32_master_exactly():
    model = nnx.jit(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))()
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 32)
    inner = optax.adamw(1e-4)  # small steps: most are below bf16's resolution
    tx = f32_master(inner)

    def loss(p):
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, p)
        logits = nnx.merge(graphdef, state)(tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, new_state = tx.update(grads, opt_state, params)
        # the reference: the plain f32 optimizer on the master with the same gradients
        ref_updates, _ = inner.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads),
                                      opt_state.inner, opt_state.master)
        ref_master = optax.apply_updates(opt_state.master, ref_updates)
        return optax.apply_updates(params, updates), new_state, ref_master

    opt_state = tx.init(params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))  # (adam's step count is int32)
    start = jax.tree.map(np.asarray, params)
    for _ in range(3):
        params, opt_state, ref_master = step(params, opt_state)
        jax.tree.map(np.testing.assert_array_equal, opt_state.master, ref_master)
        jax.tree.map(lambda p, m: np.testing.assert_array_equal(
            np.asarray(p), np.asarray(m.astype(jnp.bfloat16))), params, opt_state.master)
        assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    moved_master = sum(int(np.sum(np.asarray(m) != np.asarray(s, np.float32)))
                       for m, s in zip(jax.tree.leaves(opt_state.master), jax.tree.leaves(start)))
    moved_bf16 = sum(int(np.sum(np.asarray(p) != s))
                     for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(start)))
    assert moved_master > moved_bf16  # the f32 master keeps updates bf16 would round away
