"""The tile layout both SparseRL-Sync kernels share: flat bf16 bit arrays viewed as rows of 128
lanes, ``block_rows`` rows (a multiple of 16, the bf16 sublane tile) per program."""

from __future__ import annotations

import dataclasses

from pallas_kernels import dispatch

_PLATFORMS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class SyncBlockSizes:
    """Rows of 128 lanes per tile (a multiple of 16) and the kernel layout."""

    block_rows: int = 256
    platform: str = "tpu"
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.platform not in _PLATFORMS:
            raise ValueError(f"platform {self.platform!r}; valid: {', '.join(_PLATFORMS)}")
        r = self.block_rows
        if not isinstance(r, int) or r < 16 or r % 16 or (self.platform == "gpu" and r & (r - 1)):
            raise ValueError(f"block_rows={r!r}; must be a multiple of 16 (a power of two on GPU)")

    @classmethod
    def get_default(cls, platform: str | None = None) -> SyncBlockSizes:
        """platform "tpu", "gpu" or None (``dispatch.backend_platform()``; CPU gets the TPU
        layout, which interpret mode runs)."""
        if platform is None:
            platform = "gpu" if dispatch.backend_platform() == "gpu" else "tpu"
        if platform == "gpu":
            return cls(block_rows=32, platform="gpu", num_warps=4, num_stages=1)
        return cls(block_rows=256, platform="tpu")
