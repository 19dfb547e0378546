"""Heterogeneous parallel allocator: split N devices between encoder and backbone.

Each module is profiled (samples/s) under candidate configurations (device count, data x
tensor degrees). A producer-consumer pipeline runs at the pace of its slower side, so the
allocator picks the pair of configurations using at most N devices that maximises
``min(encoder throughput, backbone throughput)`` (ties: fewer devices, then the larger sum).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Mapping


@dataclasses.dataclass(frozen=True, order=True)
class ParallelConfig:
    """``devices = data * model`` devices: data-parallel and tensor-parallel degrees."""

    data: int
    model: int = 1

    @property
    def devices(self) -> int:
        """Devices this side uses: ``data * model``."""
        return self.data * self.model

    def __str__(self) -> str:
        return f"{self.devices}({self.data}x{self.model})"


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The chosen split: each side's parallel config and its profiled throughput (samples/s)."""
    encoder: ParallelConfig
    backbone: ParallelConfig
    encoder_samples_per_s: float
    backbone_samples_per_s: float

    @property
    def predicted_samples_per_s(self) -> float:
        """The pipelined bound: the slower side's throughput."""
        return min(self.encoder_samples_per_s, self.backbone_samples_per_s)

    @property
    def predicted_serial_samples_per_s(self) -> float:
        """If the two sides cannot overlap (shared cores): 1 / (1/enc + 1/backbone)."""
        return 1.0 / (1.0 / self.encoder_samples_per_s + 1.0 / self.backbone_samples_per_s)


def allocate(encoder_profile: Mapping[ParallelConfig, float],
             backbone_profile: Mapping[ParallelConfig, float], n_devices: int) -> Allocation:
    """The throughput-matching split (exhaustive over the profiled pairs).

    Raises ValueError when no pair fits ``n_devices``.
    """
    best, best_key = None, None
    for enc, te in encoder_profile.items():
        for bb, tb in backbone_profile.items():
            used = enc.devices + bb.devices
            if used > n_devices:
                continue
            key = (min(te, tb), -used, te + tb)
            if best_key is None or key > best_key:
                best, best_key = Allocation(enc, bb, float(te), float(tb)), key
    if best is None:
        raise ValueError(
            f"no encoder/backbone configuration pair fits {n_devices} devices (encoder "
            f"candidates {sorted(map(str, encoder_profile))}, backbone "
            f"{sorted(map(str, backbone_profile))})")
    return best


def candidates(n_devices: int, encoder_devices: Iterable[int],
               backbone_model_degrees: Iterable[int] = (1,)) -> tuple[list, list]:
    """Candidate configs: encoder data-parallel on each count; backbone on the rest with each
    tensor degree that divides it."""
    enc, bb = [], []
    for e in encoder_devices:
        if not 1 <= e < n_devices:
            raise ValueError(f"encoder device count {e} not in [1, {n_devices - 1}]")
        enc.append(ParallelConfig(e, 1))
        rest = n_devices - e
        bb += [ParallelConfig(rest // m, m) for m in backbone_model_degrees if rest % m == 0]
    return enc, sorted(set(bb))


def measure_throughput(step: Callable[[], object], samples_per_call: int, *, repeats: int = 3,
                       warmup: int = 1) -> float:
    """samples/s of ``step`` (which must block until its result is ready), median of repeats."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    return samples_per_call / times[len(times) // 2]
