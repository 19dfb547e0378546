"""rl: GRPO / DAPO / GSPO / CISPO on your own Hugging Face checkpoint, data and reward; writes a
Hugging Face checkpoint back.

The policy is a local checkpoint directory (``model.hf_path``: config.json, *.safetensors,
tokenizer.json; generation_config.json's EOS ids; the chat template of tokenizer_config.json
with ``data.chat_template=true``), optionally with LoRA adapters (``model.lora.rank``). Prompts
come from a local file (``data.train`` / ``data.eval``: .jsonl, .json, .parquet, .csv or a
``datasets.save_to_disk`` directory; ``data.prompt_key`` / ``data.answer_key``, every other
column reaches the reward) or from a reasoning-gym generator (``data.source=reasoning_gym:NAME``,
``data.generator`` its settings as JSON). The reward is ``reward.fn``: ``math_verify``,
``reasoning_gym``, ``exact_match``, ``regex:PATTERN``, or your own batched
``module:function`` / ``path/file.py:function`` called as ``fn(prompts, completions, **columns)
-> list[float]`` (:mod:`jaxflow.rl.rewards`); ``reward.truncated=score`` (verl's behaviour, the
default) scores completions that hit ``rl.max_new_tokens`` too, ``zero`` gives them 0.
RL is :class:`jaxflow.rl.GRPOTrainer` (``rl.*``: ``rl.loss.algo``, ``rl.loss.correction``, the
paged rollout engine by default) on disjoint trainer / rollout sub-meshes. With ``export.hf``
the trained policy is written as ``RUN_DIR/hf/`` (merged safetensors, config, tokenizer files,
PEFT ``adapter/`` under LoRA) at the end, and as ``RUN_DIR/hf-<rollout>/`` with every checkpoint
when ``export.every`` is on; ``python -m jaxflow.export RUN_DIR --out DIR`` exports any
checkpoint of a finished run.

    python -m jaxflow.run --exp=rl --variant=quick       # tiny Qwen3 + SFT + GRPO/SIS, ~2 min on 2 cores
    python -m jaxflow.run --exp=rl --variant=quick --set seeds=3
    python -m jaxflow.run --exp=rl --set model.hf_path=/ckpt/Qwen3-0.6B --set data.train=train.jsonl \\
        --set data.eval=test.jsonl --set reward.fn=math_verify --set model.lora.rank=8
    python -m jaxflow.run --exp=rl --set model.hf_path=DIR --set data.train=d.parquet \\
        --set data.prompt_key=prompt --set data.answer_key=reward_model.ground_truth \\
        --set data.chat_template=true --set reward.fn=my_reward.py:compute_score
    python -m jaxflow.run --exp=rl --set model.hf_path=DIR --set data.source=reasoning_gym:chain_sum \\
        --set reward.fn=reasoning_gym
    python -m jaxflow.run --exp=rl --variant=full --compile-only --target=tpu-v5p:4x4x4

Quick variant: no checkpoint needed. It writes its own tiny Qwen3-shaped checkpoint
(:mod:`jaxflow.models.tiny_hf`, a character tokenizer built with ``tokenizers``; cached under
``cache_root``), warm-starts it by SFT on reasoning-gym ``chain_sum``'s answers (two one-digit
terms; :mod:`jaxflow.rl.sft`), then runs GRPO + SIS on the engine and reports the
held-out pass@1 before and after. Needs the ``rl`` extra (``pip install -e ".[rl]"``).

Seeds: ``seeds`` runs; run k uses RL seed ``seed + k`` (and SFT seed ``k``); the summary's
headline figures are means over runs with a 95% t-interval, per-run values under ``per_seed``.
"""

from __future__ import annotations

import dataclasses
import json

from configs.flagship import EvalConfig  # held-out pass@1: prompts x samples every few rollouts
from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, COUNT0, SEED, domains
from jaxflow.config_reads import experiment_field
from jaxflow.mesh import RolesConfig
from jaxflow.models.lora import LoraConfig
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.sft import SFTConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("GRPO / DAPO / GSPO / CISPO on your own HF checkpoint, data file or reasoning-gym "
               "task and reward; LoRA optional; exports an HF checkpoint")
ENTRY = "jaxflow.main.rl:main"
HEADLINES = "jaxflow.study.headlines_rl:rl"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.hf_path", "model.lora")

#: reasoning-gym chain_sum's fixed instruction: one token of the quick variant's tokenizer
CHAIN_SUM_INSTRUCTION = "State the final answer to the following arithmetic problem:"
SOURCES = ("file", "reasoning_gym:NAME")
TRUNCATED = ("score", "zero")


@domains(d_model=COUNT, n_layers=COUNT, n_heads=COUNT, n_kv_heads=COUNT, d_ff=COUNT, seed=SEED)
@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    """The quick variant's own checkpoint (:func:`jaxflow.models.tiny_hf.tiny_qwen3_config`)."""

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    seed: int = 0
    phrases: tuple[str, ...] = ()  # whole-phrase tokens (e.g. a task's fixed instruction)

    def __post_init__(self):
        require_positive(self, "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
        require_positive(self, "seed", allow_zero=True)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``hf_path``: the local checkpoint to train (required unless ``tiny`` is set: the quick
    variant's own checkpoint, ignored when ``hf_path`` is given). ``lora``: adapters over the
    frozen checkpoint (rank 0: full fine-tuning)."""

    hf_path: str = experiment_field("")  # in READS: the refusals of other experiments name rl
    lora: LoraConfig = experiment_field(LoraConfig())
    tiny: TinyModelConfig | None = None


@domains(size=COUNT, eval_size=COUNT, seed=SEED)
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from (module doc). ``answer_key=""`` takes the first of ``answer`` /
    ``reward_model.ground_truth`` that every row holds. Without ``eval`` (files) the held-out
    prompts are ``eval_size`` rows split off ``train`` (seeded); a reasoning-gym source draws
    ``size`` training rows with ``seed`` and ``eval_size`` held-out rows with ``seed + 1``."""

    source: str = "file"
    train: str = ""
    eval: str = ""
    prompt_key: str = "prompt"
    answer_key: str = ""
    chat_template: bool = False
    size: int = 2000
    eval_size: int = 128
    seed: int = 0
    generator: str = ""  # reasoning-gym: the generator's settings as JSON, e.g. {"max_terms": 2}

    def __post_init__(self):
        if self.source != "file" and not (self.source.startswith("reasoning_gym:")
                                          and len(self.source) > len("reasoning_gym:")):
            raise ValueError(f"data.source={self.source!r}; valid: {', '.join(SOURCES)}")
        require_positive(self, "size", "eval_size")
        require_positive(self, "seed", allow_zero=True)
        if self.generator:
            try:
                ok = isinstance(json.loads(self.generator), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"data.generator={self.generator!r}; valid: a JSON object of the "
                                 'reasoning-gym generator\'s settings, e.g. {"max_terms": 2}')


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """``fn``: the reward spec (:func:`jaxflow.rl.rewards.make_reward`); ``truncated``: what a
    completion that hit ``rl.max_new_tokens`` gets, ``score`` (decoded and scored) or ``zero``."""

    fn: str = "math_verify"
    truncated: str = "score"

    def __post_init__(self):
        if not self.fn:
            raise ValueError("reward.fn is empty; valid: math_verify, reasoning_gym, exact_match, "
                             "regex:PATTERN, module:function or path/file.py:function")
        if self.truncated not in TRUNCATED:
            raise ValueError(f"reward.truncated={self.truncated!r}; valid: {', '.join(TRUNCATED)}")


@domains(every=COUNT0)
@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """``hf``: write ``RUN_DIR/hf/`` at the end; ``every``: also ``RUN_DIR/hf-<rollout>/``
    every this many rollouts (0: only at the end)."""

    hf: bool = True
    every: int = 0

    def __post_init__(self):
        require_positive(self, "every", allow_zero=True)


@domains(seed=SEED, seeds=COUNT, devices=COUNT, rollouts=COUNT, checkpoint_every=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0  # RL seed of run 0; run k uses seed + k
    seeds: int = 1
    devices: int | None = 2  # fake CPU devices on a CPU-only machine: 1 trainer + 1 rollout
    cache_root: str = "runs/_cache"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    sft: SFTConfig = SFTConfig()  # SFT warm start on the data's answers (0 steps: none)
    rl: GRPOConfig = GRPOConfig(
        loss=PolicyLossConfig(algo="grpo", correction="sis"), sampler="engine",
        prompts_per_rollout=16, group_size=8, temperature=1.0, max_new_tokens=256, lag=2)
    optim: OptimConfig = OptimConfig(lr=1e-6, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)
    rollouts: int = 100
    eval: EvalConfig = EvalConfig()
    roles: RolesConfig = RolesConfig()
    checkpoint_every: int = 10  # RL checkpoints every this many rollouts (and at the end)
    export: ExportConfig = ExportConfig()

    def __post_init__(self):
        require_positive(self, "rollouts", "seeds", "checkpoint_every")
        require_positive(self, "seed", allow_zero=True)
        if self.devices is not None:
            require_positive(self, "devices")
        if self.rl.lora.enabled:
            raise ValueError(f"rl.lora.rank={self.rl.lora.rank}: this experiment's adapters are "
                             "model.lora (e.g. --set model.lora.rank=8)")


def _quick() -> Config:
    generator = json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    return Config(
        model=ModelConfig(tiny=TinyModelConfig(phrases=(CHAIN_SUM_INSTRUCTION,))),
        data=DataConfig(source="reasoning_gym:chain_sum", size=3000, eval_size=128,
                        generator=generator),
        reward=RewardConfig(fn="reasoning_gym"),
        sft=SFTConfig(steps=200, batch_size=32, optim=OptimConfig(lr=3e-3, warmup_steps=20)),
        rl=dataclasses.replace(Config().rl, prompts_per_rollout=32, group_size=16,
                               max_new_tokens=6, lag=2),
        optim=OptimConfig(lr=5e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0),
        rollouts=30, eval=EvalConfig(prompts=128, samples=4, every=15), checkpoint_every=30)


def _default() -> Config:
    return Config()


def _full() -> Config:
    """Production size for accelerators (``--compile-only --target=tpu-v5p:4x4x4``): a
    Qwen3-8B-shaped policy (``configs/hf/qwen3-8b.json``) with 1,024-token responses, 64 prompts
    x 16 samples per rollout, lag 8, SIS top-8; trainer 32 chips (data 4 x model 8) and rollout
    32 (data 4 x model 8). ``model.hf_path`` names the real checkpoint to train; compiling needs
    only its shapes (without one, Qwen3-8B's). ``--compile-only --target=T`` lays the roles
    out for T instead (:mod:`jaxflow.compile_only.variants`: halves, the smallest model widths
    whose HBM estimate fits; v5p:4x4x4 trainer model 2, rollout model 4: the engine is one
    replica whose page pool holds all 1,024 rows' KV on every "model" shard, so on v6e:16x16 it
    exits 2); on 8 x H200 the
    trainer's 128-row update of 2,048 tokens fits at model 4 with gradient accumulation
    (``rl.microbatches`` 4); on 8 x H100 it exits 2, the sampler's KV cache not fitting (the
    smallest target its HBM estimate fits: 8 x H200)."""
    return dataclasses.replace(
        Config(), devices=None, rollouts=200,
        rl=dataclasses.replace(Config().rl, prompts_per_rollout=64, group_size=16,
                               max_new_tokens=1024, lag=8, sis_topk=8),
        roles=RolesConfig(rollout_devices=32, trainer_model=8, rollout_model=8),
        eval=EvalConfig(prompts=1024, samples=8, every=10))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
