"""Packed attention == per-sample unpacked attention; the backbone on the Pallas flash kernel ==
on XLA."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.flow.vit import ViTConfig, ViTEncoder
from jaxflow.flow.vlm import AttentionBackend, backbone_hidden
from jaxflow.models.transformer import Transformer, TransformerConfig

LM = TransformerConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       max_seq_len=64)
TOL = dict(rtol=1e-5, atol=1e-5)  # f32


def test_packed_backbone_equals_unpacked():
    lm = Transformer(LM, rngs=nnx.Rngs(0))
    lengths = (5, 9, 1, 7)
    x = jax.random.normal(jax.random.key(1), (sum(lengths), LM.d_model))
    t = 24
    seg = np.zeros((1, t), np.int32)
    pos = np.zeros((1, t), np.int32)
    c = 0
    for i, n in enumerate(lengths):
        seg[0, c:c + n] = i + 1
        pos[0, c:c + n] = np.arange(n)
        c += n
    xp = jnp.zeros((1, t, LM.d_model)).at[0, :c].set(x)
    hidden = jax.jit(lambda x, p, s: backbone_hidden(lm, x, p, s))
    packed = hidden(xp, jnp.asarray(pos), jnp.asarray(seg))
    # Unpacked: one sample per row, right-padded (padding = segment 0).
    m = max(lengths)
    xu = np.zeros((len(lengths), m, LM.d_model), np.float32)
    segu = np.zeros((len(lengths), m), np.int32)
    c = 0
    for i, n in enumerate(lengths):
        xu[i, :n], segu[i, :n] = x[c:c + n], 1
        c += n
    alone = hidden(jnp.asarray(xu), jnp.broadcast_to(jnp.arange(m), (len(lengths), m)),
                   jnp.asarray(segu))
    c = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(packed[0, c:c + n], alone[i, :n], **TOL)
        c += n


def test_packed_vit_equals_one_image_at_a_time():
    cfg = ViTConfig(d_model=16, n_heads=2, d_ff=32, out_dim=8, max_grid=4)
    enc = ViTEncoder(cfg, rngs=nnx.Rngs(0))
    counts = (4, 9, 1)
    p = jax.random.normal(jax.random.key(2), (1, 16, cfg.patch_dim))
    seg = np.zeros((1, 16), np.int32)
    rows = np.zeros((1, 16), np.int32)
    cols = np.zeros((1, 16), np.int32)
    c = 0
    for i, n in enumerate(counts):
        g = int(np.sqrt(n))
        seg[0, c:c + n] = i + 1
        rows[0, c:c + n], cols[0, c:c + n] = np.divmod(np.arange(n), g)
        c += n
    run = jax.jit(lambda *a: enc(*a))
    packed = run(p, jnp.asarray(seg), jnp.asarray(rows), jnp.asarray(cols))
    m = max(counts)  # unpacked: one image per row, right-padded
    pu = np.zeros((len(counts), m, cfg.patch_dim), np.float32)
    su, ru, cu = (np.zeros((len(counts), m), np.int32) for _ in range(3))
    c = 0
    for i, n in enumerate(counts):
        pu[i, :n], su[i, :n], ru[i, :n], cu[i, :n] = p[0, c:c + n], 1, rows[0, c:c + n], cols[0, c:c + n]
        c += n
    alone = run(jnp.asarray(pu), jnp.asarray(su), jnp.asarray(ru), jnp.asarray(cu))
    c = 0
    for i, n in enumerate(counts):
        np.testing.assert_allclose(packed[0, c:c + n], alone[i, :n], **TOL)
        c += n


def test_backbone_on_flash_kernel_matches_xla_interpret():
    """The shared attention switch in the VLM backbone: GQA (4 query / 2 K/V heads), three
    packed samples and padding, T 60 (the kernel wrapper pads to 64-token tiles)."""
    lm = Transformer(LM, rngs=nnx.Rngs(0))
    seg = np.repeat([1, 2, 3, 0], [20, 26, 10, 4])[None].astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in (20, 26, 10, 4)])[None].astype(np.int32)
    x = jax.random.normal(jax.random.key(3), (1, 60, LM.d_model))

    def hidden(backend, interpret):
        return jax.jit(lambda x, p, s: backbone_hidden(lm, x, p, s, backend=backend,
                                                       interpret=interpret))(
            x, jnp.asarray(pos), jnp.asarray(seg))

    ref = hidden(AttentionBackend.XLA, False)
    out = hidden(AttentionBackend.FLASH, True)
    real = seg[0] > 0  # padding rows are meaningless in every backend
    np.testing.assert_allclose(np.asarray(out)[:, real], np.asarray(ref)[:, real], **TOL)
    assert AttentionBackend("flash") is AttentionBackend.FLASH
