"""DLRM and DCN-v2 in flax nnx, taking dense features and pooled embeddings.

The embedding tables are not part of the nnx module (they live in ``jaxflow.embeddings``,
sharded and sparsely updated); a model maps ``dense f32[B, F]`` and ``sparse f32[B, T, D]``
(one pooled embedding per table) to click logits ``f32[B]``. ``functional`` splits a model into
(graphdef, params) and returns a pure ``apply(params, dense, sparse)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.compile_only.program import count_params


class MLP(nnx.Module):
    """Linear layers with ReLU between them (and after the last when ``final_relu``)."""

    def __init__(self, in_dim: int, widths: tuple[int, ...], *, rngs: nnx.Rngs, final_relu: bool = False):
        dims = (in_dim,) + tuple(widths)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])])
        self.final_relu = final_relu

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1 or self.final_relu:
                x = jax.nn.relu(x)
        return x


class DLRM(nnx.Module):
    """Bottom MLP on dense features -> dot interaction with the embeddings -> top MLP.

    Interaction: pairwise dots of the T+1 vectors (bottom output and T embeddings), strictly
    upper triangle, concatenated with the bottom output (Naumov et al. 2019).
    """

    def __init__(self, num_dense: int, num_sparse: int, embed_dim: int, *, bottom=(64, 32),
                 top=(64, 32), rngs: nnx.Rngs):
        self.bottom = MLP(num_dense, tuple(bottom) + (embed_dim,), rngs=rngs, final_relu=True)
        n = num_sparse + 1
        self.num_vectors = n
        self.top = MLP(embed_dim + n * (n - 1) // 2, tuple(top) + (1,), rngs=rngs)

    def __call__(self, dense, sparse):
        x = self.bottom(dense)
        feats = jnp.concatenate([x[:, None, :], sparse.astype(x.dtype)], axis=1)
        rows, cols = np.triu_indices(self.num_vectors, k=1)  # static
        dots = jnp.einsum("bid,bjd->bij", feats, feats)[:, rows, cols]
        return self.top(jnp.concatenate([x, dots], axis=1))[:, 0]


class CrossLayer(nnx.Module):
    """DCN-v2 full-rank cross: ``x_{l+1} = x0 * (W x_l + b) + x_l``."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x0, x):
        return x0 * self.linear(x) + x


class DCNv2(nnx.Module):
    """Stacked cross network on [dense, flattened embeddings], then a deep MLP (Wang et al. 2021)."""

    def __init__(self, num_dense: int, num_sparse: int, embed_dim: int, *, cross_layers: int = 2,
                 deep=(64, 32), rngs: nnx.Rngs):
        dim = num_dense + num_sparse * embed_dim
        self.cross = nnx.List([CrossLayer(dim, rngs=rngs) for _ in range(cross_layers)])
        self.deep = MLP(dim, tuple(deep) + (1,), rngs=rngs)

    def __call__(self, dense, sparse):
        x0 = jnp.concatenate([dense, sparse.reshape(sparse.shape[0], -1).astype(dense.dtype)], axis=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.deep(x)[:, 0]


def build_model(arch: str, num_dense: int, num_sparse: int, embed_dim: int, *, seed: int = 0,
                bottom=(64, 32), top=(64, 32), cross_layers: int = 2, deep=(64, 32)) -> nnx.Module:
    """A ``dlrm`` or ``dcn_v2`` model over ``num_dense`` dense and ``num_sparse`` pooled sparse features of width
    ``embed_dim``."""
    rngs = nnx.Rngs(seed)
    if arch == "dlrm":
        return DLRM(num_dense, num_sparse, embed_dim, bottom=bottom, top=top, rngs=rngs)
    if arch == "dcn_v2":
        return DCNv2(num_dense, num_sparse, embed_dim, cross_layers=cross_layers, deep=deep, rngs=rngs)
    raise ValueError(f"model arch {arch!r}; valid: dlrm, dcn_v2")


def functional(model: nnx.Module):
    """(params, apply) with ``apply(params, dense, sparse) -> logits`` pure."""
    graphdef, params = nnx.split(model, nnx.Param)

    def apply(params, dense, sparse):
        return nnx.merge(graphdef, params)(dense, sparse)

    return params, apply


def dense_model_flops(arch: str, params, batch: int, num_tables: int, dim: int, *,
                      train: bool = True) -> float:
    """Analytic FLOPs of the dense model on ``batch`` samples: forward 2 x params x batch (every
    weight multiplies once per sample; biases and activations are noise) plus, for DLRM, the
    dot interaction 2 x batch x (T+1)^2 x D; a training step is 3 x the forward (backward:
    the gradients of the activations and of the weights). The embedding lookups and the
    sparse update move rows, they do not multiply."""
    forward = 2.0 * count_params(params) * batch
    if arch == "dlrm":
        forward += 2.0 * batch * (num_tables + 1) ** 2 * dim
    return 3.0 * forward if train else forward
