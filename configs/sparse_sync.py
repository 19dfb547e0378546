"""sparse_sync: SparseRL-Sync on real GRPO runs.

GRPO from the addition warm start (the sis_offpolicy model and task; bf16 sampler), syncing the
trainer's weights to bf16 rollout replicas every 1, 4 and 16 steps with every codec; per sync
the changed fraction, bytes per codec, ratio vs dense, bytes / entropy bound, encode and
delivery time and a bit-exactness hash check; at every=1 two replica processes over TCP too.

    python -m jaxflow.run --exp=sparse_sync --variant=quick      # ~2 min (+ warm start once)
    python -m jaxflow.run --exp=sparse_sync --variant=default    # 64 steps per interval
    python -m jaxflow.run --exp=sparse_sync --set sync.codec=entropy --set sync.every=4
    python -m jaxflow.run --exp=sparse_sync --set sync.codec=entropy --set intervals=4,16

The rollouts are served by the RL trainer's own weight sync (``GRPOTrainer(sync=...)``), with
``sync.codec``; the other ``codecs`` are measured on the same trajectory beside it.
"""

from __future__ import annotations

import dataclasses

from configs.lm_pretrain import Config as PretrainConfig
from configs.sis_offpolicy import WARM_START
from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, SEED, domains
from jaxflow.mesh import RolesConfig
from jaxflow.rl.grpo import GRPOConfig
from jaxflow.sync.codec_registry import CODECS, check_codec
from jaxflow.sync.weight_sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "Sparse bf16 weight sync on real GRPO runs: bytes, ratio, bound, bit-exactness"
ENTRY = "jaxflow.main.sparse_sync:main"
HEADLINES = "jaxflow.study.headlines_rl:sparse_sync"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("pretrain.model.lora",)
DEFAULT_INTERVALS = (1, 4, 16)  # the sweep when neither ``intervals`` nor ``sync.every`` is set


@domains(seed=SEED, intervals=COUNT, steps=COUNT, tcp_replicas=COUNT0, tcp_every=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    """``sync.codec``: the codec whose replicas serve the rollouts (and the TCP replicas);
    ``codecs``: every codec measured on the same trajectory; ``intervals``: sync every N
    rollouts (= optimizer steps, lag 1), one GRPO run each; None: DEFAULT_INTERVALS, or just
    ``(sync.every,)`` when ``sync.every`` is set to another value (see :attr:`sweep`);
    ``steps``: rollouts per run."""

    seed: int = 0
    cache_root: str = "runs/_cache"
    pretrain: PretrainConfig = WARM_START
    rl: GRPOConfig = GRPOConfig(prompts_per_rollout=8, group_size=8, temperature=1.0,
                                max_new_tokens=4, sis_topk=8, mismatch="bf16")
    optim: OptimConfig = OptimConfig(lr=2e-4, warmup_steps=0, weight_decay=0.0, grad_clip=1.0)
    sync: SyncConfig = SyncConfig(codec="auto")
    codecs: tuple[str, ...] = CODECS
    intervals: tuple[int, ...] | None = None
    steps: int = 64
    tcp_replicas: int = 2
    tcp_every: int = 1
    roles: RolesConfig = RolesConfig()

    def __post_init__(self):
        if not self.codecs:
            raise ValueError(f"codecs={self.codecs}: need at least one; valid: {CODECS}")
        for i, codec in enumerate(self.codecs):
            check_codec(codec, field=f"codecs[{i}]")
        if self.intervals is not None and (not self.intervals or any(
                not isinstance(e, int) or e < 1 for e in self.intervals)):
            raise ValueError(f"intervals={self.intervals}: need ints >= 1")
        if self.intervals is not None and self.sync.every != 1 and \
                self.intervals != (self.sync.every,):
            raise ValueError(f"sync.every={self.sync.every} and intervals={self.intervals} "
                             "disagree: set one of them (intervals sweeps several)")
        if self.steps < max(self.sweep):
            raise ValueError(f"steps={self.steps} < the largest interval {max(self.sweep)}: "
                             "that run would never sync")
        if self.rl.staleness != 0 or self.rl.lag != 1:
            raise ValueError("sparse_sync serves rollouts from the synced replica: needs "
                             f"rl.staleness=0 and rl.lag=1, got {self.rl.staleness}, {self.rl.lag}")
        if self.tcp_replicas < 0:
            raise ValueError(f"tcp_replicas={self.tcp_replicas}: need >= 0")

    @property
    def sweep(self) -> tuple[int, ...]:
        """The sync intervals run, one GRPO run each."""
        if self.intervals is not None:
            return self.intervals
        return (self.sync.every,) if self.sync.every != 1 else DEFAULT_INTERVALS


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(base, steps=16)


def _full() -> Config:
    base = Config()
    return dataclasses.replace(base, steps=256, intervals=(1, 2, 4, 8, 16, 32))


get_config = Variants(quick=_quick, default=Config, full=_full)
VARIANTS = get_config.variants
