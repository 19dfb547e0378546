"""NestPipe (arXiv 2604.06956): staleness-free pipelining of host-resident embedding training on a mesh.

``stages.py`` the host-side stages (data, host-to-device); ``device_stages.py`` the device
stages as pure per-device functions (route, exchange, forward-backward, gradient accumulation,
update, patch); ``sharded.py`` the programs composing them (jit + ``shard_map``); ``host_io.py``
per-shard retrieval / write-back threads; ``buffers.py`` the dual-buffer intersection patch;
``clustering.py`` key-centric sample clustering; ``pipelines.py`` the schedules (sync, dbp,
semi_sync, sparse_dist; fwp, dbp+fwp: the paper's frozen window; sync_accum: the whole
window routed once, sync plus gradient accumulation); ``model.py`` what a run is made of from
its config (mesh, tables, DLRM, stage programs); ``system.py`` ``NestPipeSystem``, the
``jaxflow.system.System`` whose pipeline is one of those schedules; ``exactness.py`` the
pipelines against sync (after K steps and per step); ``benchmark.py`` their paired timing, stage
times and clustering figures; ``simulate`` the cluster-scale simulator (a package). The
``nestpipe`` and ``nestpipe_scale`` experiments live in ``jaxflow/main/``.
"""

from jaxflow.nestpipe.buffers import intersection_slots, patch_intersection_rows
from jaxflow.nestpipe.clustering import (
    CLUSTER_METHODS,
    cluster_groups,
    cluster_samples,
    micro_batch_transfers,
    shard_micro_batch_transfers,
)
from jaxflow.nestpipe.host_io import HostShards
from jaxflow.nestpipe.pipelines import PIPELINES, Parts, prefetch, run_pipeline
from jaxflow.nestpipe.sharded import AXIS, MeshStages, OwnerBuffer, Routed
from jaxflow.nestpipe.stages import DeviceBatch, clone_tables, cluster_order, load_batch, reorder_batch, to_device
from jaxflow.nestpipe.system import NestPipeState, NestPipeSystem

__all__ = [
    "AXIS", "CLUSTER_METHODS", "PIPELINES", "clone_tables", "cluster_groups", "cluster_order",
    "cluster_samples", "DeviceBatch", "HostShards", "intersection_slots", "load_batch",
    "MeshStages", "micro_batch_transfers", "NestPipeState", "NestPipeSystem", "OwnerBuffer",
    "Parts", "patch_intersection_rows", "prefetch", "reorder_batch", "Routed", "run_pipeline",
    "shard_micro_batch_transfers", "to_device",
]
