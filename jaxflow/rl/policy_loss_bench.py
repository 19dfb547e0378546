"""The ``bench_policy_loss`` experiment's arms: the SIS loss step's overhead and memory, and one
GRPO iteration with and without the separate pi_old forward.

The loss arm builds a synthetic rollout (pi_old = a random head, the current policy = that head
plus noise), stores pi_old's own top-K with the fused path (the "old log-prob" pass), then times
the training loss step (fused log-probs + policy loss, value and gradient w.r.t. hidden states
and head) with correction="sis" against correction="none", interleaved
(:func:`loss_step_timing`), and reports XLA's compiled temp/output bytes of the fused vs the
naive (logit-materialising) step (:func:`memory_figures`).

The ``grpo_iteration`` arm (:func:`grpo_iteration`): one GRPO iteration
(:meth:`jaxflow.rl.grpo.GRPOTrainer.step`: rollout, update, publish) at lag 1 without SIS or KL,
with the separate pi_old forward (``reuse_forward=False``, before) against pi_old's log-probs
from the update's own forward (``reuse_forward=True``, after), alternated for ``pairs`` pairs:
process CPU seconds beside wall seconds, medians.

Config: ``configs.bench_policy_loss.Config``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.experiment import RunContext
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.policy_loss import PolicyLossConfig, policy_loss

__all__ = ["GRPO_SHAPES", "make_rollout", "make_step", "loss_args", "timed_call", "step_bytes",
           "loss_step_timing", "memory_figures", "grpo_iteration"]

#: The GRPO iteration arm's shapes: the flagship's tiny policy on 1-digit addition.
GRPO_SHAPES = dict(prompts_per_rollout=8, group_size=8, max_new_tokens=4)


def make_rollout(config, key: jax.Array) -> tuple[dict[str, jax.Array], Any]:
    """(data, the jitted pi_old pass): hidden states [B, T, d], heads [d, V] (pi_old's and the
    current policy's), sampled tokens [B, T], pi_old's log-probs [B, T] and top-K [B, T, K],
    advantages [B], mask [B, T] (``config``: ``configs.bench_policy_loss.Config``)."""
    B, T, d, V, K = config.batch, config.seq_len, config.d_model, config.vocab, config.topk
    k_h, k_w, k_noise, k_pick, k_adv, k_len = jax.random.split(key, 6)
    hidden = jax.random.normal(k_h, (B, T, d), jnp.float32)
    # Logit std ~ 2: a peaked but not degenerate next-token distribution.
    head_old = 2.0 / np.sqrt(d) * jax.random.normal(k_w, (d, V), jnp.float32)
    head = head_old + config.perturbation * 2.0 / np.sqrt(d) * jax.random.normal(k_noise, (d, V))

    @jax.jit
    def old_pass(hidden, head_old):
        return fused_logprobs(hidden, head_old, jnp.zeros((B, T), jnp.int32), own_topk=K,
                              temperature=config.temperature, backend=config.backend,
                              vocab_tile=config.vocab_tile)

    out = old_pass(hidden, head_old)
    # Sampled tokens: one of pi_old's top-K (where almost all sampled mass lies).
    pick = jax.random.randint(k_pick, (B, T, 1), 0, K)
    targets = jnp.take_along_axis(out.own_topk_indices, pick, axis=-1)[..., 0]
    old_logp = jnp.take_along_axis(out.own_topk_logp, pick, axis=-1)[..., 0]
    lengths = jax.random.randint(k_len, (B, 1), T // 2, T + 1)
    mask = jnp.arange(T)[None, :] < lengths
    return dict(hidden=hidden, head=head, targets=targets, old_logp=old_logp,
                old_topk_idx=out.own_topk_indices, old_topk_logp=out.own_topk_logp,
                advantages=jax.random.normal(k_adv, (B,)), mask=mask), old_pass


def make_step(config, correction: str, backend: str):
    """jit(value_and_grad) of the loss step w.r.t. (hidden, head)."""
    loss_cfg = PolicyLossConfig(algo=config.algo, correction=correction)
    need_topk = "sis" in correction

    def loss_fn(hidden, head, targets, old_logp, old_topk_idx, old_topk_logp, advantages, mask,
                key):
        out = fused_logprobs(hidden, head, targets, old_topk_idx if need_topk else None,
                             temperature=config.temperature, backend=backend,
                             vocab_tile=config.vocab_tile)
        return policy_loss(out.target_logp, old_logp, advantages, mask, config=loss_cfg,
                           key=key if need_topk else None,
                           old_topk_logp=old_topk_logp if need_topk else None,
                           new_topk_logp=out.topk_logp)

    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))


def loss_args(data: dict, key: jax.Array) -> tuple:
    """The loss step's positional arguments from :func:`make_rollout`'s ``data`` and a key."""
    return (data["hidden"], data["head"], data["targets"], data["old_logp"], data["old_topk_idx"],
            data["old_topk_logp"], data["advantages"], data["mask"], key)


def timed_call(step, args) -> tuple[float, Any]:
    """(wall seconds, outputs) of ``step(*args)``, blocked on the outputs."""
    start = time.perf_counter()
    out = step(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start, out


def step_bytes(config, backend: str, args: tuple) -> dict[str, int]:
    """Compiled temp and output bytes of the SIS loss step (no execution)."""
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    mem = make_step(config, "sis", backend).lower(*specs).compile().memory_analysis()
    return {"temp": int(mem.temp_size_in_bytes), "output": int(mem.output_size_in_bytes)}


def loss_step_timing(config, run: RunContext, key: jax.Array) -> tuple[dict[str, Any], dict]:
    """The loss arm: the SIS and the plain loss step (:func:`make_step`) on one synthetic
    rollout, compiled and warmed up, then ``config.pairs`` alternated timings (a row per pair).
    Returns (the summary's loss figures: median / range of the sis / none ratios, medians,
    tokens per second, the accept rate; the rollout ``data``)."""
    k_data, k_loop = jax.random.split(key)
    t0 = time.perf_counter()
    data, old_pass = make_rollout(config, k_data)
    jax.block_until_ready(data)
    run.info(f"rollout + old-logprob pass (incl. compile) {time.perf_counter() - t0:.1f}s")
    old_pass_s, _ = timed_call(old_pass, (data["hidden"], data["head"]))

    steps = {"none": make_step(config, "none", config.backend),
             "sis": make_step(config, "sis", config.backend)}
    keys = iter(jax.random.split(k_loop, 2 * (config.pairs + config.warmup + 1)))
    compile_s, metrics = {}, {}
    for name, step in steps.items():  # warm-up: compile + `warmup` runs
        compile_s[name], ((_, metrics[name]), _) = timed_call(step, loss_args(data, next(keys)))
        for _ in range(config.warmup):
            timed_call(step, loss_args(data, next(keys)))
    run.info(f"compiled + warmed up ({compile_s})")

    run.set_total_steps(config.pairs, "none/sis pairs")
    times: dict[str, list[float]] = {"none": [], "sis": []}
    for i in range(config.pairs):
        for name in ("none", "sis"):  # A B A B ...
            seconds, _ = timed_call(steps[name], loss_args(data, next(keys)))
            times[name].append(seconds)
        run.log(i + 1, {"none_s": times["none"][-1], "sis_s": times["sis"][-1],
                        "ratio": times["sis"][-1] / times["none"][-1]})
    ratios = np.asarray(times["sis"]) / np.asarray(times["none"])
    tokens = config.batch * config.seq_len
    return {
        "sis_overhead_ratio": float(np.median(ratios)),
        "sis_overhead_ratio_min": float(ratios.min()),
        "sis_overhead_ratio_max": float(ratios.max()),
        "sis_overhead_ratios": ratios.tolist(),
        # Less sensitive to other processes' load on a shared machine than the paired ratio.
        "sis_overhead_ratio_of_min_times": min(times["sis"]) / min(times["none"]),
        "none_step_seconds_median": float(np.median(times["none"])),
        "sis_step_seconds_median": float(np.median(times["sis"])),
        "none_tokens_per_second": tokens / float(np.median(times["none"])),
        "old_pass_seconds": old_pass_s,
        "tokens": tokens,
        "accept_rate": float(metrics["sis"]["accept_rate"]),
        "target_sis_overhead_ratio": 1.03,
    }, data


def memory_figures(config, data: dict, key: jax.Array) -> dict[str, Any]:
    """XLA's compiled temp / output bytes of the fused SIS loss step against the naive
    (logit-materialising, ``backend="reference"``) one, and their ratios."""
    args = loss_args(data, key)
    fused = step_bytes(config, config.backend, args)
    naive = step_bytes(config, "reference", args)
    tokens = config.batch * config.seq_len
    return {
        "fused_temp_bytes": fused["temp"],
        "naive_temp_bytes": naive["temp"],
        "fused_output_bytes": fused["output"],
        "naive_output_bytes": naive["output"],
        "fused_to_naive_temp_ratio": fused["temp"] / naive["temp"],
        "fused_to_naive_bytes_ratio": (fused["temp"] + fused["output"])
        / (naive["temp"] + naive["output"]),
        "logits_bytes": tokens * config.vocab * 4,
        "target_fused_to_naive_bytes_ratio": 0.125,
    }


def grpo_iteration(config, run: RunContext) -> dict[str, Any]:
    """The GRPO iteration's CPU and wall seconds with the separate pi_old forward ("before",
    ``reuse_forward=False``) and without it ("after"), ``config.pairs`` alternated pairs after
    one compiling and ``config.warmup`` untimed iterations per arm; medians, ranges, and the
    update phase alone (the row's ``timing_s/update``)."""
    import dataclasses

    from jaxflow.data.tokenizer import CharTokenizer
    from jaxflow.mesh import role_meshes
    from jaxflow.models.transformer_config import PRESETS
    from jaxflow.rl.grpo import GRPOConfig, GRPOTrainer
    from jaxflow.rl.tasks import AdditionRLTask
    from jaxflow.train.lm_state import OptimConfig, init_params

    tok = CharTokenizer()
    model = dataclasses.replace(PRESETS["tiny"], vocab_size=tok.vocab_size)
    n = len(jax.devices())  # disjoint halves; one device: colocated
    meshes = (role_meshes({"trainer": n // 2, "rollout": n - n // 2}) if n > 1
              else dict.fromkeys(("trainer", "rollout"), role_meshes({"trainer": 1})["trainer"]))
    arms, states = {}, {}
    for name, reuse in (("before", False), ("after", True)):
        cfg = GRPOConfig(reuse_forward=reuse, **GRPO_SHAPES)
        arms[name] = GRPOTrainer(model, cfg, OptimConfig(lr=1e-3, warmup_steps=0),
                                 AdditionRLTask(max_digits=1), tok, meshes, seed=config.seed,
                                 total_rollouts=config.pairs + config.warmup + 1)
        states[name] = arms[name].init_state(init_params(arms[name].fns, model, jax.random.key(0)))
    assert arms["after"].config.old_from_update and not arms["before"].config.old_from_update
    for name in arms:  # compile + warm-up
        for _ in range(1 + config.warmup):
            states[name], _ = arms[name].step(states[name])
    times: dict[str, dict[str, list[float]]] = {a: {"cpu": [], "wall": [], "update": []} for a in arms}
    # rows after the loss arm's: steps pairs + 1 .. 2 * pairs
    for i in range(config.pairs):
        for name in ("before", "after"):  # A B A B ...
            cpu, wall = time.process_time(), time.perf_counter()
            states[name], row = arms[name].step(states[name])
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
            times[name]["update"].append(row["timing_s/update"])
        run.log(config.pairs + i + 1, {"grpo_before_cpu_s": times["before"]["cpu"][-1],
                        "grpo_after_cpu_s": times["after"]["cpu"][-1]})
    out: dict[str, Any] = {"pairs": config.pairs, "shapes": GRPO_SHAPES, "model": "tiny",
                           "load_1min": os.getloadavg()[0]}
    for name, t in times.items():
        for kind, vals in t.items():
            out[f"{name}_{kind}_s_median"] = float(np.median(vals))
            out[f"{name}_{kind}_s_range"] = [float(min(vals)), float(max(vals))]
    cpu_ratio = np.asarray(times["after"]["cpu"]) / np.asarray(times["before"]["cpu"])
    out["after_over_before_cpu_median"] = float(np.median(cpu_ratio))
    out["after_over_before_cpu_range"] = [float(cpu_ratio.min()), float(cpu_ratio.max())]
    run.info(f"GRPO iteration CPU s median: before {out['before_cpu_s_median']:.4f}, after "
             f"{out['after_cpu_s_median']:.4f} (after/before {out['after_over_before_cpu_median']:.3f})")
    return out
