"""bench_peers: jaxflow and its peers on the same work, each peer in its own interpreter, in
alternated rounds: wall and CPU-second ratios with their ranges, memory, and the load.

    bash scripts/peer_venvs.sh                                   # once: /work/.venv-peers/{torchrec,tunix,trl}
    python -m jaxflow.run --exp=bench_peers --variant=quick      # small shapes, 4 rounds (~17 min at load 25, 2 cores)
    python -m jaxflow.run --exp=bench_peers --variant=full       # the issue's shapes, 10 rounds
    python -m jaxflow.run --exp=bench_peers --set peers.torchrec_python=/path/to/python

Cases (``cases``): ``embedding_rowwise_adagrad`` and ``embedding_sgd``: ``emb_tables`` tables of
``emb_rows`` x ``emb_dim``, sum-pooled bags of exactly ``emb_bag`` Zipf ids, batch ``emb_batch``,
squared-error loss against random targets, the optimizer on the touched rows: jaxflow's
embedding train step vs TorchRec's fused TBE (``FusedEmbeddingBagCollection``) and unfused
``EmbeddingBagCollection`` (``emb_torchrec_variants``). Every arm is a process of its own
(``jaxflow/bench/peers/*_arm.py``); a peer whose interpreter is missing is listed under
``not_run``, not an error. Each round runs ``steps`` steps per arm after ``warmup`` steps.

``generation_equal``: ``gen_sequences`` prompts of ``gen_prompt_len`` tokens, ``gen_max_new``
greedy tokens each (no stop token: every sequence the same length), a random Llama checkpoint
(``gen_*``; RoPE theta 1e6, the value tunix 0.1.7's Llama3 always uses) loaded by each side's own
loader: jaxflow's paged rollout engine vs tunix's ``Sampler``; the two models' logits on the same
tokens must agree to 1e-5 before timing, else the tunix arm is listed under ``not_run``.
``generation_long_tail``: the same with lognormal output lengths (median ``gen_max_new`` / 4,
capped at ``gen_max_new``), forced identically in both arms (EOS at the given token).
``generation_grpo``: GRPO groups, ``gen_sequences / gen_group_size`` prompts each sampled G times
at temperature 1, every sequence ``gen_max_new`` tokens: the engine prefills a prompt once for its
G slots; tunix's ``Sampler`` gets each prompt repeated G times, as its GRPO learner does.
``grpo_iteration``: one GRPO iteration on that work (rollout at temperature 1, rewards: the
fraction of even token ids, group advantages, one AdamW update with ``grpo_learning_rate``, no
KL, no separate old-policy pass): jaxflow's ``GRPOTrainer`` vs tunix's ``GRPOLearner``
(``tunix_grpo``) and TRL's ``GRPOTrainer`` (``trl_grpo``, torch on the CPU), the same checkpoint
(logits checked to 1e-5), prompts, G, lengths and optimizer.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, POSITIVE, SEED, domains

DESCRIPTION = ("jaxflow vs its peers (TorchRec embeddings, tunix generation and GRPO, TRL GRPO) on the same work, "
               "alternated rounds, wall / CPU ratios")
ENTRY = "jaxflow.main.bench_peers:main"
HEADLINES = "jaxflow.study.headlines_bench:driver_headlines"  # the driver's own (jaxflow.bench.peers.cases.headlines)

CASES = ("embedding_rowwise_adagrad", "embedding_sgd", "generation_equal", "generation_long_tail", "generation_grpo",
         "grpo_iteration")
TORCHREC_VARIANTS = ("fused", "unfused")


@dataclasses.dataclass(frozen=True)
class PeersConfig:
    """The peers' interpreters (``bash scripts/peer_venvs.sh`` creates them)."""

    torchrec_python: str = "/work/.venv-peers/torchrec/bin/python"
    tunix_python: str = "/work/.venv-peers/tunix/bin/python"
    trl_python: str = "/work/.venv-peers/trl/bin/python"


@domains(seed=SEED, rounds=COUNT, steps=COUNT, warmup=COUNT, arm_timeout_s=POSITIVE, emb_tables=COUNT,
         emb_rows=COUNT, emb_dim=COUNT, emb_batch=COUNT, emb_bag=COUNT, emb_batches=COUNT,
         emb_learning_rate=POSITIVE, gen_vocab=COUNT, gen_d_model=COUNT, gen_layers=COUNT, gen_heads=COUNT,
         gen_kv_heads=COUNT, gen_d_ff=COUNT, gen_sequences=COUNT, gen_prompt_len=COUNT, gen_max_new=COUNT,
         gen_page_size=COUNT, gen_group_size=COUNT, gen_decode_steps=COUNT, gen_prefill_rows=COUNT0,
         gen_loop_steps=COUNT0, grpo_learning_rate=POSITIVE)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    cases: tuple[str, ...] = CASES
    rounds: int = 10  # alternated rounds (pairs of the jaxflow arm and each peer arm)
    steps: int = 3  # timed steps per arm per round
    warmup: int = 2  # untimed steps per arm before the first round (compilation included)
    arm_timeout_s: float = 900.0  # the longest wait for one arm's reply
    emb_tables: int = 8
    emb_rows: int = 100_000
    emb_dim: int = 64
    emb_batch: int = 4096
    emb_bag: int = 20
    emb_batches: int = 2  # distinct batches cycled through
    emb_learning_rate: float = 0.05
    emb_torchrec_variants: tuple[str, ...] = TORCHREC_VARIANTS
    gen_vocab: int = 512  # the generation case's Llama (random weights, RoPE theta 1e6)
    gen_d_model: int = 128
    gen_layers: int = 4
    gen_heads: int = 4
    gen_kv_heads: int = 2
    gen_d_ff: int = 256
    gen_sequences: int = 64
    gen_prompt_len: int = 16
    gen_max_new: int = 64
    gen_page_size: int = 16
    gen_group_size: int = 8  # G of generation_grpo (sequences per prompt)
    gen_decode_steps: int = 1  # the engine's EngineConfig.decode_steps (decode steps per host round trip)
    gen_prefill_rows: int = 0  # its prefill_rows; 0 = every prompt in one prefill call
    gen_loop_steps: int = 64  # its loop_steps (the multi-step decode loop, at most gen_max_new used); 0 = not passed
    grpo_learning_rate: float = 1e-4  # grpo_iteration's constant AdamW learning rate (every arm)
    peers: PeersConfig = PeersConfig()

    def __post_init__(self):
        bad = [c for c in self.cases if c not in CASES]
        if bad or not self.cases:
            raise ValueError(f"cases={self.cases!r}; valid: one or more of {', '.join(CASES)}")
        bad = [v for v in self.emb_torchrec_variants if v not in TORCHREC_VARIANTS]
        if bad:
            raise ValueError(f"emb_torchrec_variants={self.emb_torchrec_variants!r}; valid: "
                             f"a subset of {', '.join(TORCHREC_VARIANTS)}")
        if self.gen_d_model % self.gen_heads or self.gen_heads % self.gen_kv_heads:
            raise ValueError(f"gen_d_model={self.gen_d_model}, gen_heads={self.gen_heads}, gen_kv_heads="
                             f"{self.gen_kv_heads}; valid: heads divide d_model and kv_heads divide heads")
        if {"generation_grpo", "grpo_iteration"} & set(self.cases) and self.gen_sequences % self.gen_group_size:
            raise ValueError(f"gen_group_size={self.gen_group_size} with gen_sequences={self.gen_sequences}; valid: "
                             "a group size dividing gen_sequences")
        if "generation_long_tail" in self.cases and self.gen_vocab <= self.gen_max_new + 1:
            raise ValueError(f"gen_vocab={self.gen_vocab} with gen_max_new={self.gen_max_new}: the long-tailed "
                             "case writes each length as a token id; valid: gen_vocab > gen_max_new + 1")


def _quick() -> Config:
    return Config(rounds=4, steps=2, emb_rows=20_000, emb_dim=32, emb_batch=1024, gen_vocab=256, gen_d_model=64,
                  gen_layers=2, gen_d_ff=128, gen_sequences=16, gen_max_new=32)


def _default() -> Config:
    return Config(rounds=6)


def _full() -> Config:
    return Config(rounds=10)


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
