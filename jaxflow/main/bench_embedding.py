"""The ``bench_embedding`` experiment: sharded lookup + sparse update vs ``jnp.take`` baselines
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
from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer
from jaxflow.embeddings.reference import reference_lookup
from jaxflow.embeddings.step import abstract_state, make_train_step
from jaxflow.experiment import RunContext
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo
from pallas_kernels.embedding_bag import embedding_bag, embedding_bag_reference


def _block(tree):
    jax.tree.map(lambda x: x.block_until_ready(), tree)


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    _block(out)
    return out, time.perf_counter() - t


def _ratio_summary(base_times, new_times) -> dict:
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


def kernel_fns(interpret: bool):
    """(Pallas embedding bag, its XLA reference), jitted: ``(table [V, D], ids int32[B, L]) ->
    [B, D]`` sum pooling; ``interpret``: the kernel in interpret mode (off GPU / TPU)."""
    pallas = jax.jit(lambda t, i: embedding_bag(t, i, interpret=interpret))
    ref = jax.jit(lambda t, i: embedding_bag_reference(t, i))
    return pallas, ref


def bench_kernel(config, run: RunContext) -> dict:
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
        t_pal.append(_timed(pallas, table, ids)[1])
        t_ref.append(_timed(ref, table, ids)[1])
    s = _ratio_summary(t_ref, t_pal)
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


def compile_programs(config, meshes) -> list[Program]:
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


def main(config, run: RunContext) -> dict:
    mesh = config.mesh.make()
    st = make_steps(config, mesh)
    emb, capacity, bucket = st.emb, st.capacity, st.bucket
    n_dev = mesh.shape["data"]
    specs = list(emb.plan.specs)
    names = [s.name for s in specs]
    gen = SyntheticCriteo(SyntheticConfig(vocab_sizes=config.table_rows(),
                                          multi_hot=config.bag, zipf_a=config.zipf_a), seed=config.seed)
    rng = np.random.default_rng(config.seed)
    batches = []
    for b in range(config.num_batches):
        sparse = gen.batch(b, config.batch_size)["sparse"]
        ids = {n: sparse[f"c{i}"] for i, n in enumerate(names)}
        w = {n: rng.standard_normal((config.batch_size, config.dim)).astype(np.float32) for n in names}
        batches.append((ids, w))
    step_a, step_b, step_c = st.jaxflow, st.dense, st.sparse
    state_a = {"emb": emb.init(config.seed), "dense": {}}
    tables0, _ = emb.to_dense(state_a["emb"])
    row_sharding = NamedSharding(mesh, P("data"))
    table_sharding = st.table_sharding
    tables_b = jax.device_put(tables0, table_sharding)
    accum_b = jax.device_put({s.name: np.zeros(s.vocab_size, np.float32) for s in specs},
                             table_sharding)
    placed = [jax.device_put(b, row_sharding) for b in batches]
    one = jax.devices()[0]
    on_one = [jax.device_put(b, one) for b in batches]
    ids_per_step = [sum(int((v >= 0).sum()) for v in ids.values()) for ids, _ in batches]
    run.info(f"{config.num_tables} tables x {sum(config.table_rows()):,} rows in all x {config.dim} "
             f"on {n_dev} devices; "
             f"batch {config.batch_size} x bag <= {config.bag}; capacity {capacity}, per owner {bucket}")

    # path -> (step, state, batches): jaxflow; dense take; sparse take on the same mesh
    # (XLA partitions the gather and the scatter); sparse take with the tables on one device
    zeros = {s.name: np.zeros(s.vocab_size, np.float32) for s in specs}
    paths = {"jaxflow": (lambda st, i, w: step_a(st, i, w), state_a, placed),
             "dense": (lambda st, i, w: step_b(*st, i, w),
                       (tables_b, accum_b), placed),
             "sparse": (lambda st, i, w: step_c(*st, i, w),
                        jax.device_put((tables0, zeros), table_sharding), placed)}
    if config.sparse_one_device:
        paths["sparse_one_device"] = (lambda st, i, w: step_c(*st, i, w),
                                      jax.device_put((tables0, zeros), one), on_one)
    state = {k: v[1] for k, v in paths.items()}
    times = {k: [] for k in paths}
    n_ids, stats = [], None
    order_rng = np.random.default_rng([config.seed, 0x0DE5])
    names_p = list(paths)
    for i in range(config.warmup + config.pairs):
        took = {}
        for k in order_rng.permutation(len(names_p)):  # random order within each round
            path = names_p[k]
            step, _, data = paths[path]
            ids, w = data[i % len(data)]
            out, took[path] = _timed(step, state[path], ids, w)
            if path == "jaxflow":
                state[path], stats = out
            else:
                state[path] = out
        if i >= config.warmup:
            for k, t in took.items():
                times[k].append(t)
            n_ids.append(ids_per_step[i % len(placed)])
            run.log(i - config.warmup, {f"{k}_seconds": t for k, t in took.items()}
                    | {f"ratio_vs_{k}": t / took["jaxflow"] for k, t in took.items() if k != "jaxflow"})
    check_stats(stats, capacity)
    got, _ = emb.to_dense(state["jaxflow"]["emb"])
    diff = {k: max(float(np.max(np.abs(got[n] - np.asarray(state[k][0][n])))) for n in names)
            for k in paths if k != "jaxflow"}
    ratio = {k: _ratio_summary(times[k], times["jaxflow"]) for k in paths if k != "jaxflow"}
    rows_per_second = float(np.median(np.asarray(n_ids) / np.asarray(times["jaxflow"])))
    run.info("jaxflow step vs " + "; ".join(
        f"{k}: {r['median']:.3g}x [min {r['min']:.3g}, max {r['max']:.3g}]" for k, r in ratio.items())
        + f" over {config.pairs} rounds; {rows_per_second:,.0f} ids looked up + updated / s; max "
        + ", ".join(f"|jaxflow - {k}| {d:.2g}" for k, d in diff.items()))
    s, sc = ratio["dense"], ratio["sparse"]
    best = min((k for k in ratio if k != "dense"), key=lambda k: float(np.median(times[k])))
    out = {"speedup_vs_dense_take": s["median"], "speedup_spread": [s["min"], s["max"]],
           "speedup_vs_sparse_take": sc["median"], "speedup_vs_sparse_spread": [sc["min"], sc["max"]],
           "speedup_vs_best_sparse_take": ratio[best]["median"], "best_sparse_take": best,
           "ratios": ratio, "pairs": s["pairs"], "rows_per_second": rows_per_second,
           **{f"{k}_rows_per_second": float(np.median(np.asarray(n_ids) / np.asarray(times[k])))
              for k in paths if k != "jaxflow"},
           "sharded_step_seconds_median": float(np.median(times["jaxflow"])),
           **{f"{k}_step_seconds_median": float(np.median(times[k])) for k in paths if k != "jaxflow"},
           "max_abs_diff_vs_dense": diff["dense"], "max_abs_diff_vs_sparse": diff["sparse"],
           "max_abs_diff_vs": diff,
           "max_unique_per_device": int(stats["max_unique"]),
           "table_bytes": sum(config.table_rows()) * config.dim * 4}
    if config.kernel_pairs:
        out.update(bench_kernel(config, run))
    return out
