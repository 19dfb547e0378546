"""The ``sis_exact_gradient`` study's steps: the toy problem, each behaviour policy, the sampled
moments of every estimator over many draws, and the bias / variance rows and their table.

The exact side (enumerated gradient and moments) and the estimators are
:mod:`jaxflow.rl.exact_gradient`; see its docstring for the design. Arrays: C contexts, V the
vocabulary, L the response length, P = C * V parameters, E estimators (``estimator_specs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.rl import sis
from jaxflow.rl.exact_gradient import all_responses, context_ids, estimator_gradients, exact_gradient, num_contexts

__all__ = ["ToyProblem", "check_config", "toy_problem", "behaviour_policy", "draw_sampler",
           "sampled_moments", "estimator_rows", "format_table"]


class ToyProblem(NamedTuple):
    """The enumerable problem of one seed.

    Attributes:
      theta: [C, V] the current policy's tabular logits; eps: [C, V] the perturbation direction.
      responses: [V**L, L] every response; ctx: [V**L, L] their context ids; rewards: [V**L].
      value: J(theta) (scalar array); g: [P] float64 exact gradient; g_norm2: ||g||^2.
      draws_key: the key the sampled draws fold their chunk index into.
    """

    theta: jax.Array
    eps: jax.Array
    responses: jax.Array
    ctx: jax.Array
    rewards: jax.Array
    value: jax.Array
    g: np.ndarray
    g_norm2: float
    draws_key: jax.Array


def check_config(cfg) -> None:
    """ValueError naming the value when ``topk`` is outside [1, vocab] or ``draws`` is not a
    multiple of ``chunk``."""
    if cfg.topk < 1 or cfg.topk > cfg.vocab:
        raise ValueError(f"topk must be in [1, vocab={cfg.vocab}], got {cfg.topk}")
    if cfg.draws % cfg.chunk:
        raise ValueError(f"draws={cfg.draws} must be a multiple of chunk={cfg.chunk}")


def toy_problem(cfg) -> ToyProblem:
    """The policy, the perturbation direction, the reward table and the exact gradient of
    ``cfg.seed`` (``configs.sis_exact_gradient.Config``)."""
    key = jax.random.PRNGKey(cfg.seed)
    k_theta, k_eps, k_reward, k_draws = jax.random.split(key, 4)
    n_ctx = num_contexts(cfg.vocab, cfg.length)
    theta = cfg.logit_scale * jax.random.normal(k_theta, (n_ctx, cfg.vocab))
    eps = jax.random.normal(k_eps, (n_ctx, cfg.vocab))
    responses = all_responses(cfg.vocab, cfg.length)
    rewards = jax.random.bernoulli(k_reward, cfg.reward_rate, (responses.shape[0],))
    rewards = rewards.astype(jnp.float32)
    ctx = context_ids(responses, cfg.vocab)
    value, g = exact_gradient(theta, responses, ctx, rewards)
    g = np.asarray(g, np.float64).reshape(-1)
    return ToyProblem(theta, eps, responses, ctx, rewards, value, g, float(g @ g), k_draws)


def behaviour_policy(problem: ToyProblem, perturbation: float, topk: int) -> tuple[Any, Any, Any]:
    """(log-softmax [C, V], top-``topk`` token ids [C, K], exact baseline E_mu[R]) of the
    behaviour policy with logits ``theta + perturbation * eps``."""
    lsm_mu = jax.nn.log_softmax(problem.theta + perturbation * problem.eps, -1)
    top_idx = jnp.argsort(-lsm_mu, axis=-1)[:, :topk]
    baseline = jnp.sum(jnp.exp(jnp.sum(lsm_mu[problem.ctx, problem.responses], -1)) * problem.rewards)
    return lsm_mu, top_idx, baseline


def draw_sampler(problem: ToyProblem, cfg, specs) -> Callable:
    """The jitted ``(lsm_mu, keys [D], baseline, top_idx) -> (sum of estimates [E, P], sum of
    squared norms [E], mean SIS stats)`` over D draws of ``cfg.batch`` responses from mu each,
    with fresh SIS uniforms per draw (shared by the SIS rows of one draw)."""
    theta, responses, ctx_all, rewards = problem.theta, problem.responses, problem.ctx, problem.rewards

    @jax.jit
    def mc_chunk(lsm_mu, keys, baseline, top_idx):
        seq_logp_mu = jnp.sum(lsm_mu[ctx_all, responses], -1)

        def draw(k):
            k_sample, k_u = jax.random.split(k)
            idx = jax.random.categorical(k_sample, seq_logp_mu, shape=(cfg.batch,))
            u = sis.sis_uniforms(k_u, (cfg.batch, cfg.length))  # shared by the SIS rows
            return estimator_gradients(theta, lsm_mu, top_idx, responses[idx],
                                       rewards[idx] - baseline, u, vocab=cfg.vocab, specs=specs)
        grads, stats = jax.vmap(draw)(keys)  # [D, E, P]
        return (jnp.sum(grads, 0), jnp.sum(jnp.sum(grads * grads, -1), 0),
                {k: jnp.mean(v) for k, v in stats.items()})

    return mc_chunk


def sampled_moments(sampler: Callable, problem: ToyProblem, behaviour: tuple, *, cfg, index: int,
                    n_estimators: int, on_chunk: Callable[[dict], None] | None = None
                    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """(sum over ``cfg.draws`` draws of each estimate [E, P], of its squared norm [E], the SIS
    stats averaged over chunks) under ``behaviour`` (:func:`behaviour_policy`), perturbation
    number ``index`` (its keys: ``fold_in(draws_key, index * chunks + c)``). Sums are float64;
    ``on_chunk(stats)`` after each chunk of ``cfg.chunk`` draws."""
    lsm_mu, top_idx, baseline = behaviour
    n_chunks = cfg.draws // cfg.chunk
    sum_g = np.zeros((n_estimators, problem.g.size))
    sum_sq = np.zeros(n_estimators)
    stat_sums: dict[str, float] = {}
    for c in range(n_chunks):
        keys = jax.random.split(jax.random.fold_in(problem.draws_key, index * n_chunks + c), cfg.chunk)
        s, sq, stats = sampler(lsm_mu, keys, baseline, top_idx)
        sum_g += np.asarray(s, np.float64)
        sum_sq += np.asarray(sq, np.float64)
        chunk_stats = {k: float(v) for k, v in stats.items()}
        for k, v in chunk_stats.items():
            stat_sums[k] = stat_sums.get(k, 0.0) + v / n_chunks
        if on_chunk is not None:
            on_chunk(chunk_stats)
    return sum_g, sum_sq, stat_sums


def estimator_rows(specs, perturbation: float, exact: tuple[np.ndarray, np.ndarray],
                   sampled: tuple[np.ndarray, np.ndarray], problem: ToyProblem, cfg) -> list[dict]:
    """One row per estimator: exact ``bias`` / ``variance`` / ``mse`` of a ``cfg.batch``-response
    draw relative to ||g|| (``exact``: E[g_hat] [E, P], E||g_hat||^2 [E] of one response) and the
    sampled ``mc_*`` figures (``sampled``: sums over the draws)."""
    first, second = exact
    sum_g, sum_sq = sampled
    g, g_norm2 = problem.g, problem.g_norm2
    # exact: one response's moments; a draw averages `batch` independent responses
    bias = np.linalg.norm(first - g, axis=-1) / g_norm2 ** 0.5
    variance = (second - np.sum(first ** 2, -1)) / cfg.batch / g_norm2
    mc_mean = sum_g / cfg.draws
    mc_variance = (sum_sq / cfg.draws - np.sum(mc_mean ** 2, -1)) * cfg.draws / (
        cfg.draws - 1) / g_norm2
    mc_bias = np.linalg.norm(mc_mean - g, axis=-1) / g_norm2 ** 0.5
    mc_error = np.linalg.norm(mc_mean - first, axis=-1) / g_norm2 ** 0.5
    return [{"name": name, "algo": algo, "perturbation": float(perturbation),
             "bias": float(bias[i]), "variance": float(variance[i]),
             "mse": float(bias[i] ** 2 + variance[i]),
             "mc_bias": float(mc_bias[i]), "mc_variance": float(mc_variance[i]),
             "mc_noise": float(np.sqrt(variance[i] / cfg.draws)),
             "mc_error": float(mc_error[i])} for i, (name, algo, _) in enumerate(specs)]


def format_table(rows: Sequence[dict]) -> str:
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
