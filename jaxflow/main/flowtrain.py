"""The ``flowtrain`` experiment: monolithic_padded vs monolithic_packed vs decoupled.

1. Allocator: profile encoder and backbone throughput on each candidate split of the devices,
   pick the throughput-matching one (``allocator.allocate``).
2. Train the three modes from the same initial parameters on the same samples, side by side:
   after ``warmup_rounds`` untimed rounds (compilation), each timed round runs every mode for
   ``block_steps`` steps (the order rotates per round); speedups are medians of per-round
   time ratios.
3. Held-out accuracy: teacher-forced exact match of the answer on samples built only from
   held-out digit images.

``compile_programs`` (``--compile-only``) lists every jitted program of a run on its meshes,
built by the run's own builders (:func:`make_sides`, the ``jaxflow.flow.steps`` makers,
:func:`make_eval_step`) with the shapes of step 0's samples.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxflow.compile_only.program import Program
from jaxflow.distributed import agree, connect_collectives, put, to_host
from jaxflow.experiment import RunContext
from jaxflow.flow.allocator import Allocation, ParallelConfig, allocate, candidates, measure_throughput
from jaxflow.flow.batching import encoder_patches, eval_layout, layout_rows, pooled_image_base
from jaxflow.flow.decoupled import BUFFER_GRANULARITY, DecoupledTrainer, put_replicated, put_rows
from jaxflow.flow.digits_data import heldout_samples, step_samples
from jaxflow.flow.monolithic import MonolithicTrainer
from jaxflow.flow.packing import CostModel
from jaxflow.flow.programs import monolithic_programs, split_programs, step_flops
from jaxflow.flow.steps import Sides, build_sides, make_backbone_step, make_encoder_fns, make_eval_step
from jaxflow.flow.vlm import bucket, resolve_backend
from jaxflow.mesh import MeshError, experiment_devices, make_mesh, process_role_meshes
from jaxflow.models.transformer import param_count
from jaxflow.train.state import TrainState

MODES = ("monolithic_padded", "monolithic_packed", "decoupled")


def _host_copy(state: TrainState) -> TrainState:
    """Numpy copy of a (possibly multi-process) device state, the same on every process."""
    return jax.tree.map(lambda x: np.array(to_host(x)), state)


def _split_meshes(encoder: int, backbone: int, model: int = 1, devices=None):
    """Disjoint sub-meshes: encoder data-parallel; backbone data x model (tensor) parallel.
    On a single device both sides share it (colocated).

    Across processes (:func:`jaxflow.mesh.process_role_meshes`) each process gives
    ``encoder / P`` of its devices to the encoder and ``backbone / P`` to the backbone, so both
    sub-meshes span every process alike: each process launches every program of both sides in
    the same order, the hand-offs (encoder output to the host, d loss / d embeddings back) are
    gathers on the side's own devices followed by host-to-device puts, and tensor-parallel
    groups stay within a process when ``model`` divides ``backbone / P``. (A side on one
    process's devices would need MPMD, programs launched by only some processes, and a
    cross-process activation transfer, which JAX's CPU and GPU runtimes do not do between
    different device sets.) One process: the first ``encoder`` devices, then ``backbone``.

    Raises:
      MeshError: across P processes, ``encoder`` or ``backbone`` is not a multiple of P.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) == 1:
        mesh = make_mesh({"data": 1}, devices)
        return {"encoder": mesh, "backbone": mesh}
    return process_role_meshes({"encoder": encoder, "backbone": backbone},
                               axes={"encoder": {"data": encoder},
                                     "backbone": {"data": backbone // model, "model": model}},
                               devices=devices)


def split_candidates(config, n_dev: int, processes: int = 1
                     ) -> tuple[list[ParallelConfig], list[ParallelConfig]]:
    """(encoder, backbone) allocator candidates on ``n_dev`` devices: the configured encoder
    counts that leave the backbone a device; on one device the single colocated pair. Across
    ``processes`` processes only the counts that both sides split evenly over them
    (:func:`_split_meshes`).

    Raises:
      MeshError: no configured encoder count fits ``n_dev`` devices (and ``processes``).
    """
    if n_dev == 1 and not config.flow.encoder_devices:
        return [ParallelConfig(1)], [ParallelConfig(1)]

    def even(e: int) -> bool:
        return e % processes == 0 and (n_dev - e) % processes == 0

    if config.flow.encoder_devices:
        e = config.flow.encoder_devices
        if not even(e):
            raise MeshError(f"flow.encoder_devices={e} across {processes} processes x "
                            f"{n_dev // processes} devices; valid: a multiple of {processes} "
                            f"in 1..{n_dev - 1}")
        return candidates(n_dev, [e], (1,))
    fit = [e for e in config.allocator.encoder_candidates if 1 <= e < n_dev and even(e)]
    if not fit:
        per = f" split evenly over {processes} processes" if processes > 1 else ""
        raise MeshError(f"allocator.encoder_candidates={config.allocator.encoder_candidates}: none "
                        f"leaves the backbone a device of {n_dev}{per}; valid: counts in "
                        f"1..{n_dev - 1}" + (f" that are multiples of {processes}" if per else ""))
    return candidates(n_dev, fit, config.allocator.backbone_model_degrees)


def resolve_meshes(config, devices=None) -> dict[str, Mesh]:
    """Every mesh the experiment builds on ``devices`` (default ``jax.devices()``; the first
    ``config.devices`` when set): ``monolithic`` (``config.mesh``) and, per allocator candidate
    split ``E+B`` (``B`` = data x model), ``encoder/E+B`` and ``backbone/E+B``."""
    have = experiment_devices(config.devices, devices)
    out = {"monolithic": config.mesh.make(have)}
    enc_c, bb_c = split_candidates(config, len(have))
    for e in enc_c:
        for b in bb_c:
            if len(have) > 1 and b.devices != len(have) - e.devices:
                continue
            meshes = _split_meshes(e.devices, b.devices, b.model, have)
            out[f"encoder/{e}+{b}"] = meshes["encoder"]
            out[f"backbone/{e}+{b}"] = meshes["backbone"]
    return out


def profile_sides(config, sides: Sides, enc_host: TrainState, bb_host: TrainState, samples: list,
                  cost: CostModel) -> tuple[float, float]:
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


def run_total_steps(config) -> int:
    """Optimizer steps of every mode in a run (the schedules' horizon)."""
    return (config.train.warmup_rounds + config.train.rounds) * config.train.block_steps


def make_sides(config, enc_mesh: Mesh, bb_mesh: Mesh, backend) -> Sides:
    """The run's :class:`Sides` on these meshes (monolithic: the same mesh twice)."""
    return build_sides(config.vit, config.model, enc_mesh, bb_mesh, config.optim,
                       run_total_steps(config), backend)


def heldout_accuracy(sides: Sides, enc_params, bb_params, samples: list, cost) -> float:
    """Fraction of held-out samples whose every answer token is the argmax (teacher forcing)."""
    mesh = sides.bb.mesh
    patches, lay = eval_layout(samples, sides.vit, mesh.shape["data"], cost)
    fn = make_eval_step(sides)
    # parameters via the host: they may live on another mesh (a decoupled sub-mesh)
    enc_params, bb_params = (jax.tree.map(to_host, p) for p in (enc_params, bb_params))
    correct = to_host(fn(put(enc_params, sides.enc.param_shardings),
                         put(bb_params, sides.bb.param_shardings),
                         put_rows(patches.arrays(), mesh), put_rows(lay.rows, mesh)))
    need = lay.rows["loss_mask"].sum(axis=1)
    got = correct.sum(axis=1)
    return float(np.mean(got[:len(samples)] == need[:len(samples)]))


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


def _persistent_compile_cache(run: RunContext) -> None:
    """Compiled programs are cached under runs/.jax_cache: a rerun (quick, then default)
    skips most of the compilation that dominates short runs on a loaded 2-core CPU."""
    path = run.out_dir.parent.parent / ".jax_cache"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def main(config, run: RunContext) -> dict[str, Any]:
    _persistent_compile_cache(run)
    tc = config.train
    devices = experiment_devices(config.devices)
    n_dev = len(devices)
    backend = resolve_backend(config.flow.attention)
    cost = CostModel.for_width(config.model.d_model, config.packing.encoder_cost_per_patch)
    total_steps = run_total_steps(config)
    steps = [(k, step_samples(config.data, seed=config.seed, step=k, batch_size=tc.batch_size))
             for k in range(total_steps)]
    full = config.mesh.make(devices)
    connect_collectives(full)  # across processes: before any long compile (see its doc)
    mono_sides = make_sides(config, full, full, backend)
    enc0, bb0 = mono_sides.init(jax.random.key(config.seed))
    enc_host, bb_host = _host_copy(enc0), _host_copy(bb0)
    n_enc, n_bb = param_count(enc_host.params), param_count(bb_host.params)
    run.info(f"encoder {n_enc:,} params, backbone {n_bb:,}; {n_dev} devices; attention "
             f"{backend.value}")

    # 1. Allocator.
    split_sides: dict[tuple[int, int, int], Sides] = {}

    def sides_for(e: int, b: int, model: int) -> Sides:
        if (e, b, model) not in split_sides:
            meshes = _split_meshes(e, b, model, devices)
            split_sides[(e, b, model)] = make_sides(config, meshes["encoder"],
                                                    meshes["backbone"], backend)
        return split_sides[(e, b, model)]

    profile_rows = []
    enc_c, bb_c = split_candidates(config, n_dev, jax.process_count())
    enc_prof, bb_prof = {}, {}
    for e in enc_c:
        for b in [b for b in bb_c if n_dev == 1 or b.devices == n_dev - e.devices]:
            sides = sides_for(e.devices, b.devices, b.model)
            te, tb = agreed(profile_sides(config, sides, enc_host, bb_host, steps[0][1], cost))
            enc_prof[e] = max(enc_prof.get(e, 0.0), te)
            bb_prof[b] = tb
            profile_rows.append({"encoder": str(e), "backbone": str(b),
                                 "encoder_samples_per_s": te, "backbone_samples_per_s": tb})
            run.info(f"profile encoder {e} {te:.1f} samples/s | backbone {b} {tb:.1f} samples/s")
    if n_dev == 1:  # colocated: nothing to choose
        (e, te), (b, tb) = next(iter(enc_prof.items())), next(iter(bb_prof.items()))
        alloc = Allocation(e, b, float(te), float(tb))
    else:
        alloc = allocate(enc_prof, bb_prof, n_dev)
    run.info(f"allocator: encoder {alloc.encoder}, backbone {alloc.backbone}, predicted "
             f"{alloc.predicted_samples_per_s:.1f} samples/s (pipelined), "
             f"{alloc.predicted_serial_samples_per_s:.1f} (serial)")
    dec_sides = sides_for(alloc.encoder.devices, alloc.backbone.devices, alloc.backbone.model)

    # 2. Side-by-side training.
    trainers = {
        "monolithic_padded": MonolithicTrainer(
            mono_sides, *mono_sides.place(enc_host, bb_host),
            layout="padded", packing=config.packing, cost=cost),
        "monolithic_packed": MonolithicTrainer(
            mono_sides, *mono_sides.place(enc_host, bb_host),
            layout="packed", packing=config.packing, cost=cost),
        "decoupled": DecoupledTrainer(
            dec_sides, *dec_sides.place(enc_host, bb_host),
            packing=config.packing, cost=cost, run_ahead=config.flow.run_ahead,
            pool_capacity=config.flow.pool_capacity),
    }
    for mode, tr in trainers.items():
        t0 = time.perf_counter()
        n_shapes = tr.warm(steps)
        run.info(f"{mode}: compiled {n_shapes} shape bucket(s) in {time.perf_counter() - t0:.0f}s")
    times = {m: [] for m in MODES}
    results = {m: [] for m in MODES}
    run.set_total_steps(total_steps, "flowtrain")
    for r in range(tc.warmup_rounds + tc.rounds):
        block = steps[r * tc.block_steps:(r + 1) * tc.block_steps]
        order = MODES[r % 3:] + MODES[:r % 3]
        for mode in order:
            t0 = time.perf_counter()
            out = trainers[mode].run(block)
            jax.block_until_ready(out[-1]["metrics"]["loss"])
            if r >= tc.warmup_rounds:
                times[mode].append(time.perf_counter() - t0)
            results[mode] += out
        for step, _ in block:
            row = {}
            for mode in MODES:
                res = results[mode][step]
                row[f"loss_{mode}"] = float(res["metrics"]["loss"])
                row[f"padding_waste_{mode}"] = res["layout"].padding_waste
                if res["layout"].packing is not None:
                    row[f"cost_imbalance_{mode}"] = res["layout"].packing.imbalance
            row["staleness"] = results["decoupled"][step]["staleness"]
            run.log(step + 1, row)

    # 3. Summary.
    per_sample = tc.block_steps * tc.batch_size
    t = {m: np.asarray(times[m]) for m in MODES}
    ratios = {m: t["monolithic_padded"] / t[m] for m in MODES}
    timed = [s for k, s in steps[tc.warmup_rounds * tc.block_steps:]]
    flops = float(np.mean([sum(step_flops(mono_sides, s)) for s in timed]))  # no padding
    peak = measured_peak_flops()
    samples_per_s = {m: per_sample / float(np.median(t[m])) for m in MODES}
    held = heldout_samples(config.data, seed=config.seed, n=tc.eval_examples)
    accuracy = {}
    for mode, tr in trainers.items():
        accuracy[mode] = heldout_accuracy(mono_sides, tr.enc_state.params, tr.bb_state.params,
                                          held, cost)

    def mean_of(mode, fn):
        return float(np.mean([fn(res) for res in results[mode]]))

    waste = {m: mean_of(m, lambda r: r["layout"].padding_waste) for m in MODES}
    imbalance = {m: mean_of(m, lambda r: r["layout"].packing.imbalance) for m in MODES[1:]}
    stale = [r["staleness"] for r in results["decoupled"]]
    dec = trainers["decoupled"]
    summary = {
        "speedup_vs_monolithic_padded": {m: float(np.median(ratios[m])) for m in MODES},
        "speedup_spread": {m: [float(ratios[m].min()), float(ratios[m].max())] for m in MODES},
        "samples_per_s": samples_per_s,
        "cost_imbalance": imbalance["decoupled"],
        "cost_imbalance_by_mode": imbalance,
        "padding_waste": waste["decoupled"],
        "padding_waste_by_mode": waste,
        "allocator": {
            "encoder_devices": alloc.encoder.devices,
            "backbone_devices": alloc.backbone.devices,
            "backbone_model_degree": alloc.backbone.model,
            "colocated": n_dev == 1,
            "predicted_samples_per_s": alloc.predicted_samples_per_s,
            "predicted_serial_samples_per_s": alloc.predicted_serial_samples_per_s,
            "measured_samples_per_s": samples_per_s["decoupled"],
            "profile": profile_rows,
        },
        "estimated_mfu": {m: flops / tc.batch_size * samples_per_s[m] / peak for m in MODES},
        "peak_flops_measured": peak,
        "model_flops_per_step": flops,
        "final_loss": {m: float(np.mean([float(r["metrics"]["loss"])
                                         for r in results[m][-max(1, len(results[m]) // 5):]]))
                       for m in MODES},
        "heldout_accuracy": accuracy,
        "staleness": {"run_ahead": config.flow.run_ahead, "mean": float(np.mean(stale)),
                      "max": int(max(stale))},
        "decoupled_timers_s": dict(dec.timers),
        "pool": dec.pool.stats(),
        "steps": total_steps,
        "batch_size": tc.batch_size,
        "encoder_params": n_enc,
        "backbone_params": n_bb,
        "attention_backend": backend.value,
    }
    run.info(f"samples/s {({m: round(v, 2) for m, v in samples_per_s.items()})}; "
             f"speedup {summary['speedup_vs_monolithic_padded']}")
    return summary


# -- compile-only ------------------------------------------------------------------------


def compile_programs(config, meshes: dict[str, Mesh]) -> list[Program]:
    """Every jitted program of a run on ``meshes`` (what :func:`resolve_meshes` builds), built
    by the run's own builders with abstract arguments in the run's shardings and the shapes of
    step 0's samples (held-out samples for eval): on the monolithic mesh
    :func:`jaxflow.flow.programs.monolithic_programs`, per candidate split ``E+B``
    :func:`jaxflow.flow.programs.split_programs`."""
    mono = meshes["monolithic"]
    with jax.set_mesh(mono):  # the target's platform decides which names are valid
        backend = resolve_backend(config.flow.attention)
    cost = CostModel.for_width(config.model.d_model, config.packing.encoder_cost_per_patch)
    samples = step_samples(config.data, seed=config.seed, step=0,
                           batch_size=config.train.batch_size)
    held = heldout_samples(config.data, seed=config.seed, n=config.train.eval_examples)
    programs = monolithic_programs(make_sides(config, mono, mono, backend), samples, held,
                                   config.packing, cost)
    for name in [k for k in meshes if k.startswith("encoder/")]:
        split = name[len("encoder/"):]
        sides = make_sides(config, meshes[name], meshes[f"backbone/{split}"], backend)
        programs += split_programs(sides, split, samples, config.packing, cost)
    return programs
