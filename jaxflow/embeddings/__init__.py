"""Sharded embedding tables for recommendation (TorchRec-style): placement, routing, lookup, sparse
optimizers, host-resident tables, checkpoints. See ``lookup.py`` for the stage list; ``bench`` is
the ``bench_embedding`` measurement (this layer vs ``jnp.take`` baselines, the Pallas bag kernel)."""

from jaxflow.embeddings import bench
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
from jaxflow.embeddings.step import make_train_step

__all__ = [
    "bench",
    "adam", "apply_id_policy", "apply_owner_update", "CapacityOverflowError", "check_ids_host",
    "check_stats", "dedup", "EmbeddingPlan", "exchange_grads", "exchange_ids", "exchange_rows",
    "gather_rows", "group_forward", "group_pool", "group_update", "GroupContext", "IdPolicy",
    "make_sparse_optimizer", "make_train_step", "Placement", "plan_tables", "pool_bags",
    "Pooling", "PoolingBackend", "route_ids", "Routing", "rowwise_adagrad", "sgd",
    "ShardedEmbeddings", "SparseOptimizer", "TableSpec", "unique_rows",
]
