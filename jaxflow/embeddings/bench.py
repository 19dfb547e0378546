"""The ``bench_embedding`` measurement: sharded lookup + sparse update vs ``jnp.take`` baselines
(dense gradient and optimizer; sparse: gathered-row gradient + segment_sum + touched rows only).

A (jaxflow): ``make_train_step`` on ``ShardedEmbeddings`` (row-wise tables over every device,
dedup + All2All ids + gather + All2All rows + sum pooling, then row grads All2All to the owners
and row-wise Adagrad on the touched rows).
B (dense baseline, the naive JAX program): the same tables row-sharded with ``NamedSharding``,
``jnp.take`` + the same pooling under ``jit`` (XLA SPMD partitions the gather), ``jax.grad`` to a
dense [V, D] gradient per table and dense row-wise Adagrad on the full table.
C (sparse baseline, what a competent JAX user writes without this layer): the same sharded
tables, ``jnp.take`` of the batch's ids, the gradient of the gathered rows only,
``segment_sum`` of it over the batch's unique ids (fixed size: ``jnp.unique(size=B x bag)``,
cannot overflow) and row-wise Adagrad on those rows only (gather, update, scatter back).
C runs twice: on the same mesh (XLA partitions the gather and the scatter over the row-sharded
tables) and, with ``sparse_one_device``, with the tables on one device (no partitioning; on
this CPU all devices share the same cores). Same ids, loss, optimizer formula and batch; all
paths run in a random order within each round after a compiled warm-up; all train the same
tables, so their final states must agree (``max_abs_diff_vs``).
Also the Pallas embedding-bag kernel vs its XLA reference (interpret mode off GPU/TPU, where the
number measures the interpreter, not the kernel).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program
from jaxflow.embeddings.lookup import ShardedEmbeddings, check_stats
from jaxflow.embeddings.optimizers import make_sparse_optimizer
from jaxflow.embeddings.reference import reference_lookup
from jaxflow.embeddings.spec import TableSpec
from jaxflow.embeddings.step import abstract_state, make_train_step, step_backend
from jaxflow.experiment import RunContext
from pallas_kernels.embedding_bag import embedding_bag, embedding_bag_reference

__all__ = ["Steps", "bench_kernel", "compare_step_backends", "dense_baseline_step", "kernel_fns", "make_steps",
           "programs", "ratio_summary", "regression_loss", "sparse_baseline_step", "table_specs", "timed"]


def _block(tree):
    """Waits for every array of ``tree``."""
    jax.tree.map(lambda x: x.block_until_ready(), tree)


def timed(fn, *args):
    """(``fn(*args)`` with its arrays ready, the seconds it took)."""
    t = time.perf_counter()
    out = fn(*args)
    _block(out)
    return out, time.perf_counter() - t


def ratio_summary(base_times, new_times) -> dict:
    """Per-pair ratios base / new: {"median", "min", "max", "pairs"}."""
    r = np.asarray(base_times) / np.asarray(new_times)
    return {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max()),
            "pairs": len(r)}


def regression_loss(outputs: dict, targets: dict) -> jax.Array:
    """Sum of squared errors of the pooled embeddings against random targets.

    Its gradient depends on the looked-up rows, as any real model's does; with a loss linear in
    the embeddings XLA could not order the forward reads before the in-place row update and
    would copy the table (observed on CPU).
    """
    return sum(jnp.sum(jnp.square(outputs[k] - targets[k])) for k in outputs)


def dense_baseline_step(specs, mesh, learning_rate: float, eps: float = 1e-8):
    """B: jnp.take + dense gradient + dense row-wise Adagrad on every row of every table."""

    def step(tables, accum, ids, weights):
        def loss(t):
            out = reference_lookup(specs, t, ids)
            return regression_loss(out, weights) / ids[specs[0].name].shape[0]

        grads = jax.grad(loss)(tables)
        new_t, new_a = {}, {}
        for name, g in grads.items():
            new_a[name] = accum[name] + jnp.mean(jnp.square(g), axis=-1)
            new_t[name] = tables[name] - learning_rate * g / (jnp.sqrt(new_a[name])[:, None] + eps)
        return new_t, new_a

    return jax.jit(step, donate_argnums=(0, 1))


def sparse_baseline_step(specs, learning_rate: float, eps: float = 1e-8):
    """C: jnp.take + gradient of the gathered rows + segment_sum over the unique ids + row-wise
    Adagrad on those rows only. ``(tables, accum, ids, weights) -> (tables, accum)``; tables
    ``{name: [V, D]}``, accum ``{name: [V]}``, ids ``{name: [B, bag]}`` (-1 = padding)."""

    def step(tables, accum, ids, weights):
        batch = ids[specs[0].name].shape[0]
        flat, uniq, inv = {}, {}, {}
        for s in specs:
            i = ids[s.name]
            # padding and out-of-range ids -> V: gathered as 0, dropped by the scatter
            i = jnp.where((i >= 0) & (i < s.vocab_size), i, s.vocab_size).astype(jnp.int32)
            flat[s.name] = i
            uniq[s.name], inv[s.name] = jnp.unique(i.reshape(-1), size=i.size,
                                                   fill_value=s.vocab_size, return_inverse=True)

        def loss(rows):
            out = {n: r.sum(axis=1) for n, r in rows.items()}  # sum pooling over the bag
            return regression_loss(out, weights) / batch

        rows = {s.name: jnp.take(tables[s.name], flat[s.name], axis=0, mode="fill", fill_value=0)
                for s in specs}
        g_rows = jax.grad(loss)(rows)
        new_t, new_a = {}, {}
        for s in specs:
            n, u = s.name, uniq[s.name]
            g = jax.ops.segment_sum(g_rows[n].reshape(-1, s.dim), inv[n].reshape(-1),
                                    num_segments=u.shape[0])
            acc = jnp.take(accum[n], u, mode="fill", fill_value=0) + jnp.mean(jnp.square(g), -1)
            old = jnp.take(tables[n], u, axis=0, mode="fill", fill_value=0)
            new = old - learning_rate * g / (jnp.sqrt(acc)[:, None] + eps)
            new_t[n] = tables[n].at[u].set(new, mode="drop")
            new_a[n] = accum[n].at[u].set(acc, mode="drop")
        return new_t, new_a

    return jax.jit(step, donate_argnums=(0, 1))


def compare_step_backends(specs, batches, optimizer, capacity: int, rounds: int, *, devices: int = 1,
                          seed: int = 0, warmup: int = 2) -> dict:
    """The train step in XLA vs what ``make_train_step``'s "auto" backend runs on ``devices``
    CPU devices (one: the fused host-kernel step; several: the ``shard_map`` step with the
    owners' updates by the host kernel), the same tables, batches and loss
    (:func:`regression_loss` over the local batch), alternated (order flipped every round)
    after ``warmup`` rounds. ``batches``: ``[(ids {name: int32[B, L]}, targets {name: f32[B,
    D]})]`` cycled. Returns the "auto" implementation's name, per backend the per-step wall and
    CPU seconds (lists) and their medians, the per-round wall ratios xla / auto (median, min,
    max) and the final tables' max |diff|."""
    mesh = Mesh(np.asarray(jax.devices("cpu")[:devices]), ("data",))
    emb = ShardedEmbeddings(specs, mesh, optimizer, capacity=capacity)
    local_b = next(iter(batches[0][0].values())).shape[0] // devices

    def loss_fn(params, outputs, w):
        return regression_loss(outputs, w) / local_b, {}

    steps = {b: make_train_step(emb, loss_fn, backend=b) for b in ("xla", "auto")}
    state = {b: {"emb": emb.init(seed), "dense": {}} for b in steps}
    placed = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
    wall = {b: [] for b in steps}
    cpu = {b: [] for b in steps}
    for i in range(warmup + rounds):
        ids, w = placed[i % len(placed)]
        for b in (("xla", "auto") if i % 2 else ("auto", "xla")):
            c0, t0 = time.process_time(), time.perf_counter()
            state[b], stats = steps[b](state[b], ids, w)
            _block(state[b])
            if i >= warmup:
                wall[b].append(time.perf_counter() - t0)
                cpu[b].append(time.process_time() - c0)
        check_stats(jax.device_get(stats), capacity)
    a, b = (emb.to_dense(state[k]["emb"])[0] for k in steps)
    return {"auto": step_backend(emb), "wall": wall, "cpu": cpu,
            "wall_median": {k: float(np.median(v)) for k, v in wall.items()},
            "cpu_median": {k: float(np.median(v)) for k, v in cpu.items()},
            "speedup": ratio_summary(wall["xla"], wall["auto"]),
            "max_abs_diff": max(float(np.max(np.abs(a[n] - b[n]))) for n in a)}


def kernel_fns(interpret: bool):
    """(Pallas embedding bag, its XLA reference), jitted: ``(table [V, D], ids int32[B, L]) ->
    [B, D]`` sum pooling; ``interpret``: the kernel in interpret mode (off GPU / TPU)."""
    pallas = jax.jit(lambda t, i: embedding_bag(t, i, interpret=interpret))
    ref = jax.jit(lambda t, i: embedding_bag_reference(t, i))
    return pallas, ref


def bench_kernel(config, run: RunContext) -> dict:
    """The Pallas embedding bag vs its XLA reference on one device: table f32[kernel_vocab, dim],
    ids int32[kernel_bags, bag]; ``kernel_pairs`` alternated timings, the speedup and max |diff|
    (interpret mode off GPU / TPU: then the time measures the interpreter)."""
    interpret = jax.default_backend() not in ("gpu", "tpu")
    k = jax.random.key(config.seed)
    table = jax.random.normal(k, (config.kernel_vocab, config.dim), jnp.float32)
    ids = jax.random.randint(jax.random.fold_in(k, 1), (config.kernel_bags, config.bag), -1,
                             config.kernel_vocab)
    pallas, ref = kernel_fns(interpret)
    err = float(jnp.max(jnp.abs(pallas(table, ids) - ref(table, ids))))
    _block(ref(table, ids))
    t_ref, t_pal = [], []
    for _ in range(config.kernel_pairs):
        t_pal.append(timed(pallas, table, ids)[1])
        t_ref.append(timed(ref, table, ids)[1])
    s = ratio_summary(t_ref, t_pal)
    run.info(f"pallas embedding_bag ({'interpret' if interpret else 'compiled'}) vs reference: "
             f"speedup {s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}], max |diff| {err:.2g}")
    return {"pallas_vs_reference_speedup": s["median"], "pallas_vs_reference_spread": [s["min"], s["max"]],
            "pallas_interpret": interpret, "pallas_max_abs_diff": err,
            "pallas_seconds_median": float(np.median(t_pal)), "reference_seconds_median": float(np.median(t_ref))}


class Steps(NamedTuple):
    """The jitted steps of every path and what they are built with (:func:`make_steps`)."""

    emb: ShardedEmbeddings
    capacity: int  # distinct keys per device per step
    bucket: int  # keys per owner per step
    jaxflow: Any  # A: (state, ids, weights) -> (state, stats)
    dense: Any  # B: (tables, accum, ids, weights) -> (tables, accum)
    sparse: Any  # C: the same signature
    table_sharding: NamedSharding  # the baselines' tables and accumulators


def table_specs(config) -> list[TableSpec]:
    """``t0 .. t{num_tables-1}``, row-wise, sum-pooled, ``config.table_rows()`` rows each."""
    return [TableSpec(f"t{i}", v, config.dim, "row_wise", "sum")
            for i, v in enumerate(config.table_rows())]


def make_steps(config, mesh) -> Steps:
    """The three paths' jitted steps on ``mesh`` (its "data" axis): A ``make_train_step`` on
    ``ShardedEmbeddings`` (capacity ``config.capacity`` or the bound local batch x bag x tables,
    per owner ``config.bucket_capacity`` or 2 x capacity / devices), B and C over tables
    row-sharded with ``NamedSharding(P("data"))`` when every row count divides the devices
    (else replicated).

    Raises ValueError when ``batch_size`` does not split over the devices."""
    n_dev = mesh.shape["data"]
    if config.batch_size % n_dev:
        raise ValueError(f"batch_size={config.batch_size} not divisible by {n_dev} devices")
    specs = table_specs(config)
    local_b = config.batch_size // n_dev
    capacity = config.capacity or local_b * config.bag * config.num_tables
    opt = make_sparse_optimizer("rowwise_adagrad", config.learning_rate)
    bucket = config.bucket_capacity or min(capacity, -(-2 * capacity // n_dev))
    emb = ShardedEmbeddings(specs, mesh, opt, capacity=capacity, bucket_capacity=bucket,
                            pooling_backend=config.pooling_backend)

    def loss_fn(params, outputs, w):
        return regression_loss(outputs, w) / local_b, {}

    # the baseline's tables are row-sharded like ours when the vocabulary divides evenly
    even = all(s.vocab_size % n_dev == 0 for s in specs)
    table_sharding = NamedSharding(mesh, P("data") if even else P())
    return Steps(emb, capacity, bucket, make_train_step(emb, loss_fn),
                 dense_baseline_step(specs, mesh, config.learning_rate),
                 sparse_baseline_step(specs, config.learning_rate), table_sharding)


def programs(config, meshes) -> list[Program]:
    """Every jitted program the run executes, with abstract arguments on ``meshes["mesh"]``
    (the config's "data" mesh on the target's devices), built by :func:`make_steps` /
    :func:`kernel_fns` as the run builds them: ``jaxflow/step`` (A; the embedding state of
    ``embeddings.step.abstract_state``, donated), ``dense_take/step`` (B),
    ``sparse_take/step`` (C on the mesh), with ``sparse_one_device`` ``sparse_take_one_device/
    step`` (C on the mesh's first device) and with ``kernel_pairs`` ``kernel/pallas`` and
    ``kernel/reference`` (one device). Ids int32[batch_size, bag] and targets f32[batch_size,
    dim] split over "data". Nothing is allocated."""
    mesh = meshes["mesh"]
    st = make_steps(config, mesh)
    S, b, d = jax.ShapeDtypeStruct, config.batch_size, config.dim
    specs = st.emb.plan.specs
    row = NamedSharding(mesh, P("data"))

    def batch(sharding):
        return ({s.name: S((b, config.bag), jnp.int32, sharding=sharding) for s in specs},
                {s.name: S((b, d), jnp.float32, sharding=sharding) for s in specs})

    def baseline_state(sharding):
        return ({s.name: S((s.vocab_size, d), jnp.float32, sharding=sharding) for s in specs},
                {s.name: S((s.vocab_size,), jnp.float32, sharding=sharding) for s in specs})

    ids, w = batch(row)
    rows = sum(s.vocab_size for s in specs)
    n = mesh.shape["data"]
    tables = f"{len(specs)} tables x {rows:,} rows x {d}"
    split = "row-sharded" if st.table_sharding.spec == P("data") else "replicated"
    out = [Program("jaxflow/step", st.jaxflow, (abstract_state(st.emb), ids, w), mesh,
                   kind="embedding", tokens=b,
                   note=f"{tables} row-wise over data={n} (one group); batch {b} split over "
                        f"data; capacity {st.capacity}, per owner {st.bucket}; pooling "
                        f"{config.pooling_backend}"),
           Program("dense_take/step", st.dense, (*baseline_state(st.table_sharding), ids, w),
                   mesh, kind="embedding", tokens=b,
                   note=f"{tables} {split} over data={n} (NamedSharding); XLA partitions the "
                        "take, the dense gradient and the dense Adagrad"),
           Program("sparse_take/step", st.sparse, (*baseline_state(st.table_sharding), ids, w),
                   mesh, kind="embedding", tokens=b,
                   note=f"{tables} {split} over data={n} (NamedSharding); XLA partitions the "
                        "take and the scatter")]
    one = Mesh(np.asarray(mesh.devices.flat[:1]), ("data",))
    alone = NamedSharding(one, P())
    if config.sparse_one_device:
        out.append(Program("sparse_take_one_device/step", st.sparse,
                           (*baseline_state(alone), *batch(alone)), one, kind="embedding",
                           tokens=b, note=f"{tables} on one device"))
    if config.kernel_pairs:
        platform = one.devices.flat[0].platform
        pallas, ref = kernel_fns(interpret=platform not in ("gpu", "cuda", "tpu"))
        args = (S((config.kernel_vocab, d), jnp.float32, sharding=alone),
                S((config.kernel_bags, config.bag), jnp.int32, sharding=alone))
        for name, fn in (("kernel/pallas", pallas), ("kernel/reference", ref)):
            out.append(Program(name, fn, args, one, kind="forward", tokens=config.kernel_bags,
                               note=f"embedding bag [{config.kernel_vocab}, {d}] x "
                                    f"{config.kernel_bags} bags of {config.bag}, one device"))
    return out
