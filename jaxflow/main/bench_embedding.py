"""The ``bench_embedding`` experiment: sharded lookup + sparse update vs ``jnp.take`` baselines.

A (jaxflow's ``ShardedEmbeddings`` train step), B (dense ``jnp.take`` + dense gradient and
Adagrad) and C (sparse ``jnp.take`` + segment_sum + touched rows, on the mesh and with
``sparse_one_device`` on one device) train the same tables on the same batches, in a random
order within each round after a compiled warm-up; their final states must agree
(``max_abs_diff_vs``). Also the Pallas embedding-bag kernel vs its XLA reference. The paths, the
kernel measurement and ``--compile-only``'s programs are ``jaxflow.embeddings.bench``.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only.program import Program
from jaxflow.embeddings import check_stats
from jaxflow.embeddings.bench import bench_kernel, make_steps, programs, ratio_summary, timed
from jaxflow.experiment import RunContext
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo

__all__ = ["compile_programs", "main"]


def compile_programs(config, meshes) -> list[Program]:
    """Every jitted program the run executes (``jaxflow.embeddings.bench.programs``)."""
    return programs(config, meshes)


def main(config, run: RunContext) -> dict:
    """Every path stepped in a random order per round, the ratios, the state agreement, the kernel."""
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
            out, took[path] = timed(step, state[path], ids, w)
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
    ratio = {k: ratio_summary(times[k], times["jaxflow"]) for k in paths if k != "jaxflow"}
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
