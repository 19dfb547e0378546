"""Off-policy gradient estimators against the exact gradient of an enumerable toy policy.

The ``sis_exact_gradient`` experiment (``jaxflow/main/sis_exact_gradient.py``) runs this through
:mod:`jaxflow.rl.exact_gradient_study` (the toy problem, the sampled moments, the table).

Design
------
* Policy: tabular softmax logits ``theta[context, token]``, one row per prefix of length
  0 .. L-1 (``sum_t V**t`` contexts; 211 x 14 for V = 14, L = 3). Responses have exactly L
  tokens (no EOS), so all ``V**L`` responses (2744) are enumerable.
* Objective: ``J(theta) = E_{y ~ pi_theta}[R(y)]`` with R a fixed random 0/1 table. The exact
  gradient ``g = grad J`` comes from autodiff through the enumeration.
* Data: responses sampled from a behaviour policy ``mu`` with logits ``theta + p * eps`` (one
  fixed Gaussian direction eps, perturbation size p). p = 0 is the on-policy sanity row: every
  estimator must then be unbiased (bias at the Monte Carlo noise floor).
* Advantage: ``A = R - b`` with the constant ``b = E_mu[R]`` (exact). A constant baseline adds
  no bias to any estimator that is unbiased without it; a sampled group mean / std would add its
  own O(1/n) bias and scale change, which are not what this study measures.
* Each estimator is ``-grad_theta`` of a surrogate loss at the current theta, aggregated with
  ``seq-mean-token-sum`` over the draw's ``batch`` responses, so its target is g itself:
  - ``seq_is``: ``mean_i prod_t w_it * A_i * sum_t grad log pi``. Unbiased for g; the reference.
  - ``token_is`` (algo "token_is", correction none): ``sum_t w_t A grad log pi_t``
    (library grpo with the clip and the dual clip disabled). Per-token unbiased for the token's own choice, but
    the prefix and the future come from mu: biased for g, to first order in the policy gap.
  - algo grpo / dapo / gspo / cispo, correction none: the library's clipped surrogates (grpo
    0.2/0.2, dapo 0.2/0.28, both with the default dual clip c = 3; gspo sequence ratio with
    3e-4/4e-4, cispo truncation at 1.28).
    Clipping / truncation adds bias and removes variance.
  - algo sa_gcpo (correction none / sis): OxygenREC's soft gate
    ``sigmoid(tau (r - 1)) * 4 / tau`` (tau 2 / 5 for A > 0 / < 0) in place of the clip, with
    this study's aggregation (seq-mean-token-sum, so its target is g; its default token mean
    would target g / L) and no target-reward gate (no per-request targets here).
  - the same five plus token_is with correction ``sis``: old = mu, the SIS envelope over mu's
    top-K (K = vocab: exact). An accepted token contributes ``A grad log pi`` (weight 1), a
    rejected one the base estimator's term. Note: even for the token's own choice this is not
    unbiased -- in expectation over the accept coin the token term is
    ``E_pi[f] + (E_pi[f] - E_pi[w f]) / M`` -- and prefixes / futures still come from mu. The
    study measures whether trading that for lower variance (fewer large ratios) pays off.
  - ``tis`` / ``mis`` (algo grpo): the mismatch setting the library's TIS / MIS are for: the
    trainer's old policy is the current one (``old_logp = sg(logp)``, ratio 1) and
    ``behaviour_logp = log mu``; weights ``min(pi / mu, 2)`` / ``pi / mu`` inside [0.5, 2].
* Exact numbers (``bias``, ``variance``): E[g_hat] and E||g_hat||^2 of a one-response estimate
  are computed exactly by enumerating every response (weight mu(y)) and, for SIS rows, every
  accept pattern of its L tokens (2**L, weight prod_t P(accept_t) or 1 - P(accept_t), with
  P(accept) = min(1, w / M) from the library's own envelope); SIS is evaluated through
  ``policy_loss(..., uniforms=...)`` with uniforms 0 (accept) / 1 (reject). Then
  bias = ``||E[g_hat] - g|| / ||g||`` and variance = ``E||g_hat - E g_hat||^2 / ||g||^2`` for a
  draw that averages ``batch`` independent responses (one-response variance / batch);
  ``mse = bias**2 + variance``.
* Sampled numbers (``mc_bias``, ``mc_variance``) over ``draws`` (>= 1000) vmapped draws, each
  ``batch`` responses from mu and fresh SIS uniforms (shared by the SIS rows of one draw), as
  a training run would see them. ``mc_noise = sqrt(variance / draws)`` is their Monte Carlo
  floor and ``mc_error = ||mean_draws(g_hat) - E[g_hat]|| / ||g||`` should be about
  ``mc_noise``: the check that the enumeration and the sampler agree. Sums are float64.
* Limits: fixed length (no EOS, no length effects for GSPO / aggregation), one random
  perturbation direction, a random 0/1 reward table, one seed; results are for this toy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.rl import sis
from jaxflow.rl.policy_loss import PolicyLossConfig, policy_loss

INF = float("inf")
BASE_ALGOS = ("token_is", "grpo", "dapo", "gspo", "cispo", "sa_gcpo")


def context_ids(tokens: jax.Array, vocab: int) -> jax.Array:
    """[..., L] tokens -> [..., L] row of theta used at each position (its prefix's id)."""
    ids, offset = [], 0
    prefix = jnp.zeros(tokens.shape[:-1], jnp.int32)
    for t in range(tokens.shape[-1]):
        ids.append(offset + prefix)
        offset += vocab ** t
        prefix = prefix * vocab + tokens[..., t]
    return jnp.stack(ids, axis=-1)


def num_contexts(vocab: int, length: int) -> int:
    return sum(vocab ** t for t in range(length))


def all_responses(vocab: int, length: int) -> jax.Array:
    """[V**L, L] every response, in lexicographic order."""
    grid = np.indices((vocab,) * length).reshape(length, -1).T
    return jnp.asarray(grid, jnp.int32)


def token_logp(theta: jax.Array, tokens: jax.Array, ctx: jax.Array) -> jax.Array:
    """[..., L] log pi(y_t | y_<t) under tabular logits theta [C, V]."""
    lsm = jax.nn.log_softmax(theta, axis=-1)
    return lsm[ctx, tokens]


def exact_gradient(theta, responses, ctx, rewards) -> tuple[jax.Array, jax.Array]:
    """(J, grad J) by enumeration."""
    def objective(th):
        return jnp.sum(jnp.exp(jnp.sum(token_logp(th, responses, ctx), -1)) * rewards)
    return jax.value_and_grad(objective)(theta)


def estimator_specs(cfg) -> list[tuple[str, str, PolicyLossConfig | None]]:
    """(name, algo, loss config) rows; loss config None marks sequence IS."""
    common = dict(agg="seq-mean-token-sum", tis_cap=cfg.tis_cap, mis_low=cfg.mis_low,
                  mis_high=cfg.mis_high)
    specs: list[tuple[str, str, PolicyLossConfig | None]] = [("seq_is", "seq_is", None)]
    for algo in BASE_ALGOS:
        unclipped = dict(algo="grpo", clip_eps_low=INF, clip_eps_high=INF, dual_clip_c=None)
        kw = unclipped if algo == "token_is" else dict(algo=algo)
        for correction in ("none", "sis"):
            specs.append((correction, algo, PolicyLossConfig(correction=correction, **kw,
                                                             **common)))
    for correction in ("tis", "mis"):
        specs.append((correction, "grpo", PolicyLossConfig(correction=correction, **common)))
    return specs


def estimator_gradients(theta, lsm_mu, top_idx, y, adv, uniforms, *, vocab, specs):
    """Each estimator's estimate of g from one batch: responses y [n, L] from mu (log-softmax
    ``lsm_mu`` [C, V], its top-K ``top_idx`` [C, K]), advantages ``adv`` [n], SIS uniforms [n, L]
    -> ([E, C*V] estimates, one per row of ``specs``; the first SIS row's accept-rate /
    D_original / D_sis stats)."""
    ctx = context_ids(y, vocab)
    mask = jnp.ones(y.shape, bool)
    old = lsm_mu[ctx, y]
    top = top_idx[ctx]  # [n, L, K]
    old_topk = jnp.take_along_axis(lsm_mu[ctx], top, axis=-1)

    def surrogate(th, loss_cfg):
        lsm = jax.nn.log_softmax(th, axis=-1)
        logp = lsm[ctx, y]
        if loss_cfg is None:  # sequence IS
            return -jnp.mean(jnp.exp(jnp.sum(logp - old, -1)) * adv), {}
        if loss_cfg.correction in ("tis", "mis"):  # on-policy trainer, mismatched sampler
            return policy_loss(logp, jax.lax.stop_gradient(logp), adv, mask, config=loss_cfg,
                               behaviour_logp=old)
        new_topk = jnp.take_along_axis(lsm[ctx], top, axis=-1)
        return policy_loss(logp, old, adv, mask, config=loss_cfg, uniforms=uniforms,
                           old_topk_logp=old_topk, new_topk_logp=new_topk)

    grads, stats = [], {}
    for _, _algo, loss_cfg in specs:
        g, metrics = jax.grad(surrogate, has_aux=True)(theta, loss_cfg)
        grads.append(-g.reshape(-1))
        if loss_cfg is not None and loss_cfg.uses_sis and not stats:
            stats = {k: metrics[k] for k in ("accept_rate", "d_original", "d_sis")}
    return jnp.stack(grads), stats


def accept_probabilities(theta, lsm_mu, top_idx, y, vocab):
    """[n, L] P(accept) = min(1, w / M) (1 where log_w == 0), as the library's rule implies."""
    ctx = context_ids(y, vocab)
    lsm = jax.nn.log_softmax(theta, axis=-1)
    log_w = sis.clipped_log_ratio(lsm[ctx, y], lsm_mu[ctx, y])
    top = top_idx[ctx]
    log_m = sis.sis_log_envelope(log_w, jnp.take_along_axis(lsm[ctx], top, -1),
                                 jnp.take_along_axis(lsm_mu[ctx], top, -1))
    return jnp.where(log_w == 0, 1.0, jnp.exp(jnp.minimum(log_w - log_m, 0.0)))


def _split_specs(specs):
    plain = [s for s in specs if s[2] is None or not s[2].uses_sis]
    with_sis = [s for s in specs if s[2] is not None and s[2].uses_sis]
    return plain, with_sis


@functools.partial(jax.jit, static_argnames=("vocab", "plain", "with_sis"))
def _exact_chunk(theta, lsm_mu, top_idx, y, weight, adv, *, vocab, plain, with_sis):
    """Sums over responses y [m, L] (weights mu(y) [m]) of w * g_hat and w * ||g_hat||^2."""
    length = y.shape[1]
    patterns = jnp.asarray(np.indices((2,) * length).reshape(length, -1).T, bool)  # [2**L, L]

    def one(yy, aa, uu, specs):
        return estimator_gradients(theta, lsm_mu, top_idx, yy[None], aa[None], uu[None],
                                   vocab=vocab, specs=specs)[0]

    rejects = jnp.ones(y.shape, jnp.float32)
    g_plain = jax.vmap(lambda yy, aa, uu: one(yy, aa, uu, plain))(y, adv, rejects)
    first = [jnp.einsum("m,mep->ep", weight, g_plain)]
    second = [jnp.einsum("m,me->e", weight, jnp.sum(g_plain ** 2, -1))]
    if with_sis:
        p_acc = accept_probabilities(theta, lsm_mu, top_idx, y, vocab)  # [m, L]
        pat_w = jnp.prod(jnp.where(patterns[None], p_acc[:, None], 1 - p_acc[:, None]), -1)
        u = jnp.where(patterns, 0.0, 1.0)  # 0 forces accept, 1 forces reject
        g_sis = jax.vmap(lambda yy, aa: jax.vmap(lambda uu: one(yy, aa, uu, with_sis))(u))(
            y, adv)  # [m, 2**L, E_sis, P]
        w_sis = weight[:, None] * pat_w  # [m, 2**L]
        first.append(jnp.einsum("mk,mkep->ep", w_sis, g_sis))
        second.append(jnp.einsum("mk,mke->e", w_sis, jnp.sum(g_sis ** 2, -1)))
    return jnp.concatenate(first), jnp.concatenate(second)


def exact_moments(theta, lsm_mu, top_idx, responses, rewards, baseline, *, cfg, specs):
    """Exact E[g_hat_1] [E, P] and E||g_hat_1||^2 [E] for one response (batch 1), enumerating
    every response and, for SIS rows, every accept pattern of its L tokens (2**L of them)
    weighted by prod_t P(accept_t) or 1 - P(accept_t)."""
    plain, with_sis = _split_specs(specs)
    mu = jnp.exp(jnp.sum(lsm_mu[context_ids(responses, cfg.vocab), responses], -1))
    adv = rewards - baseline
    n_resp = responses.shape[0]
    first = np.zeros((len(specs), theta.size))
    second = np.zeros(len(specs))
    for lo in range(0, n_resp, cfg.exact_chunk):
        sl = slice(lo, min(lo + cfg.exact_chunk, n_resp))
        f, s = _exact_chunk(theta, lsm_mu, top_idx, responses[sl], mu[sl], adv[sl],
                            vocab=cfg.vocab, plain=tuple(plain), with_sis=tuple(with_sis))
        first += np.asarray(f, np.float64)
        second += np.asarray(s, np.float64)
    order = [sp[:2] for sp in plain + with_sis]
    perm = [order.index(sp[:2]) for sp in specs]
    return first[perm], second[perm]
