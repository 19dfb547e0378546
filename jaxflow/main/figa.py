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

With ``lora.rank > 0`` (:func:`jaxflow.align.policy.lora_policy`) every method trains fresh
LoRA adapters over the frozen warm start instead of all of its weights; evaluation samples the
merged weights. The pieces live in :mod:`jaxflow.align` (``sampling``, ``train``, ``policy``,
``report``).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.align import Rows, interleave_rows
from jaxflow.align.policy import lora_info, lora_policy
from jaxflow.align.report import aggregate, format_table, plot_curves
from jaxflow.align.sampling import pair_stats, sample_pairs
from jaxflow.align.train import batch_schedule, make_method_step, train_method
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.experiment import RunContext
from jaxflow.mesh import make_mesh
from jaxflow.rl.rollout import RolloutSpec, RolloutWorker
from jaxflow.rl.tasks import AdditionRLTask
from jaxflow.rl.warm_start import cache_dir, load_pretrained_params
from jaxflow.study import warm_start_report
from jaxflow.train.lm_state import lm_functions
from jaxflow.train.state import TrainState


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
    adapters = lora_info(policy) if config.lora.enabled else None
    if adapters:
        run.info(f"LoRA: {adapters}")
    steps = {m: make_method_step(policy.fns, m, config.dpo_beta, config.figa, replicated)
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
        "final_by_seed": {m: {r["seed"]: r["final"]["heldout_greedy"] for r in records if r["method"] == m}
                          for m in config.methods},  # the headline's paired seeds
        **({"lora": adapters} if adapters else {}),
        "table": table,
        "warm_start": warm_start_report(cache_dir(config.pretrain, config.cache_root).name,
                                        pre_summary, **warm_eval),
        "pair_pools": pools,
        "seeds": config.seeds,
        "study_seconds": time.time() - start,
    }
