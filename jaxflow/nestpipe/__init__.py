"""NestPipe (issue 8): staleness-free pipelining of host-resident embedding training.

``stages.py`` the five stage functions; ``buffers.py`` the dual-buffer intersection patch;
``clustering.py`` key-centric sample clustering; ``pipelines.py`` the schedules (sync, dbp,
semi_sync, fwp, dbp+fwp); ``experiment.py`` the ``nestpipe`` experiment.
"""

from jaxflow.nestpipe.buffers import intersection_slots, patch_intersection_rows
from jaxflow.nestpipe.clustering import CLUSTER_METHODS, cluster_samples, micro_batch_transfers
from jaxflow.nestpipe.pipelines import PIPELINES, Parts, prefetch, run_pipeline
from jaxflow.nestpipe.stages import (DeviceBatch, Routed, clone_tables, load_batch, make_compute,
                                     reorder_batch, retrieve_rows, route_keys, to_device,
                                     write_back)
