"""ViT encoder over packed variable-size images + projector into the LM's embedding space.

Images of different sizes give different patch counts. Instead of padding every image to the
largest, the patches of many images are packed into rows (``pack_patches``): each image is one
segment, attention is bidirectional within a segment, and learned row/column embeddings give
each patch its 2-D place. The transformer blocks are the foundation's decoder blocks
(``jaxflow.models.transformer.Block``) run on packed rows with bidirectional (``causal=False``)
segment attention, through the LM's attention switch (``jaxflow.models.attention_backends``:
the XLA reference on CPU, splash on TPU, Pallas flash / cuDNN on GPU, ``auto``); the flowtrain
steps give the encoder the run's backend, the backbone's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.config_domains import COUNT, domains
from jaxflow.models.attention_backends import AttentionBackend
from jaxflow.models.transformer import Block, RMSNorm, TransformerConfig, scan_blocks


@domains(patch_size=COUNT, max_grid=COUNT, d_model=COUNT, n_layers=COUNT, n_heads=COUNT, d_ff=COUNT, out_dim=COUNT)
@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """The ViT encoder's size: patch size, largest grid, width, depth, heads, MLP width, output width (the LM's
    ``d_model``), dtype, remat and whether the blocks run as one scan (``scan_layers``)."""
    patch_size: int = 4
    max_grid: int = 8  # largest image = max_grid * patch_size pixels per side
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 2
    d_ff: int = 64
    out_dim: int = 64  # the LM's d_model
    # The blocks' compute dtype ("float32" | "bfloat16"; parameters stay float32) and whether
    # each block is rematerialised in the backward pass (the encoder's vjp then keeps only the
    # block inputs as residuals).
    dtype: str = "float32"
    remat: bool = False
    # Run the blocks as one ``lax.scan`` over stacked weights (compiled once for the layer
    # body, as the backbone's ``scan_layers``); the same arithmetic as the Python loop.
    scan_layers: bool = False

    def block_config(self) -> TransformerConfig:
        """The TransformerConfig of the encoder's blocks (bidirectional use of the LM's block)."""
        return TransformerConfig(vocab_size=1, d_model=self.d_model, n_layers=self.n_layers,
                                 n_heads=self.n_heads, n_kv_heads=self.n_heads, d_ff=self.d_ff,
                                 max_seq_len=self.max_grid**2, dtype=self.dtype,
                                 remat=self.remat)

    @property
    def patch_dim(self) -> int:
        """Pixels per patch (``patch_size ** 2``)."""
        return self.patch_size**2

    @property
    def row_len(self) -> int:
        """Patch slots per encoder row: the patch count of the largest image."""
        return self.max_grid**2


class ViTEncoder(nnx.Module):
    """patches [R, L, P*P] -> embeddings [R, L, out_dim] (one per patch, already projected)."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        self.config = config
        d = config.d_model

        def param(shape, std, axes):
            return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32),
                             out_sharding=axes, eager_sharding=False)

        self.patch_embed = param((config.patch_dim, d), config.patch_dim**-0.5, (None, "embed"))
        self.row_embed = param((config.max_grid, d), 0.02, (None, "embed"))
        self.col_embed = param((config.max_grid, d), 0.02, (None, "embed"))
        block_cfg = config.block_config()
        self.blocks = nnx.List([Block(block_cfg, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = RMSNorm(block_cfg)
        self.proj_in = param((d, config.out_dim), d**-0.5, ("embed", "mlp"))
        self.proj_out = param((config.out_dim, config.out_dim), config.out_dim**-0.5,
                              ("mlp", None))

    def __call__(self, patches: jax.Array, segment_ids: jax.Array, rows: jax.Array,
                 cols: jax.Array, *, attention: str | AttentionBackend = "xla",
                 interpret: bool = False) -> jax.Array:
        """Encodes packed patch rows; each image attends bidirectionally within its segment.

        Args:
          patches: [R, L, P*P] f32.
          segment_ids: [R, L] int, one id per image of a row; 0 = empty slot.
          rows, cols: [R, L] int grid coordinates of each patch in its image.
          attention: the blocks' attention backend (``ATTENTION_BACKENDS``; the flowtrain steps
            pass the run's); default the XLA reference.
          interpret: run a Pallas attention kernel (splash / flash) in interpret mode.

        Returns:
          [R, L, out_dim] f32. Real patches: the same on every backend (to kernel round-off).
          Empty slots are finite and meaningless: on XLA their attention output is zero (each
          slot's output is the MLP path of its own embedding), in the kernels an empty slot
          attends to the empty slots of its row; no real patch sees them.
        """
        x = patches @ self.patch_embed[...]
        x = x + self.row_embed[...][rows] + self.col_embed[...][cols]
        block_cfg = self.config.block_config()
        x = x.astype(block_cfg.compute_dtype)  # the residual stream in the blocks' dtype
        positions = rows * self.config.max_grid + cols
        backend = attention.value if isinstance(attention, AttentionBackend) else attention

        def forward(block, h):
            return block.forward(h, positions, segment_ids, attention=backend,
                                 interpret=interpret, causal=False)[0]

        policy = (getattr(jax.checkpoint_policies, block_cfg.remat_policy)
                  if block_cfg.remat else None)
        if self.config.scan_layers:  # one loop over the layers, not n_layers copies
            x = scan_blocks(self.blocks, lambda blk, h: (forward(blk, h), None), x, policy)
        else:
            if policy is not None:
                forward = nnx.remat(forward, policy=policy)
            for block in self.blocks:
                x = forward(block, x)
        x = self.norm(x)
        return jax.nn.gelu(x @ self.proj_in[...]) @ self.proj_out[...]


def patchify(image: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[S, S] -> (patches [(S/P)^2, P*P], rows, cols), raster order."""
    s = image.shape[0]
    g = s // patch_size
    p = image.reshape(g, patch_size, g, patch_size).transpose(0, 2, 1, 3).reshape(g * g, -1)
    rr, cc = np.divmod(np.arange(g * g), g)
    return p, rr, cc


@dataclasses.dataclass
class PatchBatch:
    """Packed encoder input (host numpy) and where each image landed.

    ``image_slots[i]`` is the flat index (row * L + col) of image i's first patch in the
    encoder output reshaped to [R * L, out_dim]; its patches are consecutive.
    """

    patches: np.ndarray  # [R, L, P*P] f32
    segment_ids: np.ndarray  # [R, L] int32
    rows: np.ndarray  # [R, L] int32
    cols: np.ndarray  # [R, L] int32
    image_slots: list[int]

    def arrays(self) -> dict[str, np.ndarray]:
        """The batch's arrays by name: patches, segment_ids, rows, cols."""
        return {"patches": self.patches, "segment_ids": self.segment_ids, "rows": self.rows,
                "cols": self.cols}

    @property
    def padding_waste(self) -> float:
        """Fraction of patch slots that are padding (segment id 0)."""
        return float(1.0 - (self.segment_ids > 0).mean()) if self.segment_ids.size else 0.0


def pack_patches(images: list[np.ndarray], config: ViTConfig, *, row_multiple: int = 1,
                 row_bucket: int = 4) -> PatchBatch:
    """Packs images (first-fit decreasing by patch count) into rows of ``config.row_len``.

    The row count is rounded up to a multiple of ``row_multiple * row_bucket`` so the number
    of compiled shapes stays small and rows shard evenly over ``row_multiple`` devices.
    """
    L = config.row_len
    counts = [(im.shape[0] // config.patch_size) ** 2 for im in images]
    if any(c > L for c in counts):
        raise ValueError(f"an image with {max(counts)} patches exceeds the encoder row of {L} "
                         f"patches (max_grid={config.max_grid})")
    order = sorted(range(len(images)), key=lambda i: -counts[i])
    fill: list[int] = []
    placed: dict[int, tuple[int, int]] = {}
    for i in order:
        for r, used in enumerate(fill):
            if used + counts[i] <= L:
                placed[i] = (r, used)
                fill[r] += counts[i]
                break
        else:
            placed[i] = (len(fill), 0)
            fill.append(counts[i])
    step = max(1, row_multiple * row_bucket)
    n_rows = max(step, math.ceil(len(fill) / step) * step)
    patches = np.zeros((n_rows, L, config.patch_dim), np.float32)
    seg = np.zeros((n_rows, L), np.int32)
    rows = np.zeros((n_rows, L), np.int32)
    cols = np.zeros((n_rows, L), np.int32)
    slots = []
    for i, im in enumerate(images):
        r, c0 = placed[i]
        p, rr, cc = patchify(im, config.patch_size)
        n = p.shape[0]
        patches[r, c0:c0 + n] = p
        seg[r, c0:c0 + n] = i + 1
        rows[r, c0:c0 + n] = rr
        cols[r, c0:c0 + n] = cc
        slots.append(r * L + c0)
    return PatchBatch(patches, seg, rows, cols, slots)
