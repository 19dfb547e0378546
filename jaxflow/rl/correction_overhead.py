"""Each correction's policy-loss step overhead: alternated (none, correction) timing pairs.

``bench_policy_loss`` times the SIS loss step against ``correction="none"`` on a synthetic
rollout (:func:`jaxflow.rl.policy_loss_bench.make_rollout`: fused log-probs from hidden states
and an LM head, then the policy loss, value and gradient w.r.t. both). :func:`loss_step_overheads`
runs the same step for every correction of a list, with a behaviour policy mu = pi_old's
log-probs plus Gaussian noise (std ``behaviour_noise``, so the behaviour corrections mask and
weigh as they would under a mismatch) and mu's top-K log-probs at pi_old's top-K tokens
(``sis_b``'s envelope), and alternates (none, correction) pairs. :func:`recorded_sis_overhead`
reads the SIS figure of the latest ``bench_policy_loss`` results record.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.policy_loss import PolicyLossConfig, policy_loss
from jaxflow.rl.policy_loss_bench import make_rollout, timed_call

__all__ = ["correction_step", "loss_step_overheads", "recorded_sis_overhead", "cached_overheads"]


def correction_step(bench, correction: str) -> Callable:
    """jit(value_and_grad) w.r.t. (hidden, head) of the loss step with ``correction``
    (``bench``: ``configs.bench_policy_loss.Config``). Arguments: hidden [B, T, d], head [d, V],
    targets [B, T], old_logp [B, T], old_topk_idx / old_topk_logp [B, T, K], behaviour_logp
    [B, T], behaviour_topk_logp [B, T, K], advantages [B], mask [B, T], key."""
    cfg = PolicyLossConfig(algo=bench.algo, correction=correction)
    topk = cfg.uses_sis

    def loss_fn(hidden, head, targets, old_logp, old_topk_idx, old_topk_logp, behaviour_logp,
                behaviour_topk_logp, advantages, mask, key):
        out = fused_logprobs(hidden, head, targets, old_topk_idx if topk else None, temperature=bench.temperature,
                             backend=bench.backend, vocab_tile=bench.vocab_tile)
        proposal_b = cfg.sis_proposal == "behaviour"
        return policy_loss(out.target_logp, old_logp, advantages, mask, config=cfg, key=key if topk else None,
                           old_topk_logp=old_topk_logp if topk and not proposal_b else None,
                           new_topk_logp=out.topk_logp if topk else None,
                           behaviour_logp=behaviour_logp if cfg.needs_behaviour_logp else None,
                           behaviour_topk_logp=behaviour_topk_logp if proposal_b else None)

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))


def loss_step_overheads(bench, corrections: Sequence[str], *, key: jax.Array, pairs: int,
                        behaviour_noise: float = 0.1, log: Callable[[str], None] = lambda _: None,
                        ) -> dict[str, dict[str, Any]]:
    """``{correction: {"ratio_median", "ratio_min", "ratio_max", "pairs", "step_seconds_median",
    "source"}}`` for every correction but none: ``pairs`` alternated (none, correction) timings of
    :func:`correction_step` after one compiling and one warm-up call each; the ratio is the
    correction's wall time over the same pair's none."""
    k_data, k_noise, k_loop = jax.random.split(key, 3)
    data, _ = make_rollout(bench, k_data)
    noise = behaviour_noise * jax.random.normal(k_noise, data["old_topk_logp"].shape)
    args = (data["hidden"], data["head"], data["targets"], data["old_logp"], data["old_topk_idx"],
            data["old_topk_logp"], data["old_logp"] + noise[..., 0], data["old_topk_logp"] + noise,
            data["advantages"], data["mask"])
    keys = iter(jax.random.split(k_loop, 2 * (pairs + 2) * len(corrections) + 4))
    none = correction_step(bench, "none")
    for _ in range(2):
        timed_call(none, (*args, next(keys)))
    out = {}
    for corr in corrections:
        if corr == "none":
            continue
        step = correction_step(bench, corr)
        for _ in range(2):  # compile, warm up
            timed_call(step, (*args, next(keys)))
        times = {"none": [], corr: []}
        for _ in range(pairs):
            for name, fn in (("none", none), (corr, step)):
                times[name].append(timed_call(fn, (*args, next(keys)))[0])
        ratios = np.asarray(times[corr]) / np.asarray(times["none"])
        out[corr] = {"ratio_median": float(np.median(ratios)), "ratio_min": float(ratios.min()),
                     "ratio_max": float(ratios.max()), "pairs": pairs,
                     "step_seconds_median": float(np.median(times[corr])),
                     "source": f"alternated loss-step pairs, bench_policy_loss quick shapes "
                               f"({bench.batch}x{bench.seq_len} tokens, V {bench.vocab})"}
        log(f"overhead {corr}: {out[corr]['ratio_median']:.3f} [{out[corr]['ratio_min']:.3f}, "
            f"{out[corr]['ratio_max']:.3f}]")
    return out


def recorded_sis_overhead(results_dir: str | pathlib.Path = "experiments/results/bench_policy_loss",
                          ) -> dict[str, Any] | None:
    """The ``sis_overhead`` headline of the newest ``bench_policy_loss`` record under
    ``results_dir`` (by its ``started`` field): ``{"ratio_median", "ratio_min", "ratio_max",
    "pairs", "source"}``, or None without a record."""
    found = []
    for path in sorted(pathlib.Path(results_dir).glob("*.json")):
        rec = json.loads(path.read_text())
        head = next((h for h in rec.get("headlines", []) if h.get("name") == "sis_overhead"), None)
        if head is not None:
            found.append((rec.get("started", ""), path, rec, head))
    if not found:
        return None
    started, path, rec, head = max(found, key=lambda f: (f[0], str(f[1])))
    spread = head.get("spread") or {}
    load = rec.get("load")
    if isinstance(load, dict):  # the results records' {"start_1min", "end_1min"}
        load = f"{load.get('start_1min')} -> {load.get('end_1min')}"
    return {"ratio_median": head["value"], "ratio_min": spread.get("low"), "ratio_max": spread.get("high"),
            "pairs": spread.get("n"), "source": f"{path.name} (bench_policy_loss {rec.get('variant')} at "
                                                f"{str(rec.get('commit', ''))[:7]}, load {load})"}


def cached_overheads(run, compute: Callable[[], dict], *, filename: str = "overheads.json") -> dict:
    """``compute()``'s overheads, measured once per run directory: read back from ``filename``
    in ``run.out_dir`` when a previous (resumed) process wrote it, else computed and written."""
    path = run.out_dir / filename
    if path.exists():
        return json.loads(path.read_text())
    out = compute()
    run.write_json(filename, out)
    return out
