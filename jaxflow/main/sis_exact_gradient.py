"""The ``sis_exact_gradient`` study: exact bias / variance of the policy-gradient estimators.

The enumerable toy policy, its exact gradient and the estimators' exact moments are library code
in :mod:`jaxflow.rl.exact_gradient`; this driver samples, tabulates and writes the summary.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.rl import sis
from jaxflow.rl.exact_gradient import (
    _estimates,
    all_responses,
    context_ids,
    estimator_specs,
    exact_gradient,
    exact_moments,
    num_contexts,
)


def main(config, run) -> dict[str, Any]:
    cfg = config
    if cfg.topk < 1 or cfg.topk > cfg.vocab:
        raise ValueError(f"topk must be in [1, vocab={cfg.vocab}], got {cfg.topk}")
    if cfg.draws % cfg.chunk:
        raise ValueError(f"draws={cfg.draws} must be a multiple of chunk={cfg.chunk}")
    start = time.time()
    key = jax.random.PRNGKey(cfg.seed)
    k_theta, k_eps, k_reward, k_draws = jax.random.split(key, 4)
    n_ctx = num_contexts(cfg.vocab, cfg.length)
    theta = cfg.logit_scale * jax.random.normal(k_theta, (n_ctx, cfg.vocab))
    eps = jax.random.normal(k_eps, (n_ctx, cfg.vocab))
    responses = all_responses(cfg.vocab, cfg.length)
    rewards = jax.random.bernoulli(k_reward, cfg.reward_rate, (responses.shape[0],))
    rewards = rewards.astype(jnp.float32)
    ctx_all = context_ids(responses, cfg.vocab)
    value, g = exact_gradient(theta, responses, ctx_all, rewards)
    g = np.asarray(g, np.float64).reshape(-1)
    g_norm2 = float(g @ g)
    specs = estimator_specs(cfg)
    run.info(f"{responses.shape[0]} responses, {theta.size} parameters, J = {float(value):.4f}, "
             f"||g|| = {g_norm2 ** 0.5:.4g}, {len(specs)} estimators x {cfg.draws} draws")

    @jax.jit
    def mc_chunk(lsm_mu, keys, baseline, top_idx):
        seq_logp_mu = jnp.sum(lsm_mu[ctx_all, responses], -1)

        def draw(k):
            k_sample, k_u = jax.random.split(k)
            idx = jax.random.categorical(k_sample, seq_logp_mu, shape=(cfg.batch,))
            u = sis.sis_uniforms(k_u, (cfg.batch, cfg.length))  # shared by the SIS rows
            return _estimates(theta, lsm_mu, top_idx, responses[idx], rewards[idx] - baseline,
                              u, vocab=cfg.vocab, specs=specs)
        grads, stats = jax.vmap(draw)(keys)  # [D, E, P]
        return (jnp.sum(grads, 0), jnp.sum(jnp.sum(grads * grads, -1), 0),
                {k: jnp.mean(v) for k, v in stats.items()})

    n_chunks = cfg.draws // cfg.chunk
    run.set_total_steps(len(cfg.perturbations) * (n_chunks + 1), "sis_exact_gradient")
    rows, per_perturbation, step = [], [], 0
    for p_i, p in enumerate(cfg.perturbations):
        p = float(p)
        lsm_mu = jax.nn.log_softmax(theta + p * eps, -1)
        top_idx = jnp.argsort(-lsm_mu, axis=-1)[:, : cfg.topk]
        baseline = jnp.sum(jnp.exp(jnp.sum(lsm_mu[ctx_all, responses], -1)) * rewards)
        first, second = exact_moments(theta, lsm_mu, top_idx, responses, rewards, baseline,
                                       cfg=cfg, specs=specs)
        step += 1
        run.log(step, {"perturbation": p, "phase": "exact"})
        sum_g = np.zeros((len(specs), g.size))
        sum_sq = np.zeros(len(specs))
        stat_sums: dict[str, float] = {}
        for c in range(n_chunks):
            keys = jax.random.split(jax.random.fold_in(k_draws, p_i * n_chunks + c), cfg.chunk)
            s, sq, stats = mc_chunk(lsm_mu, keys, baseline, top_idx)
            sum_g += np.asarray(s, np.float64)
            sum_sq += np.asarray(sq, np.float64)
            chunk_stats = {k: float(v) for k, v in stats.items()}
            for k, v in chunk_stats.items():
                stat_sums[k] = stat_sums.get(k, 0.0) + v / n_chunks
            step += 1
            run.log(step, {"perturbation": p, "phase": "sampled", **chunk_stats})
        # exact: one response's moments; a draw averages `batch` independent responses
        bias = np.linalg.norm(first - g, axis=-1) / g_norm2 ** 0.5
        variance = (second - np.sum(first ** 2, -1)) / cfg.batch / g_norm2
        mc_mean = sum_g / cfg.draws
        mc_variance = (sum_sq / cfg.draws - np.sum(mc_mean ** 2, -1)) * cfg.draws / (
            cfg.draws - 1) / g_norm2
        mc_bias = np.linalg.norm(mc_mean - g, axis=-1) / g_norm2 ** 0.5
        mc_error = np.linalg.norm(mc_mean - first, axis=-1) / g_norm2 ** 0.5
        for i, (name, algo, _) in enumerate(specs):
            rows.append({
                "name": name, "algo": algo, "perturbation": float(p),
                "bias": float(bias[i]), "variance": float(variance[i]),
                "mse": float(bias[i] ** 2 + variance[i]),
                "mc_bias": float(mc_bias[i]), "mc_variance": float(mc_variance[i]),
                "mc_noise": float(np.sqrt(variance[i] / cfg.draws)),
                "mc_error": float(mc_error[i]),
            })
        per_perturbation.append({"perturbation": float(p), "baseline": float(baseline),
                                 **stat_sums})
        run.info(f"perturbation {p}: accept_rate={stat_sums['accept_rate']:.3f} "
                 f"d_original={stat_sums['d_original']:.3f} d_sis={stat_sums['d_sis']:.3f}")

    table = format_table(rows)
    run.info("\n" + table)
    run.write_json("estimators.json", rows)
    return {
        "estimators": rows,
        "perturbation_stats": per_perturbation,
        "exact_objective": float(value),
        "exact_gradient_norm": g_norm2 ** 0.5,
        "num_responses": int(responses.shape[0]),
        "num_parameters": int(theta.size),
        "draws": cfg.draws,
        "batch": cfg.batch,
        "table": table,
        "study_seconds": time.time() - start,
    }


def format_table(rows: list[dict]) -> str:
    """A markdown table: one line per (algo, name), bias / variance per perturbation."""
    perts = sorted({r["perturbation"] for r in rows})
    head = "| algo | correction | " + " | ".join(f"p={p:g} bias / var" for p in perts) + " |"
    lines = [head, "|" + "---|" * (2 + len(perts))]
    keys = list(dict.fromkeys((r["algo"], r["name"]) for r in rows))
    by = {(r["algo"], r["name"], r["perturbation"]): r for r in rows}
    for algo, name in keys:
        cells = [f"{by[(algo, name, p)]['bias']:.3g} / {by[(algo, name, p)]['variance']:.3g}"
                 for p in perts]
        lines.append(f"| {algo} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
