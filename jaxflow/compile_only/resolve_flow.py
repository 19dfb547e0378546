"""The layout rule for FlowTrain (flowtrain full: a ViT encoder and an LM backbone), on the
estimates of :mod:`jaxflow.compile_only.resolve` (see its module docstring for the rule): the
monolithic mesh (data N / M, model M) at the smallest M whose padded step fits, and the decoupled
splits' encoder counts and backbone width.
"""

from __future__ import annotations

import dataclasses

from jaxflow.compile_only.resolve import TRAIN_SLACK, HbmEstimate, ModelShape, _pow2, _raise, train_estimate
from pallas_kernels import targets


@dataclasses.dataclass(frozen=True)
class VlmStep:
    """The shapes of one FlowTrain step: ``samples`` (one per padded row of ``padded_len``
    tokens), ``packed_rows`` rows of ``packed_len`` tokens (the packed layout), ``patch_rows``
    encoder rows of ``patch_len`` patch slots."""

    samples: int
    padded_len: int
    packed_rows: int
    packed_len: int
    patch_rows: int
    patch_len: int


@dataclasses.dataclass(frozen=True)
class FlowLayout:
    """``monolithic_model`` (mesh data N / it x model it), the splits' ``encoder_counts`` and
    ``backbone_model``, ``estimates`` ({"monolithic", "encoder/E", "backbone/E"})."""

    monolithic_model: int
    encoder_counts: tuple[int, ...]
    backbone_model: int
    estimates: dict


def _sum(*parts: HbmEstimate) -> HbmEstimate:
    return HbmEstimate(params=sum(e.params for e in parts), capacity=parts[0].capacity,
                       optimizer=sum(e.optimizer for e in parts), slack=TRAIN_SLACK,
                       activations=sum(e.activations for e in parts))


def flow_layout(encoder: ModelShape, backbone: ModelShape, step: VlmStep, *,
                encoder_counts, chip: targets.Chip, n_devices: int) -> FlowLayout:
    """The FlowTrain layout (module docstring) of ``step`` for ``encoder`` (the ViT, vocab 0)
    and ``backbone`` on ``n_devices`` ``chip``s, the splits chosen from ``encoder_counts``;
    DoesNotFit naming the side that does not fit and the smallest candidate that fits."""
    found = _flow_layout(encoder, backbone, step, tuple(encoder_counts), chip, n_devices)
    if isinstance(found, FlowLayout):
        return found
    side, est = found
    return _raise(f"{step.samples} samples ({step.samples} padded rows of {step.padded_len} "
                  f"tokens, {step.packed_rows} packed rows of {step.packed_len}) do not fit the "
                  f"{side}", est, lambda c, n: isinstance(
                      _flow_layout(encoder, backbone, step, tuple(encoder_counts), c, n),
                      FlowLayout))


def _flow_layout(enc, bb, step, counts, chip, n) -> FlowLayout | tuple:
    cap = chip.hbm_bytes

    def mono(m):
        d = n // m
        return _sum(train_estimate(enc, -(-step.patch_rows // d), step.patch_len, shards=m,
                                   model_width=m, capacity=cap),
                    train_estimate(bb, -(-step.samples // d), step.padded_len, shards=m,
                                   model_width=m, capacity=cap))

    widths = [w for w in _pow2(n) if bb.n_kv_heads % w == 0 and enc.n_heads % w == 0]
    mono_est = {m: mono(m) for m in widths}
    m = next((w for w in widths if mono_est[w].fits), None)
    if m is None:
        return "monolithic padded step", mono_est[widths[-1]]
    enc_est = {e: train_estimate(enc, -(-step.patch_rows // e), step.patch_len, shards=1,
                                 model_width=1, capacity=cap) for e in counts if 1 <= e < n}
    last = ("encoder", next(iter(enc_est.values()), mono_est[m]))
    for mb in _pow2(bb.n_kv_heads):
        ests = {}
        for e in (e for e in enc_est if (n - e) % mb == 0):
            last = ("backbone", train_estimate(bb, -(-step.packed_rows // ((n - e) // mb)),
                                               step.packed_len, shards=mb, model_width=mb,
                                               capacity=cap))
            if not enc_est[e].fits:
                last = ("encoder", enc_est[e])
            elif last[1].fits:
                ests |= {f"encoder/{e}": enc_est[e], f"backbone/{e}": last[1]}
        if ests:
            kept = tuple(e for e in enc_est if f"encoder/{e}" in ests)
            return FlowLayout(m, kept, mb, {"monolithic": mono_est[m]} | ests)
    return last


#: f32 words of sparse optimizer state per table row ("per_row") or per element ("per_elem").
