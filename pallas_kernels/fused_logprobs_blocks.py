"""Block sizes and VMEM limits of the fused log-prob kernels, per platform and chip.

``FusedLogprobsBlockSizes.get_default(platform, d=, dtype=, num_ids=, chip=)`` picks them.
On TPU the choice comes from the compiler, not from a footprint estimate: ``TPU_TABLE`` holds,
per chip generation, dtype and hidden size, blocks that compile and a ``vmem_limit_bytes``
above the smallest limit the real XLA:TPU compiler (Mosaic) accepted for each of the three
kernels (forward, dh, dW), measured by deviceless compiles
(``pallas_kernels.fused_logprobs.kernel_vmem_need``). Mosaic's scoped VMEM default is 16 MiB
on v5e and v5p, far below the 128 MiB (v5e, v6e) or 64 MiB (v5p) a TensorCore has, and the
forward / dh kernels need more than 16 MiB at d = 4,096.

Range: d <= 8,192 in bf16 and f32 (the table's rows; a smaller d takes the row above it,
whose blocks need no more VMEM at a smaller d); num_ids <= 128 id columns (K <= 127 given
top-K ids plus the target; measured at 101), N up to 8,192 rows per call (the production
compiles; the need grew with the grid once, see ``TPU_NEEDS``). Beyond d = 8,192 (a
Llama-3-405B head: d 16,384) the widest row's blocks are halved (vocab columns first, rows
down to 32) until its measured needs, scaled by d x (rows + columns) (what the h / W / dh
blocks hold), times 1.25 fit 3/4 of the core's VMEM (of v5p's, the smallest, for chip=None),
the limit then; more than 128 id columns take the smallest blocks at that limit. Neither is a
compiled figure: the compile gate's sweep compiles the 405B-class head on every chip.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import targets

_PLATFORMS = ("tpu", "gpu")
TPU_CHIPS, GPU_CHIPS = targets.TPU_CHIPS, targets.GPU_CHIPS
VMEM_PER_CORE = {c: targets.CHIPS[c].onchip_bytes for c in TPU_CHIPS}  # 128 / 64 / 128 MiB
_MIB = 2**20

# Compiled VMEM needs, MiB: the smallest vmem_limit_bytes (to 1/4 MiB) each kernel (forward,
# dh, dW) compiled at, K = 100 given ids (101 id columns), per chip measured on, dtype, d and
# the kernel's block (rows, vocab columns; the forward and dh share block_n, block_v).
# Measured with libtpu 0.0.42.1 / jax 0.10.2 (the /tmp/aot venv of
# ../shared/reference/accelerators.md) by
#   python -m pallas_kernels.fused_logprobs CHIP DTYPE D BN BV BN2 BV2
# e.g. "v5p bfloat16 4096 128 512 128 256", on a small grid (256-512 rows, 2.5 vocab tiles).
# A figure of 16.0 compiled at the first try (16 MiB), so it is an upper bound. The grid can
# matter: f32 d 8192 dh needed 28.25 MiB there but 36.5 at N 8,192, V 151,936 (the same
# command with "dh 101 8192 151936"), so every row was also compiled at that production size.
TPU_NEEDS: dict[tuple[str, str, int, str, int, int], float] = {
    # (chip, dtype, d, kernel, rows, vocab columns): MiB
    ("v5p", "bfloat16", 4096, "fwd", 128, 512): 16.75,
    ("v5p", "bfloat16", 4096, "dh", 128, 512): 33.5,
    ("v5p", "bfloat16", 4096, "dw", 128, 256): 23.5,
    ("v5p", "bfloat16", 4096, "dw", 256, 256): 43.25,
    ("v5e", "bfloat16", 4096, "fwd", 128, 512): 16.75,
    ("v5e", "bfloat16", 4096, "dh", 128, 512): 34.0,
    ("v5e", "bfloat16", 4096, "dw", 128, 512): 41.0,
    ("v5e", "bfloat16", 4096, "fwd", 256, 512): 25.5,
    ("v5e", "bfloat16", 4096, "dh", 256, 512): 63.75,
    ("v5e", "bfloat16", 4096, "dw", 256, 256): 43.0,
    ("v6e", "bfloat16", 4096, "fwd", 256, 512): 24.5,
    ("v6e", "bfloat16", 4096, "dh", 256, 512): 66.75,
    ("v6e", "bfloat16", 4096, "dw", 256, 256): 43.75,
    ("v5p", "bfloat16", 8192, "fwd", 128, 256): 18.75,
    ("v5p", "bfloat16", 8192, "dh", 128, 256): 31.75,
    ("v5p", "bfloat16", 8192, "dw", 256, 128): 40.0,
    ("v5p", "bfloat16", 8192, "dw", 128, 128): 26.0,
    ("v5p", "float32", 4096, "fwd", 128, 256): 18.75,
    ("v5p", "float32", 4096, "dh", 128, 256): 27.25,
    ("v5p", "float32", 4096, "dw", 256, 128): 31.75,
    ("v5p", "float32", 8192, "fwd", 128, 128): 16.0,
    ("v5p", "float32", 8192, "dh", 128, 128): 36.5,  # 28.25 on the small grid, see below
    ("v5p", "float32", 8192, "dw", 128, 128): 28.25,
}
# Mosaic spills large tiles (the unrolled id gathers over a [block_n, block_v] f32 tile): a
# (512, 512) dW block asked for 100 MiB of register-allocator spill slots on v5e.

# (chip, dtype, d_max) -> blocks (block_n, block_v, block_n_dw, block_v_dw) and vmem limit MiB:
# the limit is the chip's largest measured need for those blocks x 1.25, rounded up to a MiB,
# and at most 3/4 of the core's VMEM (48 MiB on v5p). "any" (chip=None): blocks that fit v5p,
# the smallest core, and the largest limit any chip needs for them. A chip without its own
# figure for a block takes the largest figure another chip measured.
TPU_TABLE: dict[tuple[str, str, int], tuple[tuple[int, int, int, int], int]] = {}
_ROWS = {  # (dtype, d): blocks for v5p / any, for v5e and v6e
    ("bfloat16", 4096): ((128, 512, 128, 256), (256, 512, 256, 256)),
    ("bfloat16", 8192): ((128, 256, 128, 128), (128, 256, 128, 128)),
    ("float32", 4096): ((128, 256, 256, 128), (128, 256, 256, 128)),
    ("float32", 8192): ((128, 128, 128, 128), (128, 128, 128, 128)),
}


def _limit_mib(needs) -> int:
    return math.ceil(1.25 * max(needs))


def _table_needs(chip: str, dtype: str, d: int, blocks: tuple) -> tuple:
    """(forward, dh, dW) MiB for blocks: the chip's own figure, else the largest another
    chip measured (None: not measured)."""
    bn, bv, bn2, bv2 = blocks
    out = []
    for k in (("fwd", bn, bv), ("dh", bn, bv), ("dw", bn2, bv2)):
        others = [TPU_NEEDS.get((c, dtype, d) + k) for c in TPU_CHIPS]
        others = [x for x in others if x is not None]
        out.append(TPU_NEEDS.get((chip, dtype, d) + k, max(others, default=None)))
    return tuple(out)


for (_dt, _d), (_small, _big) in _ROWS.items():
    for _chip in TPU_CHIPS:
        _blocks = _small if _chip == "v5p" else _big
        TPU_TABLE[(_chip, _dt, _d)] = (_blocks, _limit_mib(_table_needs(_chip, _dt, _d, _blocks)))
    TPU_TABLE[("any", _dt, _d)] = (_small, max(_limit_mib(_table_needs(c, _dt, _d, _small))
                                               for c in TPU_CHIPS))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def _d_row(d: int) -> int | None:
    """The table's hidden-size row for d: the smallest measured d_max >= d, else None."""
    rows = sorted({k[2] for k in TPU_TABLE})
    return next((r for r in rows if d <= r), None)


@dataclasses.dataclass(frozen=True)
class FusedLogprobsBlockSizes:
    """Block sizes of the fused log-prob kernels.

    platform: kernel layout, "tpu" (Mosaic grid with a sequential vocab axis) or "gpu"
      (Triton programs with in-kernel loops).
    block_n, block_v: rows and vocab columns per step of the forward and dh kernels.
    block_n_dw, block_v_dw: rows per step and vocab columns per program of the dW kernel.
    block_d: GPU only, hidden columns per in-kernel chunk.
    num_warps, num_stages: GPU only, Triton compiler parameters.
    vmem_limit_bytes: TPU only, Mosaic's scoped VMEM limit for each of the three kernels
      (None: the compiler's default, 16 MiB on v5e / v5p).
    """

    platform: str = "tpu"
    block_n: int = 128
    block_v: int = 512
    block_n_dw: int = 256
    block_v_dw: int = 128
    block_d: int = 64
    num_warps: int = 4
    num_stages: int = 2
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"platform {self.platform!r}; valid: {', '.join(_PLATFORMS)}")
        for name in ("block_n", "block_v", "block_n_dw", "block_v_dw", "block_d"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 8 or v & (v - 1):
                raise ValueError(f"{name}={v!r}; must be a power of two >= 8")
        if self.platform == "tpu" and min(self.block_v, self.block_v_dw) < 128:
            raise ValueError(f"TPU vocab blocks must be >= 128 lanes, got block_v={self.block_v}, "
                             f"block_v_dw={self.block_v_dw}")

    @property
    def stat_lanes(self) -> int:
        """Width of the per-row logsumexp output: lane-dense 128 on TPU, 1 on GPU."""
        return 128 if self.platform == "tpu" else 1

    def id_lanes(self, num_ids: int) -> int:
        """Width L of the id / log-prob columns for ``num_ids`` ids."""
        if self.platform == "tpu":
            return 128 * math.ceil(num_ids / 128)
        return max(16, _next_pow2(num_ids))

    @classmethod
    def get_default(cls, platform: str | None = None, *, d: int = 4096, dtype=jnp.bfloat16,
                    num_ids: int = 1, chip: str | None = None) -> FusedLogprobsBlockSizes:
        """Blocks (and on TPU ``vmem_limit_bytes``) for hidden size d, dtype and num_ids id
        columns (target + given top-K).

        platform: "tpu", "gpu" or None (``dispatch.backend_platform()``; CPU gets the TPU
          layout, which is what interpret mode runs; with chip None too, the chip is the traced
          mesh's, ``dispatch.target_chip()``).
        chip: "v5e", "v5p", "v6e" (TPU) or "h100", "h200" (GPU), or None: the conservative
          choice, blocks and a limit that compile on every chip of the platform.
        TPU range: see the module docstring (d <= 8,192, bf16 / f32, num_ids <= 128)."""
        if platform is None:
            from pallas_kernels import dispatch

            platform = "gpu" if dispatch.backend_platform() == "gpu" else "tpu"
            if chip is None:  # the chip of the mesh being traced, where it is one of ours
                traced = dispatch.target_chip()
                chip = traced if traced in (TPU_CHIPS if platform == "tpu" else GPU_CHIPS) else None
        chips = TPU_CHIPS if platform == "tpu" else GPU_CHIPS
        if chip is not None and chip not in chips:
            raise ValueError(f"chip {chip!r} for platform {platform!r}; valid: "
                             f"{', '.join(chips)} or None")
        s = jnp.dtype(dtype).itemsize
        if platform == "gpu":
            # H100 and H200 are both sm_90 with 227 KiB of shared memory per block (only HBM
            # differs), so one choice serves both. 32-row blocks while the id columns and h
            # are narrow; 16 rows and 32-wide hidden chunks otherwise (K >= 128 or f32).
            wide = cls(platform="gpu").id_lanes(num_ids) > 128 or s > 2
            bn, bd = (16, 32) if wide else (32, 64)
            return cls(platform="gpu", block_n=bn, block_v=128, block_n_dw=bn, block_v_dw=64,
                       block_d=bd, num_warps=4, num_stages=2)
        return cls(**tpu_choice(chip, _dtype_name(dtype), d, num_ids))

    def clamp(self, rows: int, vocab: int, d: int | None = None) -> FusedLogprobsBlockSizes:
        """Blocks no larger than the (power-of-two rounded) problem needs; on GPU, block_d
        also shrunk to a power of two dividing d (>= 16, Triton's smallest dot) when one
        exists, so the hidden dim needs no padding."""
        lo_v = 128 if self.platform == "tpu" else 16
        rows2, vocab2 = max(16, _next_pow2(rows)), max(lo_v, _next_pow2(vocab))
        bd = self.block_d
        if self.platform == "gpu" and d is not None and d % bd:
            bd = next((b for b in (bd // 2, bd // 4, bd // 8) if b >= 16 and d % b == 0), bd)
        return dataclasses.replace(
            self, block_n=min(self.block_n, rows2), block_n_dw=min(self.block_n_dw, rows2),
            block_v=min(self.block_v, vocab2), block_v_dw=min(self.block_v_dw, vocab2),
            block_d=bd)


def _scaled_blocks(chip: str | None, dtype: str, d: int, limit: int) -> tuple:
    """Blocks for d above the table's widest row: that row's, halved until each kernel's
    measured need x d / d_row x (rows + columns) / (rows_row + columns_row) x 1.25 fits
    ``limit`` bytes (vocab columns halved first, down to 128; rows down to 32)."""
    d_row = max(k[2] for k in TPU_TABLE)
    blocks = TPU_TABLE[("any" if chip is None else chip, dtype, d_row)][0]
    needs = _table_needs(chip or "v5p", dtype, d_row, blocks)

    def fits(new):
        pairs = ((new[0], new[1], blocks[0], blocks[1], needs[0]),
                 (new[0], new[1], blocks[0], blocks[1], needs[1]),
                 (new[2], new[3], blocks[2], blocks[3], needs[2]))
        return all(1.25 * need * _MIB * d / d_row * (n + v) / (n0 + v0) <= limit
                   for n, v, n0, v0, need in pairs if need is not None)

    new = list(blocks)
    while not fits(new):
        for i in (1, 3, 0, 2):  # vocab columns first (>= 128 lanes), then rows (>= 32)
            if new[i] > (128 if i % 2 else 32):
                new[i] //= 2
                break
        else:
            break  # the smallest blocks: left to the compiler
    return tuple(new)


def tpu_choice(chip: str | None, dtype: str, d: int, num_ids: int) -> dict:
    """Keyword arguments of the TPU blocks for ``chip`` (None: every chip), dtype name, d and
    num_ids, from ``TPU_TABLE``."""
    row = _d_row(d) if num_ids <= 128 else None
    if dtype not in ("bfloat16", "float32"):
        dtype = "float32" if jnp.dtype(dtype).itemsize > 2 else "bfloat16"
    if row is None:  # outside the measured range: 3/4 of the VMEM
        limit = 3 * min(VMEM_PER_CORE[c] for c in ((chip,) if chip else TPU_CHIPS)) // 4
        if num_ids <= 128:
            blocks = _scaled_blocks(chip, dtype, d, limit)
        else:
            blocks = min((v[0] for k, v in TPU_TABLE.items() if k[1] == dtype),
                         key=lambda b: b[0] * b[1] + b[2] * b[3])
    else:
        blocks, limit = TPU_TABLE[("any" if chip is None else chip, dtype, row)]
        limit *= _MIB
    return dict(platform="tpu", block_n=blocks[0], block_v=blocks[1], block_n_dw=blocks[2],
                block_v_dw=blocks[3], vmem_limit_bytes=limit)
