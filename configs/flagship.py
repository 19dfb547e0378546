"""flagship: GRPO with SIS on worked addition, trainer and rollout on disjoint sub-meshes,
weights published through SparseRL-Sync.

The learning testbed is 3-digit addition with the column working written out (25-29
character responses, :mod:`jaxflow.data.worked_addition`). Warm start: a short ``lm_pretrain``
run on that corpus (cached under ``cache_root``), which samples the working correctly only
part of the time at temperature 1. RL: GRPO with SIS at policy lag N (N mini-batch updates per
rollout, so mini-batches 2..N are off-policy and SIS accepts or rejects their tokens), the
trainer on one sub-mesh of fake CPU devices and the sampler on the other; after every rollout
the trainer's weights reach the sampler's bf16 replica as a sparse SparseRL-Sync payload.

    python -m jaxflow.run --exp=flagship --variant=quick      # ~1.5 min on 2 cores, warm start incl.; 1 seed
    python -m jaxflow.run --exp=flagship --variant=default    # 3 seeds x 100 rollouts, 512 held-out prompts
    python -m jaxflow.run --exp=flagship --set rl.loss.correction=none --set sync=none
    python -m jaxflow.run --exp=flagship --set rl.lora.rank=8 --set optim.lr=1e-3  # LoRA over the warm start

``rl.lora`` (:mod:`jaxflow.models.lora`) trains rank-r adapters over the frozen warm start (not
``pretrain.model.lora``, which would pretrain adapters over a random base); the sampler gets the
merged weights, and SparseRL-Sync carries the adapters (``rl.lora.publish=adapters``).

Rollout sampler (``rl.sampler``, :mod:`jaxflow.rl.rollout`): "static" (default, the static-batch
sampler, one key per rollout), "engine" (:class:`jaxflow.rollout.RolloutEngine`: paged KV cache,
continuous batching, the 16 samples of a prompt share its prefill, per-token weight versions in
the metrics as ``version/sampler_min`` / ``_max``; ``rl.engine.*`` its shapes) or
"static_per_row" (the static sampler on the engine's per-row keys). The engine samples the same
tokens as "static_per_row" (its log-probs differ by ~1e-6, which only ``actor/behaviour_gap`` sees), so
``--set rl.sampler=engine`` and ``--set rl.sampler=static_per_row`` give the same figures; they
differ from "static"'s because the random stream does (per-row keys). "static" stays the default
so the published figures and the two-job bit-identity runs keep their stream.

    python -m jaxflow.run --exp=flagship --variant=quick --set rl.sampler=engine
    python -m jaxflow.run --exp=flagship --set remote.role=rollout ... --set rl.sampler=engine  # rollout job

pass@1 (every summary): the mean reward over ``eval.prompts`` fixed held-out prompts x
``eval.samples`` samples each at the RL temperature (``rl.temperature``), fixed sampling key.

Seeds: ``seeds`` runs (a count; quick 1, default 3). Run k trains its own warm start with
``pretrain.seed + k`` (cached per seed) and runs RL with seed ``seed + k``; the summary's
headline figures are means over the runs with a 95% t-interval (``seed_interval``), per-run
values under ``per_seed``. ``--set seeds=3`` gives any variant an interval.
"""

from __future__ import annotations

import dataclasses

from configs.lm_pretrain import Config as PretrainConfig
from configs.lm_pretrain import TrainConfig
from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, SEED, UNIT, Int, domains
from jaxflow.data.worked_addition import WorkedAdditionTask
from jaxflow.mesh import RolesConfig
from jaxflow.models.architectures import shipped_config
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.remote.protocol import RemoteConfig
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("GRPO + SIS on worked addition: disjoint trainer / rollout sub-meshes, "
               "SparseRL-Sync publishes, held-out pass@1")
ENTRY = "jaxflow.main.flagship:main"
HEADLINES = "jaxflow.study.headlines_rl:flagship"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("pretrain.model.lora",)


@domains(digits=COUNT, heldout_mod=Int(2), sloppy_rate=UNIT)
@dataclasses.dataclass(frozen=True)
class WorkedDataConfig:
    """The pretraining corpus: ``digits``-digit addition with the working written out."""

    digits: int = 3
    heldout_mod: int = 20
    sloppy_rate: float = 0.7  # demonstrations that drop every carry
    loss_on: str = "answer"  # working + sum + EOS

    def __post_init__(self):
        self.make_corpus()  # validates
        if self.loss_on not in ("answer", "all"):
            raise ValueError(f"data.loss_on={self.loss_on!r}; valid: answer, all")

    def make_corpus(self) -> WorkedAdditionTask:
        return WorkedAdditionTask(digits=self.digits, heldout_mod=self.heldout_mod,
                                  sloppy_rate=self.sloppy_rate)


#: Warm start: ~85k-parameter decoder, 3-digit worked addition.
WARM_START = PretrainConfig(
    seed=0,
    model=TransformerConfig(vocab_size=23, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4,
                            d_ff=128, max_seq_len=80),
    data=WorkedDataConfig(),
    train=TrainConfig(steps=300, batch_size=32, seq_len=80, log_every=50, eval_every=300,
                      eval_examples=256, checkpoint_every=300, keep_checkpoints=1),
    optim=OptimConfig(lr=3e-3, warmup_steps=20),
)


@domains(prompts=COUNT, samples=COUNT, every=COUNT)
@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out pass@1: ``prompts`` fixed held-out prompts x ``samples`` samples each at the
    RL temperature, every ``every`` rollouts."""

    prompts: int = 128
    samples: int = 4
    every: int = 5

    def __post_init__(self):
        require_positive(self, "prompts", "samples", "every")


@domains(seed=SEED, seeds=COUNT, devices=COUNT, rollouts=COUNT, checkpoint_every=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0  # RL seed of run 0; run k uses seed + k (and warm start pretrain.seed + k)
    seeds: int = 1  # how many runs (a count); > 1 gives the headline figures a 95% interval
    devices: int | None = 2  # fake CPU devices on a CPU-only machine: 1 trainer + 1 rollout
    # (None: every device present, the full variant)
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = WARM_START
    rl: GRPOConfig = GRPOConfig(
        loss=PolicyLossConfig(algo="grpo", correction="sis"), prompts_per_rollout=16,
        group_size=16, temperature=1.0, max_new_tokens=30, lag=2, sis_topk=8)
    optim: OptimConfig = OptimConfig(lr=1e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)
    rollouts: int = 20
    eval: EvalConfig = EvalConfig()
    roles: RolesConfig = RolesConfig()
    sync: SyncConfig | None = SyncConfig(codec="auto", every=1)
    # trainer and rollout as two jobs (jaxflow.rl.remote): role local | trainer | rollout
    remote: RemoteConfig = RemoteConfig()
    checkpoint_every: int | None = None  # RL checkpoints every this many rollouts (None: at the end)

    def __post_init__(self):
        require_positive(self, "rollouts", "seeds")
        if self.checkpoint_every is not None:
            require_positive(self, "checkpoint_every")
        if self.remote.role != "local" and self.sync is None:
            raise ValueError("remote.role=" + self.remote.role + " joins the jobs only through "
                             "SparseRL-Sync: sync must not be none")
        if self.devices is not None:
            require_positive(self, "devices")
        task = self.task
        if self.rl.max_new_tokens < task.max_completion_len + 1:
            raise ValueError(f"rl.max_new_tokens={self.rl.max_new_tokens} cannot hold the "
                             f"{task.max_completion_len}-character answer and EOS; valid: >= "
                             f"{task.max_completion_len + 1}")

    @property
    def task(self) -> WorkedAdditionTask:
        return self.pretrain.data.make_corpus()


def _quick() -> Config:
    return Config()


def _full() -> Config:
    """Production size, for accelerators (``--compile-only --target=tpu-v5p:4x4x4`` costs it
    on this CPU): a Qwen3-8B-shaped policy (``configs/hf/qwen3-8b.json`` through
    ``jaxflow.models.architectures``; f32 master weights, bf16 compute, remat) with 1,024-token
    rollouts, 64 prompts x 16 samples per rollout, policy lag 8 (128-row mini-batches), SIS
    top-8. ``roles`` below is a run on 64 chips: trainer 32 (data 4 x model 8) and rollout 32
    (data 4 x model 8), tensor parallel over heads / kv heads / mlp / vocab, rows over "data".
    ``--compile-only --target=T`` lays the roles out for T instead
    (:mod:`jaxflow.compile_only.variants`: halves, the smallest model widths whose HBM estimate
    fits; v5p:4x4x4 trainer model 2, rollout model 1; v6e:16x16 trainer model 8, rollout
    model 2: the sampler holds the f32 params and their bf16 copy, 45.8 GiB unsharded); on
    8 x H100 the trainer's 128-row update fits at model 4 only with gradient accumulation:
    ``rl.microbatches`` 4 (32 rows each), the rollout at model 2."""
    policy = shipped_config("qwen3-8b", param_dtype="float32", max_seq_len=2048, remat=True)
    pretrain = dataclasses.replace(
        WARM_START, model=policy,
        train=dataclasses.replace(WARM_START.train, seq_len=2048, batch_size=256))
    return dataclasses.replace(
        Config(), devices=None, pretrain=pretrain, rollouts=200, seeds=1,
        rl=dataclasses.replace(Config().rl, prompts_per_rollout=64, group_size=16,
                               max_new_tokens=1024, lag=8, sis_topk=8),
        roles=RolesConfig(rollout_devices=32, trainer_model=8, rollout_model=8),
        eval=EvalConfig(prompts=1024, samples=8, every=10))


def _default() -> Config:
    return dataclasses.replace(Config(), rollouts=100, seeds=3,
                               eval=EvalConfig(prompts=512, samples=4, every=10))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
