"""The ``nestpipe`` experiment: every pipeline for K steps from the same host tables and DLRM,
data-parallel on a mesh of the devices present (or the first ``config.devices``) with the
tables split row-wise over the same shards (keys routed and rows returned by All2All;
``sharded.py``).

``fwp`` / ``dbp+fwp`` are the paper's frozen-window pipelining (per micro-batch routing,
clustering and All2All: ``per_micro_batch``) on every platform; ``sync_accum`` is the whole window
routed and exchanged once (sync's collectives, the backward in N micro-batches: sync plus
gradient accumulation, not FWP), timed beside it.

Exactness: params and tables after K steps vs ``sync`` (max relative difference = max |x - x_sync|
/ max |x_sync| over all dense params and tables together), and for the windowed pipelines the
one-step difference from sync's own state at each of the first ``step_check_steps`` steps (the
per-step reorder error). Speed (``jaxflow.timing``): ``pairs`` rounds, each running every
pipeline once for ``timing_steps`` steps from fresh copies, in a seeded random order per round,
after a warm-up; per pipeline the median of the paired ratios sync / pipeline; repeated
``runs`` times (each with its own warm-up) and reported as the median over runs with every
run's figure (``speedup_runs``) and every pair (``speedup_pairs``). ``auto``: a short probe
(``probe_rounds`` rounds of ``probe_steps`` steps of each exact pipeline, random order) picks
the fastest, and auto's figures are the chosen pipeline's in the same rounds
(``auto_speedup_vs_sync``; the probe ran before them); the rounds also time sync a second time
(``sync_repeat``: the baseline's own run-to-run interval). Per-stage times (``stage_seconds``:
data, h2d, route, retrieve, exchange, compute, write_back, patch; mean seconds per step,
medians over rounds). Ideal bound: sum of the five stage times of ``sync`` (stage 5 =
exchange + compute + write_back) / the slowest. Clustering: rows moved by per-device,
per-micro-batch dedup with the pipeline's own ``cluster_order`` (inside each device's shard),
clustered vs not.

Across processes (``--coordinator`` / ``--num-processes``: the mesh spans every process's
devices): every process builds the same host tables and runs the same pipelines; each reads,
places and writes back only its own devices' owner buffers, the tables are merged after every
run (``HostShards.merge``), the host threads' key routing launches at a fixed point of each
step (``pipelines.LaunchOrder``), and on the CPU the dense sums are ordered
(``device_stages.all_reduce_sum``): every figure but the timings equals the single-process
run's with the same global mesh, bit for bit (``tests/test_multiprocess_nestpipe.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow import signals
from jaxflow.compile_only.program import Program
from jaxflow.distributed import connect_collectives
from jaxflow.embeddings import TableSpec, make_sparse_optimizer
from jaxflow.embeddings.host import HostTable
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.main.dlrm_train import dense_model_flops
from jaxflow.mesh import experiment_devices, require_divisible
from jaxflow.nestpipe.clustering import CLUSTER_METHODS, shard_micro_batch_transfers
from jaxflow.nestpipe.pipelines import PIPELINES, STAGES, Parts, run_pipeline
from jaxflow.nestpipe.sharded import AXIS, MeshStages
from jaxflow.nestpipe.simulate import write_calibration_from_run
from jaxflow.nestpipe.stages import clone_tables, cluster_order
from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import build_model, functional
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo
from jaxflow.timing import auto_summary as summarize_auto
from jaxflow.timing import median_of_runs, repeated_runs
from jaxflow.train.state import TrainState

#: the pipelines ``auto`` chooses from: the exact ones (semi_sync is one step stale)
AUTO_CANDIDATES = ("sync", "sparse_dist", "dbp", "fwp", "dbp+fwp", "sync_accum")
#: the pipelines with a window of ``micro_batches`` (per-step error checked against sync)
WINDOWED = tuple(p for p, (_, window) in PIPELINES.items() if window)


def resolve_meshes(config, devices=None) -> dict[str, Mesh]:
    """``{"data": mesh}``: a 1-D mesh (axis ``"data"``) over every device present, or the first
    ``config.devices``; the batch must split into ``micro_batches`` per device.

    Raises:
      MeshError: too few devices, or ``batch_size`` not divisible by devices x micro_batches.
    """
    have = experiment_devices(config.devices, devices)
    require_divisible("batch_size", config.batch_size, len(have), config.micro_batches,
                      "micro_batches")
    return {"data": Mesh(np.array(have), (AXIS,))}


def capacities(config, n_devices: int) -> dict[str, int]:
    """The routing capacities for ``n_devices``: the config's when they were measured on that
    count (``capacity_devices``), else 0 each (worst-case sizes; cannot overflow)."""
    names = ("capacity", "bucket_capacity", "micro_bucket_capacity", "owner_capacity")
    if n_devices == config.capacity_devices:
        return {k: getattr(config, k) for k in names}
    return dict.fromkeys(names, 0)


@functools.cache
def dense_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The dense model's Adam, one object per rate: a ``TrainState`` keeps its ``tx`` as static
    pytree metadata, so the dense states of two ``build`` calls with the same rate (e.g. the
    8-device and the 1-device mesh) have one tree structure (one state can be put into the
    other's shardings)."""
    return optax.adam(learning_rate)


def table_specs(config) -> list[TableSpec]:
    """The host tables' specs: ``c0 ..`` (the generator's feature names), ``vocab_sizes`` rows
    of ``embed_dim``, row-wise, sum-pooled."""
    return [TableSpec(f"c{i}", v, config.embed_dim, "row_wise", "sum")
            for i, v in enumerate(config.vocab_sizes)]


def sparse_optimizer(config):
    """The tables' row-wise Adagrad at ``sparse_lr``."""
    return make_sparse_optimizer("rowwise_adagrad", config.sparse_lr)


def dense_model(config, num_dense: int, *, abstract: bool = False):
    """(params, apply) of the DLRM (``recsys.models.functional``); ``abstract``: the params as
    ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``, nothing allocated)."""
    def make():
        return build_model("dlrm", num_dense, len(config.vocab_sizes), config.embed_dim,
                           seed=config.seed, bottom=config.bottom, top=config.top)

    return functional(nnx.eval_shape(make) if abstract else make())


def stage_key(config, pipeline: str) -> tuple[int, str]:
    """(micro-batches, frozen_exchange) of the stage programs ``pipeline`` runs: 1 and the
    config's schedule without a window, N and ``window`` for the whole window (sync_accum),
    N and the config's schedule for the frozen window (fwp / dbp+fwp)."""
    _, window = PIPELINES[pipeline]
    # "whole" (sync_accum) routes the window at once: the batch-level capacities, and
    # clustering (which only shrinks per-micro-batch dedup) would change nothing
    return (config.micro_batches if window else 1,
            "window" if window == "whole" else config.frozen_exchange)


def make_stages(config, specs, mesh: Mesh, optimizer, apply, pipeline: str) -> MeshStages:
    """The ``MeshStages`` of ``pipeline`` (:func:`stage_key`) on ``mesh``, with the capacities
    of :func:`capacities` (per micro-batch buckets for the frozen window)."""
    n, exchange = stage_key(config, pipeline)
    per_micro_batch = PIPELINES[pipeline][1] == "frozen"
    caps = capacities(config, mesh.devices.size)
    return MeshStages(specs, mesh, optimizer, apply, batch_size=config.batch_size,
                      multi_hot=config.multi_hot, micro_batches=n, capacity=caps["capacity"],
                      bucket_capacity=(caps["micro_bucket_capacity"] if per_micro_batch
                                       else caps["bucket_capacity"]),
                      owner_capacity=caps["owner_capacity"], frozen_exchange=exchange,
                      pooling_backend=config.pooling_backend)


def build(config):
    """(generator, specs, host tables, initial dense ``TrainState`` (replicated; its ``tx`` the
    dense Adam), apply, parts factory)."""
    gen = SyntheticCriteo(SyntheticConfig(vocab_sizes=tuple(config.vocab_sizes),
                                          multi_hot=config.multi_hot, zipf_a=config.zipf_a,
                                          drift_period=config.drift_period), seed=config.seed)
    specs = table_specs(config)
    opt = sparse_optimizer(config)
    rng = np.random.default_rng([config.seed, 11])
    tables = {s.name: HostTable(s, opt, (0.05 * rng.standard_normal((s.vocab_size, s.dim)))
                                .astype(np.float32)) for s in specs}
    params, apply = dense_model(config, gen.config.num_dense)
    tx = dense_optimizer(config.dense_lr)
    mesh = resolve_meshes(config)["data"]
    connect_collectives(mesh)  # across processes: gloo's groups meet before any long compile
    replicated = NamedSharding(mesh, PartitionSpec())
    dense = TrainState.create(tx, params, jax.tree.map(lambda _: replicated, params))
    programs = {}  # (micro-batches, frozen_exchange) -> MeshStages

    def parts_for(pipeline: str, tables) -> Parts:
        key = stage_key(config, pipeline)
        if key not in programs:
            programs[key] = make_stages(config, specs, mesh, opt, apply, pipeline)
        return Parts(gen, specs, tables, programs[key], config.batch_size,
                     cluster=PIPELINES[pipeline][1] == "frozen" and config.cluster,
                     cluster_method=config.cluster_method)

    parts_for.programs = programs
    return gen, specs, tables, dense, apply, parts_for


def compile_programs(config, meshes) -> list[Program]:
    """Every device program the pipelines of ``config.pipelines`` run, with abstract arguments
    on ``meshes["data"]``: for each distinct (micro-batches, frozen_exchange) of
    :func:`stage_key`, the ``MeshStages`` the run builds (:func:`make_stages`) and its
    ``abstract_calls``: ``route`` (dedup, All2All of keys, owner dedup), ``exchange`` +
    ``compute`` (one routed unit) or ``frozen`` (the frozen window: row All2Alls inside),
    and ``patch`` where a dbp schedule uses it. Named ``N{n}-{exchange}/{stage}``. The host
    tables are not part of any program (stage 4 is host threads); the dense state is an
    abstract replicated ``TrainState``. Nothing is allocated."""
    mesh = meshes["data"]
    specs, opt = table_specs(config), sparse_optimizer(config)
    num_dense = SyntheticConfig(vocab_sizes=tuple(config.vocab_sizes)).num_dense
    params, apply = dense_model(config, num_dense, abstract=True)
    replicated = NamedSharding(mesh, PartitionSpec())
    dense = TrainState.abstract(dense_optimizer(config.dense_lr), params,
                                jax.tree.map(lambda _: replicated, params))
    users: dict[tuple[int, str], list[str]] = {}
    stages = {}
    for p in ("sync",) + tuple(p for p in config.pipelines if p != "sync"):
        key = stage_key(config, p)
        if key not in stages:
            stages[key] = make_stages(config, specs, mesh, opt, apply, p)
        users.setdefault(key, []).append(p)
    b = config.batch_size
    flops = dense_model_flops("dlrm", params, b, len(specs), config.embed_dim, train=True)
    out = []
    for key, st in stages.items():
        calls = st.abstract_calls(dense, multi_hot=config.multi_hot, num_dense=num_dense)
        if not any(PIPELINES[p][0] == "dbp" for p in users[key]):
            del calls["patch"]
        note = (f"{', '.join(users[key])}: {len(specs)} host tables row-wise over "
                f"data={st.num_shards} ({sum(s.vocab_size for s in specs):,} rows), owner "
                f"buffers of {st.owner_capacity} rows split over data; batch {b} split over "
                f"data ({key[0]} micro-batch(es), {key[1]}); capacity {st.capacity}, per owner "
                f"{st.bucket_capacity}; DLRM replicated; pooling {config.pooling_backend}")
        for stage, (fn, args) in calls.items():
            train = stage in ("compute", "frozen")
            out.append(Program(f"N{key[0]}-{key[1]}/{stage}", fn, args, mesh,
                               kind="train" if train else "embedding",
                               model_flops=flops if train else None, tokens=b, note=note))
    return out


def programs_of(parts_for) -> dict:
    """The compiled MeshStages built so far, by (micro-batch count, frozen_exchange)."""
    return parts_for.programs


def max_relative_diff(a, b) -> float:
    """max |a - b| / max |b| over all leaves together (dense params and tables).

    One scale for the whole model: a leaf whose own values are ~0 (e.g. a bias after one Adam
    step on a ~1e-11 gradient, where the update is g / (|g| + eps)) would otherwise turn a
    harmless absolute error into a large relative one; ``max_leafwise_diff`` reports that view.
    """
    diff = scale = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diff, scale = max(diff, float(np.max(np.abs(x - y)))), max(scale, float(np.max(np.abs(y))))
    return diff / max(scale, 1e-30)


def max_leafwise_diff(a, b) -> float:
    """max over leaves of max |a - b| / max |b| of that leaf."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return out


def snapshot(dense: TrainState, tables) -> dict:
    """Host copies of the dense params and every table (values, optimizer state)."""
    return {"params": jax.device_get(dense.params),
            "tables": {n: t.to_numpy() for n, t in tables.items()}}


def train(config, pipeline: str, tables0, dense0, parts_for, steps: int):
    tables = clone_tables(tables0)
    parts = parts_for(pipeline, tables)
    dense, stats = run_pipeline(PIPELINES[pipeline][0], parts, dense0, steps)
    return dense, tables, stats


def one_step_diffs(pipeline: str, tables0, dense0, parts_for, steps: int) -> list[float]:
    """Per step t: ``pipeline``'s step t and ``sync``'s step t, both from sync's state before
    t; the max relative difference of the results. This is the per-step error of a reordered
    sum; the K-step trajectory difference also contains its amplification by training."""
    tables, dense, out = clone_tables(tables0), dense0, []
    schedule = PIPELINES[pipeline][0]
    for t in range(steps):
        branch = clone_tables(tables)
        d_p, _ = run_pipeline(schedule, parts_for(pipeline, branch), dense, 1, start=t)
        dense, _ = run_pipeline("sync", parts_for("sync", tables), dense, 1, start=t)
        out.append(max_relative_diff(snapshot(d_p, branch), snapshot(dense, tables)))
    return out


def evaluate(config, gen, apply, dense, tables, specs) -> dict:
    labels, probs = [], []
    for i in range(config.eval_batches):
        b = gen.eval_batch(i, config.batch_size)
        emb = []
        for s in specs:
            ids = np.where(b["sparse"][s.name] >= 0, b["sparse"][s.name], 0)
            uniq, inv = np.unique(ids, return_inverse=True)
            vals = tables[s.name].read_rows(uniq)[0][inv.reshape(ids.shape)]
            emb.append((vals * (b["sparse"][s.name] >= 0)[..., None]).sum(1))
        logits = apply(dense.params, jnp.asarray(b["dense"]), jnp.asarray(np.stack(emb, 1)))
        probs.append(np.asarray(jax.nn.sigmoid(logits)))
        labels.append(b["label"])
    y, p = np.concatenate(labels), np.concatenate(probs)
    return {"auc": roc_auc(y, p), "logloss": log_loss(y, p)}


def main(config, run: RunContext) -> dict:
    """Runs every pipeline (exactness, timing, clustering); the summary. Nothing is
    checkpointed: a stop signal ends the run between two pipeline steps (``signals.polling``),
    so no compilation is left running when the process exits."""
    with signals.polling():
        return _main(config, run)


def _main(config, run: RunContext) -> dict:
    gen, specs, tables0, dense0, apply, parts_for = build(config)
    n_dev = len(resolve_meshes(config)["data"].devices.flat)
    if capacities(config, n_dev)["capacity"] != config.capacity:
        run.info(f"{n_dev} devices: the capacities measured on {config.capacity_devices} do not "
                 "apply; using the worst-case sizes (cannot overflow)")
    pipelines = ("sync",) + tuple(p for p in config.pipelines if p != "sync")
    # 1. exactness and quality: K steps each from the same start
    # ``sync`` first; every other pipeline is compared as soon as it finishes (one snapshot of
    # the tables held at a time besides sync's)
    sync_final, results, diff, leafwise = None, {}, {}, {}
    for p in pipelines:
        dense, tables, stats = train(config, p, tables0, dense0, parts_for, config.steps)
        final = snapshot(dense, tables)
        sync_final = final if p == "sync" else sync_final
        diff[p], leafwise[p] = max_relative_diff(final, sync_final), max_leafwise_diff(final, sync_final)
        results[p] = {"final_train_loss": float(np.mean(stats["losses"][-10:])),
                      **evaluate(config, gen, apply, dense, tables, specs)}
        del final, tables
        run.info(f"{p}: {config.steps} steps, loss {results[p]['final_train_loss']:.4f}, "
                 f"AUC {results[p]['auc']:.4f}")
    check = min(config.steps, config.step_check_steps)
    step_diff = {p: max(one_step_diffs(p, tables0, dense0, parts_for, check))
                 for p in pipelines if p in WINDOWED}
    # 2. timing (jaxflow.timing): each round runs every pipeline (and sync a second time) once
    # from fresh table copies in a seeded random order; paired ratios sync / pipeline per round.
    # ``runs`` repetitions, each with its own warm-up and auto probe.
    timing = {p: [] for p in pipelines}

    def timed(p, steps, keep=True):
        def call():
            s = train(config, p, tables0, dense0, parts_for, steps)[2]
            if keep:
                timing[p].append(s)
            return s["step_seconds"]  # excludes copying the tables
        return call

    candidates = [p for p in AUTO_CANDIDATES if p in pipelines]

    def warm():
        for p in pipelines:
            train(config, p, tables0, dense0, parts_for, config.warmup)  # compile + warm caches

    def log(r, result, auto):
        run.info(f"timing run {r}: " + ", ".join(f"{m} {x:.3f}" for m, x in
                                                 result["speedup"].items())
                 + (f" (auto -> {auto['mode']})" if auto else ""))

    runs, autos = repeated_runs(timed, pipelines, runs=config.runs, steps=config.timing_steps,
                                rounds=config.pairs, baseline="sync", seed=config.seed, warm=warm,
                                candidates=candidates if config.auto else (),
                                probe_steps=config.probe_steps, probe_rounds=config.probe_rounds,
                                log=log)
    def med(xs):
        return float(np.median(xs))

    per_run = median_of_runs([t["speedup"] for t in runs])
    all_pairs = {m: [x for t in runs for x in t["ratios"][m]] for m in per_run}
    stage = {p: {k: med([s["stage_seconds"].get(k, 0.0) for s in timing[p]])
                 for k in STAGES + ("patch",)} for p in pipelines}
    sync_stages = [stage["sync"][k] for k in STAGES]
    # the five stages; stage 5 = row All2All back + compute (+ grad All2All) + write back
    five = sync_stages[:4] + [sum(sync_stages[4:])]
    ideal = sum(five) / max(five)
    auto_summary = summarize_auto(per_run, autos, candidates) if autos else {}
    # 3. clustering as the pipeline does it: each device's shard reordered by the pipeline's
    # own cluster_order, rows moved = distinct keys per device per micro-batch
    plain, clustered = 0, {m: 0 for m in CLUSTER_METHODS}
    for t in range(min(config.steps, 20)):
        sp = gen.batch(t, config.batch_size)["sparse"]
        plain += shard_micro_batch_transfers(sp, n_dev, config.micro_batches)
        for m in CLUSTER_METHODS:
            order = cluster_order(sp, n_dev, config.micro_batches, m)
            clustered[m] += shard_micro_batch_transfers(sp, n_dev,
                                                        config.micro_batches, order)
    summary = {
        # median over runs of each run's paired median; every run's figure and every pair kept
        "speedup_vs_sync": {p: per_run[p]["median"] for p in pipelines},
        "speedup_runs": {p: per_run[p]["runs"] for p in pipelines},
        "speedup_spread": {p: [min(all_pairs[p]), max(all_pairs[p])] for p in pipelines
                           if p != "sync"},
        "speedup_pairs": {m: [t["ratios"][m] for t in runs] for m in per_run if m != "sync"},
        "timing_order": [t["order"] for t in runs],
        "runs": config.runs, "pairs": config.pairs,
        **auto_summary,
        "ideal_speedup": {p: (1.0 if p == "sync" else ideal) for p in pipelines},
        "max_param_diff_vs_sync": diff,
        "max_leafwise_diff_vs_sync": leafwise,
        "max_one_step_diff_vs_sync": step_diff,
        "step_seconds": {p: med([s["step_seconds"] for s in timing[p]]) for p in pipelines},
        "exposed_host_seconds": {p: med([s["exposed_seconds"] for s in timing[p]]) for p in pipelines},
        "stage_seconds": stage,
        "sync_step_vs_sum_of_stages": med([s["step_seconds"] for s in timing["sync"]]) / sum(sync_stages),
        "patched_rows_per_step": {p: med([s["patched_rows"] for s in timing[p]]) for p in pipelines},
        "owner_rows_per_step": {p: [med([s["owner_rows"][q] for s in timing[p]])
                                    for q in range(n_dev)] for p in pipelines},
        "capacities": {(f"micro_batches={k}" + (f", {x}" if k > 1 else "")):
                       {"device": m.capacity, "bucket": m.bucket_capacity, "owner": m.owner_capacity}
                       for (k, x), m in programs_of(parts_for).items()},
        "devices": n_dev,
        # each windowed pipeline's All2All schedule (sharded.FROZEN_EXCHANGES): fwp / dbp+fwp
        # the paper's per_micro_batch (unless configured batched), sync_accum window
        "frozen_exchange": {p: parts_for(p, None).stages.frozen_exchange for p in pipelines
                            if p in WINDOWED},
        "duplicate_transfer_reduction": 1.0 - clustered[config.cluster_method] / plain,
        "duplicate_transfer_reduction_by_method": {m: 1.0 - c / plain for m, c in clustered.items()},
        "micro_batch_rows_moved": {"unclustered": plain, **clustered},
        **{f"{k}_by_pipeline": {p: results[p][k] for p in pipelines} for k in
           ("auc", "logloss", "final_train_loss")},
        "steps": config.steps, "micro_batches": config.micro_batches,
    }
    for p in pipelines:
        run.info(f"{p}: speedup {summary['speedup_vs_sync'][p]:.3f} (ideal {ideal:.2f}), "
                 f"max rel diff {diff[p]:.2e}, step {summary['step_seconds'][p] * 1e3:.1f} ms")
    if config.calibration_out and run.is_primary:
        summary["calibration_written"] = write_calibration_from_run(
            config.calibration_out, summary | {"config": to_jsonable(config)},
            experiment=run.name, variant=run.variant, devices=n_dev)
        run.info(f"wrote calibration {summary['calibration_written']}")
    return summary
