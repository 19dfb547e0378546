"""bench_checkpoint: Hugging Face checkpoint loading, forward throughput vs transformers, and
the MoE layer's all-to-all expert parallelism vs the dense all-experts reference.

1. ``from_pretrained`` of a random Llama-style checkpoint the benchmark writes (bf16 tensors,
   ~1.03B parameters in ``default``), in a fresh process: load seconds and peak resident
   memory growth over the tensor bytes (target <= 1.2x).
2. Forward tokens/s of one small Qwen3 checkpoint loaded by jaxflow and by transformers
   (f32, CPU), alternated pairs, median ratio. Needs the ``parity`` extra.
3. MoE layer at 8 experts on 8 fake CPU devices: ``moe_expert_parallel`` (shard_map
   all-to-all, capacity factor) vs ``moe_dense`` with tokens sharded the same way;
   alternated pairs, median ratio, and the dropped-token fraction.

    python -m jaxflow.run --exp=bench_checkpoint --variant=quick     # ~1-2 min, 8 devices
    python -m jaxflow.run --exp=bench_checkpoint --variant=default   # the 1B load
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, INT64_MAX, POSITIVE, SEED, Int, domains

DESCRIPTION = "HF checkpoint load time / memory, forward vs transformers, MoE all-to-all vs dense"
ENTRY = "jaxflow.main.bench_checkpoint:main"
HEADLINES = "jaxflow.study.headlines_bench:bench_checkpoint"


@domains(vocab_size=COUNT, d_model=COUNT, n_layers=COUNT, n_heads=COUNT, n_kv_heads=COUNT, d_ff=COUNT,
         max_shard_bytes=Int(1, INT64_MAX))
@dataclasses.dataclass(frozen=True)
class LoadBench:
    vocab_size: int = 32000
    d_model: int = 2048
    n_layers: int = 20
    n_heads: int = 16
    n_kv_heads: int = 8
    d_ff: int = 5632
    dtype: str = "bfloat16"
    max_shard_bytes: int = 2**30


@domains(vocab_size=COUNT, d_model=COUNT, n_layers=COUNT, n_heads=COUNT, n_kv_heads=COUNT, d_ff=COUNT,
         batch=COUNT, seq_len=COUNT, pairs=COUNT)
@dataclasses.dataclass(frozen=True)
class ForwardBench:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    d_ff: int = 768
    batch: int = 4
    seq_len: int = 128
    pairs: int = 10


@domains(tokens=COUNT, d_model=COUNT, d_ff_expert=COUNT, n_experts=COUNT, k=COUNT, capacity_factor=POSITIVE,
         pairs=COUNT)
@dataclasses.dataclass(frozen=True)
class MoEBench:
    tokens: int = 4096
    d_model: int = 256
    d_ff_expert: int = 512
    n_experts: int = 8
    k: int = 2
    capacity_factor: float = 1.25
    pairs: int = 10


@domains(seed=SEED, devices=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    devices: int = 8  # fake CPU devices (the MoE part's expert mesh)
    scratch_dir: str = ""  # where the load benchmark writes its checkpoint ("" = a temp dir)
    load: LoadBench = LoadBench()
    forward: ForwardBench = ForwardBench()
    moe: MoEBench = MoEBench()


def _quick() -> Config:
    return Config(load=LoadBench(vocab_size=8192, d_model=512, n_layers=8, n_heads=8,
                                 n_kv_heads=4, d_ff=1536, max_shard_bytes=2**26),
                  forward=ForwardBench(pairs=10),
                  moe=MoEBench(tokens=2048, d_model=128, d_ff_expert=256, pairs=10))


def _default() -> Config:
    return Config(forward=ForwardBench(pairs=20), moe=MoEBench(pairs=20))


get_config = Variants(quick=_quick, default=_default)
VARIANTS = get_config.variants
