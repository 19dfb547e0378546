"""The ``rl`` experiment (``configs/rl.py``): per seed k, the checkpoint (quick: its own tiny
one), an optional SFT warm start (seed k), held-out pass@1, ``rollouts`` GRPO steps through
:func:`jaxflow.train.loop.run_steps` (checkpoints ``checkpoints/seed<k>/rl``; ``--resume``
continues mid-epoch: the prompt position is the checkpointed rollout counter), the export
(``hf/``, ``hf-<rollout>/``). Finished seeds go to ``seeds.jsonl``; headline figures are means
with a 95% t-interval over seeds. ``RUN_DIR/export.json``: ``python -m jaxflow.export RUN_DIR``.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import jax

from jaxflow.checkpoint import Checkpointer
from jaxflow.config import ConfigError
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.models import lora
from jaxflow.models.hf_export import export_hf, write_export_manifest
from jaxflow.models.tiny_hf import cached_tiny_checkpoint
from jaxflow.rl.grpo import rollout_row
from jaxflow.rl.own_data import make_task, stand_in_task
from jaxflow.rl.sft import sft_warm_start
from jaxflow.rl.system import GRPOSetup, GRPOSystem
from jaxflow.study import finished_cells, paired_interval, record_cell
from jaxflow.train.loop import run_steps

HEADLINE_KEYS = ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "heldout_pass_at_1_gain")


def run_seed(config, run: RunContext, k: int, ctx) -> dict:
    """Seed ``k``: SFT warm start, RL, held-out pass@1 before / after, export; its summary."""
    params, sft = ctx.params, {"steps": 0}
    if config.sft.steps:
        prompts = ctx.task.prompts_at(0, len(ctx.task.rows), seed=k)
        answers = [str(a) for a in ctx.task.columns(prompts)["answer"]]
        params, sft = sft_warm_start(params, ctx.model_cfg, ctx.meshes["trainer"], ctx.tokenizer,
                                     prompts, answers, config.sft, seed=k)
        run.info(f"seed {k}: SFT {sft['steps']} steps, loss {sft['loss_first']:.3f} -> "
                 f"{sft['loss_last']:.3f}")
    n = min(config.eval.prompts, len(ctx.task.heldout_rows))
    setup = GRPOSetup(ctx.model_cfg, ctx.rl, config.optim, ctx.task, ctx.tokenizer,
                      seed=config.seed + k, total_rollouts=config.rollouts, eval_prompts=n,
                      eval_samples=config.eval.samples)
    system, run_key = GRPOSystem(), jax.random.key(setup.seed)  # the rollouts' key stream
    state = system.init(setup, ctx.meshes, run_key, params=params)
    run.info(f"seed {k}: {lora.describe_trainable(state.policy.params)}")

    def pass_at_1(st) -> float:  # sampled pass@1 over the setup's held-out prompts
        return system.evaluate(st)["heldout_pass_at_1"]
    initial = pass_at_1(state)
    run.info(f"seed {k}: held-out pass@1 before RL {initial:.3f}")
    out = run.out_dir / ("hf" if config.seeds == 1 else f"hf/seed{k}")
    every, cfg = (config.export.every if config.export.hf else 0), state.trainer.model_cfg

    def export(state, to) -> None:  # merged weights, tokenizer files, PEFT adapter/ under LoRA
        # every process calls it (the sharded params are gathered); process 0 writes
        export_hf(state.policy.params, cfg, str(to), source_dir=ctx.hf_path,
                  lora_cfg=cfg.lora if cfg.lora.enabled else None)

    def rl_step(state, step):
        state, metrics = system.step(state, None, key=jax.random.fold_in(run_key, step))
        if every and (step + 1) % every == 0:
            export(state, f"{out}-{step + 1}")
        return state, {"rollout": step + 1, "seed_index": k, **metrics}

    ckpt = Checkpointer(run.checkpoint_dir / f"seed{k}" / "rl", save_every=config.checkpoint_every,
                        max_to_keep=2)
    result = run_steps(rl_step, state, steps=config.rollouts, run=run, checkpointer=ckpt,
                       log_every=1, summarize=rollout_row,
                       eval_fn=lambda st, done: {"heldout_pass_at_1": pass_at_1(st)},
                       eval_every=config.eval.every, step_offset=k * config.rollouts)
    final = pass_at_1(result.state)  # (the last row's evaluation; also after a finished resume)
    if config.export.hf:
        export(result.state, out)
    run.info(f"seed {k}: held-out pass@1 {initial:.3f} -> {final:.3f} ({final - initial:+.3f})"
             + (f"; exported to {out}" if config.export.hf else ""))
    return {"rl_seed": config.seed + k, "heldout_pass_at_1_initial": initial,
            "heldout_pass_at_1_final": final, "heldout_pass_at_1_gain": final - initial,
            "heldout_prompts": n, "sft": sft, "export": str(out) if config.export.hf else None}


def resolve_meshes(config, devices=None) -> dict:
    """``{"trainer", "rollout"}`` sub-meshes (``config.roles``) of ``devices`` (default: the
    first ``config.devices`` present)."""
    import jax

    devices = list(jax.devices()[:config.devices] if devices is None else devices)
    return trainer_rollout_meshes(config.roles, devices)[0]


def compile_programs(config, meshes) -> list:
    """``--compile-only``: one RL step's programs (:meth:`jaxflow.rl.system.GRPOSystem.programs`)
    for ``model.hf_path``'s config.json (else Qwen3-8B's shapes), prompts of
    ``rl.max_new_tokens`` tokens."""
    from jaxflow.models.architectures import read_transformer_config, shipped_config

    hf = config.model.hf_path
    model_cfg = dataclasses.replace(read_transformer_config(hf) if hf else shipped_config("qwen3-8b"),
                                    param_dtype="float32", remat=True,
                                    max_seq_len=2 * config.rl.max_new_tokens)
    task, tokenizer = stand_in_task(config.rl.max_new_tokens, config.rl.max_new_tokens)
    rl = dataclasses.replace(config.rl, lora=config.model.lora)
    return GRPOSystem().programs(GRPOSetup(model_cfg, rl, config.optim, task, tokenizer,
                                           seed=config.seed, total_rollouts=config.rollouts), meshes)


def main(config, run: RunContext) -> dict:
    """Every seed's SFT warm start, RL and export; the summary over seeds."""
    from jaxflow.models.pretrained import load_policy

    hf_path = config.model.hf_path
    if not hf_path and config.model.tiny is None:
        raise ConfigError("model.hf_path is not set; valid: a local Hugging Face checkpoint directory "
                          "(config.json, *.safetensors, tokenizer.json), or --variant=quick")
    hf_path = hf_path or cached_tiny_checkpoint(config.cache_root, config.model.tiny)  # quick
    meshes = resolve_meshes(config)
    model_cfg, params, tokenizer = load_policy(hf_path, meshes["trainer"])
    run.info(f"policy from {hf_path}: {model_cfg.architecture}, {model_cfg.n_layers} layers, d_model "
             f"{model_cfg.d_model}; trainer {meshes['trainer'].devices.size} device(s), rollout "
             f"{meshes['rollout'].devices.size}")
    if run.is_primary:  # what `python -m jaxflow.export RUN_DIR` needs (seed 0's checkpoints)
        write_export_manifest(run.out_dir, hf_path=hf_path, model_cfg=model_cfg,
                              lora=config.model.lora, checkpoint_dir="checkpoints/seed0/rl")
    task = make_task(config.data, config.reward.fn, tokenizer, hf_path,
                     max_new_tokens=config.rl.max_new_tokens)
    rl = dataclasses.replace(config.rl, lora=config.model.lora, truncated_reward=config.reward.truncated)
    ctx = SimpleNamespace(hf_path=hf_path, meshes=meshes, model_cfg=model_cfg, params=params,
                          tokenizer=tokenizer, task=task, rl=rl)
    run.set_total_steps(config.seeds * config.rollouts, "rl")
    done = {k: {f: v for f, v in r.items() if f != "seed_index"}  # --resume: finished seeds
            for k, r in finished_cells(run, filename="seeds.jsonl", key="seed_index").items()}
    per_seed = []
    for k in range(config.seeds):
        summary = done.get(k) or run_seed(config, run, k, ctx)
        if k not in done:
            record_cell(run, {"seed_index": k, **to_jsonable(summary)}, filename="seeds.jsonl")
        per_seed.append(summary)
    head = {key: {f: None if isinstance(v, float) and math.isnan(v) else v for f, v in
                  paired_interval([s[key] for s in per_seed], [0.0] * len(per_seed))._asdict().items()}
            for key in HEADLINE_KEYS}  # mean and 95% t-interval over seeds (None for one seed)
    if config.seeds > 1:
        run.info("over seeds: " + "; ".join(f"{key} {iv['mean']:.3f} +- {iv['half_width']:.3f}"
                                            for key, iv in head.items()))
    return {**{key: iv["mean"] for key, iv in head.items()}, "seed_interval": head,
            "seeds": config.seeds, "per_seed": per_seed, "hf_path": hf_path, "task": task.name,
            "reward": config.reward.fn}
