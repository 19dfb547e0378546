"""Logical-axis sharding rules for the decoder: FSDP + tensor parallelism + expert parallelism.

Mesh axes (any subset may be present; absent or size-1 axes mean "replicated"):

  "data"    pure data parallelism (activations' batch only)
  "fsdp"    ZeRO-3-style: the batch AND every parameter's "embed" dimension (the attention
            projections' "attn_embed") are split over it
            (Rajbhandari et al., 2020; Zhao et al., 2023, "PyTorch FSDP")
  "model"   Megatron tensor parallelism: heads, kv heads, MLP hidden and vocab
            (Shoeybi et al., 2019)
  "expert"  expert parallelism: the expert axis of MoE weights (GShard, Lepikhin et al., 2020)

A dimension whose size the mesh axis does not divide stays replicated
(``jaxflow.mesh.shardings_from_logical``). Check with
``jaxflow.mesh.assert_params_sufficiently_sharded(params, mesh, axes=("fsdp", "model"))``.
"""
from __future__ import annotations

from jaxflow.mesh import LogicalRules

FSDP_TP_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("attn_embed", "fsdp"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("mlp", "model"),
    ("expert", "expert"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
)
