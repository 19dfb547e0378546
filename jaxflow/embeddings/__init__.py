"""Sharded embedding tables for recommendation (TorchRec-style): placement, routing, lookup, sparse
optimizers, host-resident tables, checkpoints. See ``lookup.py`` for the stage list; ``bench`` is
the ``bench_embedding`` measurement (this layer vs ``jnp.take`` baselines, the Pallas bag kernel).
``step`` is the train step: on a one-device CPU mesh it runs ``fused_step`` (the compiled host
kernels of ``host_kernel``: pooling straight from the table, dedup + row-gradient accumulation +
optimizer fused in place, FBGEMM TBE's design), else the ``shard_map`` stages; ``ffi_abi`` the XLA FFI
call-frame layout those kernels read, checked against jaxlib's header at load."""

from jaxflow.embeddings import bench, ffi_abi, fused_step, host_kernel
from jaxflow.embeddings.lookup import (
    CapacityOverflowError,
    GroupContext,
    ShardedEmbeddings,
    apply_owner_update,
    check_stats,
    exchange_grads,
    exchange_ids,
    exchange_rows,
    gather_rows,
    group_forward,
    group_pool,
    group_update,
    unique_rows,
)
from jaxflow.embeddings.optimizers import SparseOptimizer, adam, make_sparse_optimizer, rowwise_adagrad, sgd
from jaxflow.embeddings.pooling import PoolingBackend, pool_bags
from jaxflow.embeddings.routing import Routing, apply_id_policy, check_ids_host, dedup, route_ids
from jaxflow.embeddings.spec import EmbeddingPlan, IdPolicy, Placement, Pooling, TableSpec, plan_tables
from jaxflow.embeddings.step import STEP_BACKENDS, make_train_step, step_backend

__all__ = [
    "bench", "ffi_abi", "fused_step", "host_kernel", "STEP_BACKENDS", "step_backend",
    "adam", "apply_id_policy", "apply_owner_update", "CapacityOverflowError", "check_ids_host",
    "check_stats", "dedup", "EmbeddingPlan", "exchange_grads", "exchange_ids", "exchange_rows",
    "gather_rows", "group_forward", "group_pool", "group_update", "GroupContext", "IdPolicy",
    "make_sparse_optimizer", "make_train_step", "Placement", "plan_tables", "pool_bags",
    "Pooling", "PoolingBackend", "route_ids", "Routing", "rowwise_adagrad", "sgd",
    "ShardedEmbeddings", "SparseOptimizer", "TableSpec", "unique_rows",
]
