"""The ``rl`` experiment: GRPO-family RL on your own HF checkpoint, data and reward, exported as
an HF checkpoint (see ``configs/rl.py``).

Per seed k: the checkpoint's weights (quick: its own tiny checkpoint, :mod:`jaxflow.models.tiny_hf`),
an optional SFT warm start on the training rows' answers (seed k), held-out pass@1, then
``rollouts`` GRPO steps through :func:`jaxflow.train.loop.run_steps` (checkpoints under
``checkpoints/seed<k>/rl`` every ``checkpoint_every`` rollouts; ``--resume`` restores the trainer
state, whose rollout counter is the position in the prompt stream), held-out pass@1 every
``eval.every`` rollouts, and the export (``hf/``; ``hf-<rollout>/`` with ``export.every``).
Finished seeds are recorded in ``seeds.jsonl``; the summary's headline figures are means over
seeds with a 95% t-interval (``jaxflow.main.flagship.summarize_seeds``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from types import SimpleNamespace

from jaxflow.cache import build_once, cache_entry
from jaxflow.checkpoint import Checkpointer
from jaxflow.config import ConfigError
from jaxflow.experiment import RunContext, to_jsonable
from jaxflow.mesh import trainer_rollout_meshes
from jaxflow.models import lora
from jaxflow.rl.grpo import GRPOTrainer, rollout_row
from jaxflow.rl.sft import sft_warm_start
from jaxflow.stats import paired_interval
from jaxflow.train.loop import run_steps

HEADLINE_KEYS = ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "heldout_pass_at_1_gain")


def checkpoint_path(config, run: RunContext) -> str:
    """``model.hf_path``, or the quick variant's tiny checkpoint (built once under
    ``cache_root``); ConfigError naming the key when there is neither."""
    if config.model.hf_path:
        return config.model.hf_path
    tiny = config.model.tiny
    if tiny is None:
        raise ConfigError("model.hf_path is not set; valid: a local Hugging Face checkpoint "
                          "directory (config.json, *.safetensors, tokenizer.json), or "
                          "--variant=quick for a tiny checkpoint it writes itself")
    from jaxflow.models.tiny_hf import tiny_qwen3_config, write_tiny_checkpoint

    entry = cache_entry(config.cache_root, "tiny_qwen3-v1", tiny)
    fields = {k: v for k, v in dataclasses.asdict(tiny).items() if k not in ("seed", "phrases")}
    build_once(entry, lambda tmp: write_tiny_checkpoint(
        str(tmp), tiny_qwen3_config(128, **fields), phrases=tiny.phrases, seed=tiny.seed),
        marker="generation_config.json")
    run.info(f"quick: the tiny Qwen3 checkpoint {entry}")
    return str(entry)


def make_task(config, tokenizer, hf_path: str):
    """The :class:`jaxflow.rl.dataset_task.DatasetTask` of ``config.data`` / ``config.reward``."""
    from jaxflow.data.chat_template import ChatTemplate
    from jaxflow.rl.dataset_task import DatasetTask
    from jaxflow.rl.own_data import data_rows

    data = config.data
    template = ChatTemplate.from_pretrained(hf_path) if data.chat_template else None
    if data.chat_template and template is None:
        raise ConfigError(f"data.chat_template=true but {hf_path} has no chat template "
                          "(tokenizer_config.json chat_template or chat_template.jinja)")
    train, heldout = data_rows(data)
    return DatasetTask(train, config.reward.fn, prompt_key=data.prompt_key,
                       answer_key=data.answer_key or None, template=template, heldout=heldout,
                       tokenizer=tokenizer, max_completion_len=config.rl.max_new_tokens - 1,
                       name=data.source if data.source != "file" else os.path.basename(data.train))


def export(trainer, state, hf_path: str, out) -> None:
    """The trainer's policy as an HF checkpoint in ``out`` (merged weights; PEFT ``adapter/``)."""
    from jaxflow.models.hf_export import export_hf

    cfg = trainer.model_cfg
    export_hf(state["policy"].params, cfg, str(out), source_dir=hf_path,
              lora_cfg=cfg.lora if cfg.lora.enabled else None)


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
    trainer = GRPOTrainer(ctx.model_cfg, ctx.rl, config.optim, ctx.task, ctx.tokenizer,
                          ctx.meshes, seed=config.seed + k, total_rollouts=config.rollouts)
    state = trainer.init_state(params)
    if k == 0:
        run.info(lora.describe_trainable(state["policy"].params))
    n = min(config.eval.prompts, len(ctx.task.heldout_rows))

    def pass_at_1(st) -> float:
        return trainer.heldout_accuracy(st, n, samples=config.eval.samples)

    initial = pass_at_1(state)
    run.info(f"seed {k}: held-out pass@1 before RL {initial:.3f}")
    out = run.out_dir / ("hf" if config.seeds == 1 else f"hf/seed{k}")
    every = config.export.every if config.export.hf else 0

    def rl_step(state, step):
        state, metrics = trainer.step(state)
        return state, {"rollout": step + 1, "seed_index": k, **metrics}

    def export_hook(done, state, row):
        if every and done % every == 0 and run.is_primary:
            export(trainer, state, ctx.hf_path, f"{out}-{done}")

    ckpt = Checkpointer(run.checkpoint_dir / f"seed{k}" / "rl", save_every=config.checkpoint_every,
                        max_to_keep=2)
    result = run_steps(rl_step, state, steps=config.rollouts, run=run, checkpointer=ckpt,
                       log_every=1, summarize=rollout_row, hooks=(export_hook,),
                       eval_fn=lambda st, done: {"heldout_pass_at_1": pass_at_1(st)},
                       eval_every=config.eval.every, step_offset=k * config.rollouts)
    final = pass_at_1(result.state)
    run.info(f"seed {k}: held-out pass@1 {initial:.3f} -> {final:.3f} ({final - initial:+.3f})")
    if config.export.hf and run.is_primary:
        export(trainer, result.state, ctx.hf_path, out)
        run.info(f"seed {k}: exported the policy to {out}")
    rows = [json.loads(json.dumps(to_jsonable(r))) for r in result.rows]
    return {"rl_seed": config.seed + k, "heldout_pass_at_1_initial": initial,
            "heldout_pass_at_1_final": final, "heldout_pass_at_1_gain": final - initial,
            "heldout_prompts": n, "sft": sft, "export": str(out) if config.export.hf else None,
            "reward_last": rows[-1].get("reward_mean") if rows else None}


def resolve_meshes(config, devices=None) -> dict:
    """``{"trainer", "rollout"}``: disjoint sub-meshes of ``devices`` (``config.roles``)."""
    return trainer_rollout_meshes(config.roles, devices)[0]


def main(config, run: RunContext) -> dict:
    """Every seed's SFT warm start, RL and export; the summary over seeds."""
    from jaxflow.models.pretrained import load_policy

    hf_path = checkpoint_path(config, run)
    meshes = resolve_meshes(config)
    run.info(f"roles: {trainer_rollout_meshes(config.roles)[1]}")
    model_cfg, params, tokenizer = load_policy(hf_path, meshes["trainer"])
    run.info(f"policy from {hf_path}: {model_cfg.architecture}, {model_cfg.n_layers} layers, "
             f"d_model {model_cfg.d_model}, vocab {model_cfg.vocab_size}")
    task = make_task(config, tokenizer, hf_path)
    rl = dataclasses.replace(config.rl, lora=config.model.lora,
                             truncated_reward=config.reward.truncated)
    ctx = SimpleNamespace(hf_path=hf_path, meshes=meshes, model_cfg=model_cfg, params=params,
                          tokenizer=tokenizer, task=task, rl=rl)
    run.set_total_steps(config.seeds * config.rollouts, "rl")
    path = run.out_dir / "seeds.jsonl"  # --resume: seeds that had finished are not run again
    done = {r.pop("seed_index"): r for r in map(json.loads, path.read_text("utf-8").splitlines())
            } if run.resume and path.exists() else {}
    per_seed = []
    for k in range(config.seeds):
        summary = done.get(k) or run_seed(config, run, k, ctx)
        if k not in done and run.is_primary:
            with (run.out_dir / "seeds.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps({"seed_index": k, **to_jsonable(summary)}) + "\n")
        per_seed.append(summary)
    head = {key: {f: None if isinstance(v, float) and math.isnan(v) else v for f, v in
                  paired_interval([s[key] for s in per_seed], [0.0] * len(per_seed))._asdict().items()}
            for key in HEADLINE_KEYS}  # mean and 95% t-interval over seeds (None for one seed)
    if config.seeds > 1:
        run.info("over seeds: " + "; ".join(f"{key} {iv['mean']:.3f} +- {iv['half_width']:.3f}"
                                            for key, iv in head.items()))
    return {**{key: iv["mean"] for key, iv in head.items()}, "seed_interval": head,
            "seeds": config.seeds, "per_seed": per_seed, "hf_path": hf_path, "task": task.name,
            "reward": config.reward.fn, "lora": lora.describe_trainable(params) if not
            config.model.lora.enabled else f"rank {config.model.lora.rank}"}
