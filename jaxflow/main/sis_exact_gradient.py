"""The ``sis_exact_gradient`` study: exact bias / variance of the policy-gradient estimators.

The enumerable toy policy, its exact gradient and the estimators' exact moments are
:mod:`jaxflow.rl.exact_gradient`; the sampled moments and the table are
:mod:`jaxflow.rl.exact_gradient_study`. This driver runs them per perturbation, logs and writes
the summary.
"""

from __future__ import annotations

import time
from typing import Any

from jaxflow.rl.exact_gradient import estimator_specs, exact_moments
from jaxflow.rl.exact_gradient_study import (
    behaviour_policy,
    check_config,
    draw_sampler,
    estimator_rows,
    format_table,
    sampled_moments,
    toy_problem,
)


def main(config, run) -> dict[str, Any]:
    cfg = config
    check_config(cfg)
    start = time.time()
    problem = toy_problem(cfg)
    specs = estimator_specs(cfg)
    run.info(f"{problem.responses.shape[0]} responses, {problem.theta.size} parameters, "
             f"J = {float(problem.value):.4f}, ||g|| = {problem.g_norm2 ** 0.5:.4g}, "
             f"{len(specs)} estimators x {cfg.draws} draws")
    sampler = draw_sampler(problem, cfg, specs)
    n_chunks = cfg.draws // cfg.chunk
    run.set_total_steps(len(cfg.perturbations) * (n_chunks + 1), "sis_exact_gradient")
    rows, per_perturbation, step = [], [], 0
    for p_i, p in enumerate(cfg.perturbations):
        p = float(p)
        behaviour = behaviour_policy(problem, p, cfg.topk)
        lsm_mu, top_idx, baseline = behaviour
        exact = exact_moments(problem.theta, lsm_mu, top_idx, problem.responses, problem.rewards,
                              baseline, cfg=cfg, specs=specs)
        step += 1
        run.log(step, {"perturbation": p, "phase": "exact"})

        def log_chunk(chunk_stats, p=p):
            nonlocal step
            step += 1
            run.log(step, {"perturbation": p, "phase": "sampled", **chunk_stats})

        sum_g, sum_sq, stat_sums = sampled_moments(sampler, problem, behaviour, cfg=cfg, index=p_i,
                                                   n_estimators=len(specs), on_chunk=log_chunk)
        rows += estimator_rows(specs, p, exact, (sum_g, sum_sq), problem, cfg)
        per_perturbation.append({"perturbation": p, "baseline": float(baseline), **stat_sums})
        run.info(f"perturbation {p}: accept_rate={stat_sums['accept_rate']:.3f} "
                 f"d_original={stat_sums['d_original']:.3f} d_sis={stat_sums['d_sis']:.3f}")

    table = format_table(rows)
    run.info("\n" + table)
    run.write_json("estimators.json", rows)
    return {
        "estimators": rows,
        "perturbation_stats": per_perturbation,
        "exact_objective": float(problem.value),
        "exact_gradient_norm": problem.g_norm2 ** 0.5,
        "num_responses": int(problem.responses.shape[0]),
        "num_parameters": int(problem.theta.size),
        "draws": cfg.draws,
        "batch": cfg.batch,
        "table": table,
        "study_seconds": time.time() - start,
    }
