"""kernel_footprints: every Pallas kernel lowered for TPU and GPU at test and production sizes,
with each program's grid, blocks and footprint (the lowering gate's numbers, as a table).

    python -m jaxflow.run --exp=kernel_footprints --variant=quick

Nothing runs on an accelerator: ``jax.export`` lowers for ``tpu`` (Mosaic, declared device
kind TPU v5p) and ``cuda`` (Triton) on this CPU host; footprints come from the traced
``pallas_call`` grid mappings (``pallas_kernels.lowering``).
"""

from __future__ import annotations

import dataclasses

DESCRIPTION = "Pallas kernels lowered for tpu/cuda: grids, blocks and per-program footprints"
ENTRY = "jaxflow.main.kernel_footprints:main"
VARIANTS = ("quick", "default")
_SIZES = ("test", "production")
_PLATFORMS = ("tpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    sizes: tuple[str, ...] = _SIZES
    platforms: tuple[str, ...] = _PLATFORMS

    def __post_init__(self):
        for s in self.sizes:
            if s not in _SIZES:
                raise ValueError(f"size {s!r}; valid: {', '.join(_SIZES)}")
        for p in self.platforms:
            if p not in _PLATFORMS:
                raise ValueError(f"platform {p!r}; valid: {', '.join(_PLATFORMS)}")


def get_config(variant: str) -> Config:
    if variant in VARIANTS:
        return Config()
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
