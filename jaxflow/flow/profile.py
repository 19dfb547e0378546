"""FlowTrain's allocator run: profile the encoder and the backbone on each candidate split of
the devices and pick the throughput-matching one (:func:`jaxflow.flow.allocator.allocate`);
plus the f32 matmul peak the MFU estimate divides by.

  profile_sides        (encoder, backbone) samples/s of one step's samples on one split
  agreed               process 0's figures on every process (one split everywhere)
  choose_split         profile every candidate, allocate, and name the chosen split's meshes
  measured_peak_flops  f32 matmul flop/s of one device
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflow.distributed import agree, to_host
from jaxflow.flow.allocator import Allocation, allocate, measure_throughput
from jaxflow.flow.batching import encoder_patches, layout_rows, pooled_image_base
from jaxflow.flow.decoupled import BUFFER_GRANULARITY, put_replicated, put_rows
from jaxflow.flow.digits_data import Sample
from jaxflow.flow.meshes import candidate_splits, split_meshes
from jaxflow.flow.packing import CostModel
from jaxflow.flow.steps import Sides, make_backbone_step, make_encoder_fns
from jaxflow.flow.system import cost_model, make_sides
from jaxflow.flow.vlm import AttentionBackend, bucket
from jaxflow.train.state import TrainState


def profile_sides(config, sides: Sides, enc_host: TrainState, bb_host: TrainState,
                  samples: Sequence[Sample], cost: CostModel) -> tuple[float, float]:
    """(encoder samples/s, backbone samples/s) of one step's samples on these sub-meshes."""
    encode, update = make_encoder_fns(sides)
    bb_step = make_backbone_step(sides)
    enc_rows = sides.enc.mesh.shape["data"]
    bb_rows = sides.bb.mesh.shape["data"]
    patches = encoder_patches(samples, sides.vit, enc_rows)
    enc_in = put_rows(patches.arrays(), sides.enc.mesh)
    placed = sides.place(enc_host, bb_host)
    state = {"enc": placed[0], "bb": placed[1]}

    def enc_step():
        flat, vjp_fn = encode(state["enc"].params, enc_in)
        to_host(flat)  # the decoupled hand-off: on every process
        state["enc"], norm = update(state["enc"], vjp_fn, jnp.zeros_like(flat))
        jax.block_until_ready(norm)

    base, offsets = pooled_image_base(samples)
    layout = layout_rows(samples, "packed", base, packing=config.packing, cost=cost,
                         row_multiple=bb_rows)
    n_buf = bucket(max(int(offsets[-1]), 1), BUFFER_GRANULARITY)
    buf = put_replicated(np.zeros((n_buf, sides.lm.d_model), np.float32), sides.bb.mesh)
    rows = put_rows(layout.rows, sides.bb.mesh)
    denom = put_replicated(np.float32(1.0), sides.bb.mesh)

    def bb_step_once():
        state["bb"], d_buf, _ = bb_step(state["bb"], buf, rows, denom)
        to_host(d_buf)

    r = config.allocator.profile_repeats
    n = len(samples)
    return measure_throughput(enc_step, n, repeats=r), measure_throughput(bb_step_once, n, repeats=r)


def agreed(values: tuple[float, ...]) -> tuple[float, ...]:
    """Process 0's ``values`` on every process (each process times its own profile; the
    allocator must pick one split everywhere, or the processes would launch different
    programs): :func:`jaxflow.distributed.agree`."""
    return tuple(agree("flowtrain_profile", float(v)) for v in values)


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """The allocator's outcome: ``allocation``; ``split`` its ``"E+B"`` name; ``meshes`` the
    ``encoder/E+B`` / ``backbone/E+B`` sub-meshes of every profiled and the chosen split
    (the allocator may use fewer devices than a profiled pair); ``profile`` one row per
    profiled pair (``encoder``, ``backbone``, ``encoder_samples_per_s``,
    ``backbone_samples_per_s``)."""

    allocation: Allocation
    split: str
    meshes: dict[str, Mesh]
    profile: list[dict]


def choose_split(config, devices: Sequence, enc_host: TrainState, bb_host: TrainState,
                 samples: Sequence[Sample], backend: AttentionBackend,
                 info: Callable[[str], None] = lambda _: None) -> SplitChoice:
    """Profiles every candidate split of ``devices`` (:func:`profile_sides` on ``samples``,
    :func:`agreed` across processes) and allocates: on one device the colocated pair, else
    :func:`jaxflow.flow.allocator.allocate`. ``info`` receives one line per profile."""
    n_dev = len(devices)
    cost = cost_model(config)
    rows, meshes = [], {}
    enc_prof: dict = {}
    bb_prof: dict = {}
    for e, b in candidate_splits(config, n_dev, jax.process_count()):
        split = split_meshes(e.devices, b.devices, b.model, devices)
        meshes[f"encoder/{e}+{b}"], meshes[f"backbone/{e}+{b}"] = split["encoder"], split["backbone"]
        sides = make_sides(config, split["encoder"], split["backbone"], backend)
        te, tb = agreed(profile_sides(config, sides, enc_host, bb_host, samples, cost))
        enc_prof[e] = max(enc_prof.get(e, 0.0), te)
        bb_prof[b] = tb
        rows.append({"encoder": str(e), "backbone": str(b),
                     "encoder_samples_per_s": te, "backbone_samples_per_s": tb})
        info(f"profile encoder {e} {te:.1f} samples/s | backbone {b} {tb:.1f} samples/s")
    if n_dev == 1:  # colocated: nothing to choose
        (e, te), (b, tb) = next(iter(enc_prof.items())), next(iter(bb_prof.items()))
        alloc = Allocation(e, b, float(te), float(tb))
    else:
        alloc = allocate(enc_prof, bb_prof, n_dev)
    # the allocator may pair an encoder with a backbone profiled beside another encoder
    name = f"{alloc.encoder}+{alloc.backbone}"
    chosen = split_meshes(alloc.encoder.devices, alloc.backbone.devices, alloc.backbone.model,
                          devices)
    meshes[f"encoder/{name}"], meshes[f"backbone/{name}"] = chosen["encoder"], chosen["backbone"]
    return SplitChoice(alloc, name, meshes, rows)


def measured_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """f32 matmul flop/s this process achieves on one device (the MFU denominator)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(times))
