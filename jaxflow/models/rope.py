"""RoPE inverse frequencies: the plain schedule and Llama-3's long-context frequency scaling.

Plain RoPE (Su et al., 2021, "RoFormer"): ``inv_freq[i] = theta ** (-2 i / head_dim)``.
Llama-3.1 (Meta, 2024, "The Llama 3 Herd of Models") rescales them for long contexts:
wavelengths longer than ``original_max_len / low_freq_factor`` are divided by ``factor``,
those shorter than ``original_max_len / high_freq_factor`` are kept, and the band between is
interpolated smoothly. The attention scale is unchanged.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxflow.config_domains import COUNT, POSITIVE, domains

ROPE_SCALING_KINDS = ("llama3",)


@domains(factor=POSITIVE, low_freq_factor=POSITIVE, high_freq_factor=POSITIVE, original_max_len=COUNT)
@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") RoPE frequency scaling, as in a checkpoint's ``rope_scaling``."""

    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}; valid: {ROPE_SCALING_KINDS}")
        if not (self.factor > 0 and self.low_freq_factor > 0
                and self.high_freq_factor > self.low_freq_factor and self.original_max_len > 0):
            raise ValueError(f"RopeScaling{dataclasses.astuple(self)}: need factor > 0, "
                             "0 < low_freq_factor < high_freq_factor, original_max_len > 0")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies (host constant, folded into the graph)."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32)[:half] / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
