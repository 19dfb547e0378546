"""The `figa` experiment: SFT on revisions vs DPO vs FIGA from one warm start (configs/figa.py).

Per seed: one pool of (original, revised) pairs sampled from the warm start and revised by the
addition oracle (:func:`jaxflow.align.build_pairs`), one batch order; every method trains a
fresh copy of the warm start on exactly those batches (rows interleaved revised, original) for
the same number of steps with the same optimizer, then the held-out curves are averaged over
seeds. Only the loss differs:

  sft            token-mean NLL of the revised rows (the original rows are ignored)
  dpo            DPO on (revised, original) sequence log-probs, frozen warm start as reference
  figa           :func:`jaxflow.align.figa_loss` (the paper's weights)
  figa_constant  the same with the reference code's constant weights

With ``lora.rank > 0`` (:func:`lora_policy`) every method trains fresh LoRA adapters over the
frozen warm start instead of all of its weights; evaluation samples the merged weights.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.align import (
    FigaConfig,
    PairData,
    Rows,
    addition_answers,
    build_pairs,
    concat_pairs,
    dpo_loss,
    figa_loss,
    interleave_rows,
    sequence_logp,
    sft_loss,
)
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.mesh import make_mesh
from jaxflow.models import lora
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import response_hidden
from jaxflow.rl.logprobs import fused_logprobs
from jaxflow.rl.rollout import RolloutSpec, RolloutWorker
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.train.lm_state import LMFunctions, lm_functions, model_optimizer
from jaxflow.train.loop import run_steps
from jaxflow.train.state import TrainState


class Policy(NamedTuple):
    """What every method trains (:func:`lora_policy`).

    Attributes:
      model_cfg: the trained model (the warm start's, with ``lora`` when on).
      fns: its :class:`LMFunctions` (the losses' forward; with adapters the base is frozen).
      params: the initial params (pure dict): the warm start, or it plus fresh adapters (B = 0).
      tx: the optimizer (with LoRA: moments and updates for the adapter leaves only).
      to_sampler: trained params -> the base-shaped params the warm start's sampler takes
        (identity, or the jitted :func:`jaxflow.models.lora.merge`).
    """

    model_cfg: TransformerConfig
    fns: LMFunctions
    params: Any
    tx: optax.GradientTransformation
    to_sampler: Callable[[Any], Any]


def lora_policy(model_cfg: TransformerConfig, lora_cfg: lora.LoraConfig, fns: LMFunctions, warm: Any,
                tx: optax.GradientTransformation, replicated: NamedSharding) -> Policy:
    """The :class:`Policy` for ``lora_cfg``: rank 0 returns ``model_cfg``, ``fns``, ``warm`` and
    ``tx`` themselves (full fine-tuning, unchanged); otherwise ``model_cfg`` with those adapters,
    ``warm`` plus fresh adapters (B = 0: it computes exactly the warm start, so it also serves
    as DPO's frozen reference), ``tx`` on the adapters only, and a merge for the sampler (all
    placed ``replicated``)."""
    if not lora_cfg.enabled:
        return Policy(model_cfg, fns, warm, tx, lambda params: params)
    cfg = dataclasses.replace(model_cfg, lora=lora_cfg)
    params = jax.device_put(lora.add_adapters(warm, cfg), replicated)
    merge = jax.jit(functools.partial(lora.merge, lora=lora_cfg), out_shardings=replicated)
    return Policy(cfg, lm_functions(cfg, replicated.mesh), params, model_optimizer(tx, cfg), merge)


def sample_pairs(worker: RolloutWorker, params: Any, task: AdditionRLTask,
                 tokenizer: CharTokenizer, data_cfg, *, seed: int, width: int) -> PairData:
    """The seed's pair pool: wrong, complete samples of ``params`` with oracle revisions."""
    rng = np.random.default_rng([seed, 0xF16A])
    key = jax.random.key(seed)
    g = worker.spec.group_size
    parts, total = [], 0
    for r in range(data_cfg.max_rounds):
        texts = task.prompts(rng, data_cfg.prompts_per_round)
        batch = worker.generate(params, texts, jax.random.fold_in(key, r))
        rows = [t for t in texts for _ in range(g)]
        part = build_pairs(rows, batch.prompts, batch.prompt_lengths, batch.tokens,
                           batch.rewards, tokenizer, addition_answers, length=width)
        if part is not None:
            parts.append(part)
            total += len(part.prompt_texts)
        if total >= data_cfg.pairs:
            break
    if not parts:
        raise RuntimeError("the warm start answered every sampled prompt correctly: no pairs")
    data = concat_pairs(parts)
    n = min(total, data_cfg.pairs)
    p = data.pairs
    return PairData(data.prompts[:n], data.prompt_lengths[:n], data.prompt_texts[:n],
                    type(p)(*(getattr(p, f)[:n] for f in p._fields)))


def batch_schedule(n_pairs: int, steps: int, per_batch: int, seed: int) -> np.ndarray:
    """[steps, per_batch] pair indices: epochs of fresh permutations, concatenated."""
    rng = np.random.default_rng([seed, 0xBA7C])
    need = steps * per_batch
    order = np.concatenate([rng.permutation(n_pairs) for _ in range(-(-need // n_pairs))])
    return order[:need].reshape(steps, per_batch)


def _row_logp(fns: LMFunctions, params, rows: Rows) -> jax.Array:
    hidden, head = response_hidden(fns, params, rows.prompts, rows.prompt_lengths, rows.tokens)
    return fused_logprobs(hidden, head, rows.tokens, temperature=1.0).target_logp


def method_loss(params, ref_params, rows: Rows, *, fns: LMFunctions, method: str,
                dpo_beta: float, figa: FigaConfig) -> tuple[jax.Array, dict]:
    """The loss of ``method`` on interleaved rows (even rows revised, odd rows original)."""
    logp = _row_logp(fns, params, rows)
    mask = rows.mask > 0
    if method == "sft":
        return sft_loss(logp[0::2], mask[0::2])
    if method == "dpo":
        seq = sequence_logp(logp, mask)
        ref = jax.lax.stop_gradient(sequence_logp(_row_logp(fns, ref_params, rows), mask))
        return dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=dpo_beta)
    weighting = "constant" if method == "figa_constant" else "figa"
    return figa_loss(logp, rows.marks, mask, rows.revised,
                     config=dataclasses.replace(figa, weighting=weighting))


def _compiled_step(fns: LMFunctions, method: str, dpo_beta: float, figa: FigaConfig,
                   replicated: NamedSharding):
    """The jitted train step ``(state, ref_params, rows) -> (state, metrics)`` (``state`` a
    :class:`TrainState`, ``ref_params`` the frozen warm start, ``rows`` interleaved [2P, ...]);
    everything in and out is replicated (a tiny model), so the first step's inputs and every
    later step's match and it compiles once."""
    loss_fn = functools.partial(method_loss, fns=fns, method=method, dpo_beta=dpo_beta,
                                figa=figa)

    @functools.partial(jax.jit, out_shardings=replicated)
    def step(state: TrainState, ref_params, rows):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params,
                                                                           ref_params, rows)
        return state.apply_gradients(grads), {"loss": loss, **metrics}

    return step


def train_method(step: Callable, state: TrainState, rows_at: Callable[[int], Rows], *, ref_params,
                 evaluate: Callable[[Any], dict], steps: int, log_every: int, eval_every: int,
                 run: RunContext | None, step_offset: int = 0,
                 row_fields: dict | None = None) -> tuple[list[dict], dict]:
    """Trains one (seed, method) cell: ``state, metrics = step(state, ref_params, rows_at(i))``
    for ``steps`` steps (:func:`jaxflow.train.loop.run_steps`).

    Rows ``{**row_fields, "step", metrics (every log_every steps and at the last), evaluation
    (every eval_every steps and at the last)}`` go to ``run.log(step_offset + step)``.

    Returns:
      (curve, first): curve ``[{"step", **evaluate(params)}]`` of the evaluated steps; first
      the first step's metrics as floats.
    """
    curve: list[dict] = []
    first: dict = {}

    def step_fn(state, i):
        state, metrics = step(state, ref_params, rows_at(i))
        if i == 0:
            first.update({k: float(v) for k, v in metrics.items()})
        return state, {"step": i + 1, "metrics": metrics}

    def eval_fn(state, done):
        ev = evaluate(state.params)
        curve.append({"step": done, **ev})
        return ev

    run_steps(step_fn, state, steps=steps, run=run, log_every=log_every,
              summarize=_row_every(log_every, steps), eval_fn=eval_fn, eval_every=eval_every,
              step_offset=step_offset, row_fields=row_fields)
    return curve, first


def _row_every(log_every: int, steps: int):
    """``run_steps`` rows of the figa log: ``step`` and, every ``log_every`` steps and at the
    last, that step's metrics as floats (the row of an evaluation-only step has no metrics)."""

    def summarize(window) -> dict:
        done, metrics = window[-1]["step"], window[-1]["metrics"]
        row = {"step": done}
        if done % log_every == 0 or done == steps:
            row.update({k: float(v) for k, v in metrics.items()})
        return row

    return summarize


def pair_stats(data: PairData) -> dict:
    """Sizes of the pool: pairs, mean edited tokens per side, mean response lengths."""
    p = data.pairs
    return {
        "pairs": int(len(data.prompt_texts)),
        "positive_per_pair": float(np.mean(np.sum(p.revised_marks == 1, 1))),
        "negative_per_pair": float(np.mean(np.sum(p.original_marks == -1, 1))),
        "original_len": float(np.mean(np.sum(p.original_mask, 1))),
        "revised_len": float(np.mean(np.sum(p.revised_mask, 1))),
    }


def main(config, run: RunContext) -> dict[str, Any]:
    start = time.time()
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])  # a tiny model: one device
    model_cfg = config.pretrain.model
    fns = lm_functions(model_cfg, mesh)
    warm, pre_summary = load_pretrained_params(config.pretrain, config.cache_root, fns,
                                               log=run.info)
    replicated = NamedSharding(mesh, PartitionSpec())
    warm = jax.device_put(warm, replicated)
    task = AdditionRLTask(max_digits=config.pretrain.data.max_digits,
                          heldout_mod=config.pretrain.data.heldout_mod)
    tok = CharTokenizer()
    width = task.max_completion_len + 1  # answer + EOS
    worker = RolloutWorker(model_cfg, mesh, RolloutSpec(
        group_size=config.data.samples_per_prompt, temperature=config.data.temperature,
        max_new_tokens=width), task, tok)
    tcfg = config.train

    def evaluate(params) -> dict:
        out = {"heldout_greedy": worker.heldout_accuracy(params, tcfg.eval_examples)}
        if tcfg.eval_samples:
            out["heldout_pass1"] = worker.heldout_accuracy(params, tcfg.eval_examples,
                                                           samples=tcfg.eval_samples)
        return out

    warm_eval = evaluate(warm)
    run.info(f"warm start held-out: {warm_eval}")
    tx = optax.chain(optax.clip_by_global_norm(tcfg.grad_clip), optax.adam(tcfg.lr))
    policy = lora_policy(model_cfg, config.lora, fns, warm, tx, replicated)
    lora_info = _lora_info(policy) if config.lora.enabled else None
    if lora_info:
        run.info(f"LoRA: {lora_info}")
    steps = {m: _compiled_step(policy.fns, m, config.dpo_beta, config.figa, replicated)
             for m in config.methods}
    init_shardings = jax.tree.map(lambda _: replicated, policy.params)

    def evaluate_policy(params) -> dict:  # the sampler gets base-shaped (merged) weights
        return evaluate(policy.to_sampler(params))

    run.set_total_steps(config.seeds * len(config.methods) * tcfg.steps, "figa")
    records, pools, global_step = [], [], 0
    for s in range(config.seed, config.seed + config.seeds):
        data = sample_pairs(worker, warm, task, tok, config.data, seed=s, width=width)
        stats = pair_stats(data)
        pools.append({"seed": s, **stats})
        run.info(f"seed {s}: {stats}")
        schedule = batch_schedule(stats["pairs"], tcfg.steps, tcfg.pairs_per_batch, s)
        for method in config.methods:
            curve, first_metrics = train_method(
                steps[method], TrainState.create(policy.tx, policy.params, init_shardings),
                lambda i: Rows(*(jax.device_put(x, replicated)
                                 for x in interleave_rows(data, schedule[i]))),
                ref_params=policy.params, evaluate=evaluate_policy, steps=tcfg.steps,
                log_every=tcfg.log_every,
                eval_every=tcfg.eval_every, run=run, step_offset=global_step,
                row_fields={"seed": s, "method": method})
            global_step += tcfg.steps
            curve = [{"step": 0, **warm_eval}] + curve
            records.append({"seed": s, "method": method, "curve": curve,
                            "final": curve[-1], "first_step_metrics": first_metrics})
            run.info(f"seed {s} {method}: {curve[-1]}")
    results = aggregate(records, config.methods)
    table = format_table(results, warm_eval)
    run.info("\n" + table)
    run.write_json("records.json", records)
    plot_curves(run, records, config.methods)
    return {
        "results": results,
        **({"lora": lora_info} if lora_info else {}),
        "table": table,
        "warm_start": {"cache": cache_dir(config.pretrain, config.cache_root).name,
                       "pretrain_heldout_accuracy": pre_summary.get("heldout_accuracy"),
                       **warm_eval},
        "pair_pools": pools,
        "seeds": config.seeds,
        "study_seconds": time.time() - start,
    }


def _lora_info(policy: Policy) -> dict:
    """The adapters' size: rank, alpha, targets, trainable (adapter) and frozen (base) params."""
    cfg = policy.model_cfg.lora
    count = lambda tree: int(sum(x.size for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"rank": cfg.rank, "alpha": cfg.alpha, "targets": list(cfg.targets),
            "adapter_params": count(lora.adapters(policy.params)),
            "base_params": count(lora.strip(policy.params))}


def aggregate(records: list[dict], methods) -> list[dict]:
    """Per method: final held-out accuracies' mean / sample std / min / max over seeds, and the
    seed-mean curve."""
    out = []
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        row = {"method": m, "seeds": len(recs)}
        for key in ("heldout_greedy", "heldout_pass1"):
            vals = [r["final"][key] for r in recs if key in r["final"]]
            if vals:
                row[f"{key}_mean"] = float(np.mean(vals))
                row[f"{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
                row[f"{key}_min"], row[f"{key}_max"] = float(min(vals)), float(max(vals))
        steps = [c["step"] for c in recs[0]["curve"]]
        row["curve"] = [{"step": st, **{k: float(np.mean([r["curve"][i][k] for r in recs]))
                                        for k in recs[0]["curve"][i] if k != "step"}}
                        for i, st in enumerate(steps)]
        neg = [r["first_step_metrics"] for r in recs if "negative_tokens" in
               r["first_step_metrics"]]
        if neg:
            row["negative_kept_fraction_first_step"] = float(
                np.sum([n["negative_kept"] for n in neg]) /
                max(np.sum([n["negative_tokens"] for n in neg]), 1))
        out.append(row)
    return out


def format_table(results: list[dict], warm_eval: dict) -> str:
    """Markdown: one row per method, final held-out accuracy mean +- std (min..max)."""
    pass1 = "heldout_pass1_mean" in results[0]
    head = "| method | seeds | held-out greedy acc | " + ("held-out pass@1 (T=1) |" if pass1 else "")
    lines = [head, "|---|---|---|" + ("---|" if pass1 else "")]
    w = f"| warm start | - | {warm_eval['heldout_greedy']:.3f} | "
    lines.append(w + (f"{warm_eval['heldout_pass1']:.3f} |" if pass1 else ""))
    for r in results:
        def cell(k, r=r):
            return (f"{r[k + '_mean']:.3f} +- {r[k + '_std']:.3f} "
                    f"({r[k + '_min']:.3f}..{r[k + '_max']:.3f})")

        line = f"| {r['method']} | {r['seeds']} | {cell('heldout_greedy')} | "
        lines.append(line + (f"{cell('heldout_pass1')} |" if pass1 else ""))
    return "\n".join(lines)


def plot_curves(run: RunContext, records: list[dict], methods) -> None:
    """plots/figa_curves.png: seed-mean held-out greedy accuracy vs step, min..max band."""
    if not run.is_primary:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for m in methods:
        recs = [r for r in records if r["method"] == m]
        x = [c["step"] for c in recs[0]["curve"]]
        y = np.array([[c["heldout_greedy"] for c in r["curve"]] for r in recs])
        ax.plot(x, y.mean(0), label=m)
        ax.fill_between(x, y.min(0), y.max(0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"figa: seed mean ({len(recs)} seeds), band = min..max", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    run.save_figure(fig, "figa_curves.png")
