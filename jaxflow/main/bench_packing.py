"""The ``bench_packing`` experiment: pure host-side comparison of packing algorithms.

For each distribution and batch size, every algorithm packs the same batches ("+refine": then
the length refinement of ``jaxflow.flow.packing.refine_lengths``). Reported per algorithm:
padding waste (rows bucketed to ``row_granularity``), cost imbalance (max / mean
micro-batch cost, a*len + b*len^2), bins used, and packing time per batch.
"""

from __future__ import annotations

import time

import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.flow.digits_data import DigitsConfig, step_samples
from jaxflow.flow.packing import ALGORITHMS, CostModel, pack
from jaxflow.flow.vlm import bucket


def synthetic_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Long-tailed multi-image samples: text 16-512 tokens + 1-16 images of 16-256 tokens."""
    text = np.minimum(16 + rng.pareto(1.2, n) * 40, 512).astype(int)
    images = np.minimum(1 + rng.pareto(1.0, n), 16).astype(int)
    per_image = [np.minimum(16 * 2 ** rng.integers(0, 5, k), 256).sum() for k in images]
    return text + np.asarray(per_image)


def digits_lengths(seed: int, step: int, n: int) -> np.ndarray:
    return np.asarray([s.length for s in step_samples(DigitsConfig(), seed=seed, step=step,
                                                      batch_size=n)])


def evaluate(lengths: np.ndarray, budget: int, algorithm: str, cost: CostModel, dp: int,
             granularity: int) -> dict:
    costs = cost(lengths)
    if algorithm == "padded":
        t0 = time.perf_counter()
        rows = bucket(len(lengths), dp)
        row_len = bucket(int(lengths.max()), granularity)
        seconds = time.perf_counter() - t0
        waste = 1 - lengths.sum() / (rows * row_len)
        per_row = np.zeros(rows)
        per_row[:len(lengths)] = costs
        return {"waste": waste, "imbalance": per_row.max() / per_row.mean(), "bins": rows,
                "ms": seconds * 1e3}
    base, refine = algorithm.removesuffix("+refine"), algorithm.endswith("+refine")
    t0 = time.perf_counter()
    p = pack(lengths, costs, budget, algorithm=base, bin_multiple=dp, min_bins=dp, refine=refine)
    seconds = time.perf_counter() - t0
    row_len = bucket(int(p.bin_lengths.max()), granularity)
    return {"waste": p.padding_waste(row_len), "imbalance": p.imbalance, "bins": len(p.bins),
            "ms": seconds * 1e3}


def main(config, run: RunContext) -> dict:
    cost = CostModel.for_width(config.d_model)
    rng = np.random.default_rng(config.seed)
    algos = ("padded",) + ALGORITHMS + ("lpt+refine", "karmarkar_karp+refine")
    table: dict = {}
    step = 0
    for dist, budget in (("digits", config.digits_budget),
                         ("synthetic", config.synthetic_budget)):
        for n in config.batch_sizes:
            rows = {a: [] for a in algos}
            for b in range(config.batches):
                if dist == "digits":
                    lengths = digits_lengths(config.seed, b, n)
                else:
                    lengths = synthetic_lengths(rng, n)
                for a in algos:
                    rows[a].append(evaluate(lengths, budget, a, cost, config.data_parallel,
                                            config.row_granularity))
            key = f"{dist}_b{n}"
            table[key] = {a: {k: float(np.mean([r[k] for r in rows[a]])) for k in rows[a][0]}
                          for a in algos}
            for a in algos:
                step += 1
                run.log(step, {"distribution": key, "algorithm": a, **table[key][a]})
            run.info(f"{key}: " + "; ".join(
                f"{a} waste {v['waste']:.3f} imb {v['imbalance']:.3f} {v['ms']:.1f}ms"
                for a, v in table[key].items()))
    return {"results": table,
            "padding_waste": {k: {a: v[a]["waste"] for a in algos} for k, v in table.items()},
            "cost_imbalance": {k: {a: v[a]["imbalance"] for a in algos} for k, v in table.items()}}
