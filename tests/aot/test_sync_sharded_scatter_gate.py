"""Compile gate for the replica scatter's kernel on multi-chip replicas.

``jaxflow.sync.receiver._sharded_kernel_scatter`` (``sync_scatter_apply`` per shard inside a
``shard_map``) is compiled by the real compilers for a replica leaf sharded over abstract
chips: XLA:TPU with Mosaic on a v5p 2x2x1 mesh (model = 4) and XLA:GPU with Triton on 8 x H100
(model = 8). The leaf is a Qwen3-8B MLP weight (bf16 [4096, 12288], columns over "model"), each
device taking 5% of its shard's elements as deltas. Every device must run the kernel on its
own shard with no collective, holding 1/tp of the leaf.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.sync import receiver
from pallas_kernels import targets

LEAF = (4096, 12288)
CHANGED = 0.05
MESHES = {"v5p": ("v5p:2x2x1", 4), "h100": ("1x1x8", 8)}  # chip: (topology, model axis)
KERNEL_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


@pytest.mark.parametrize("chip", sorted(MESHES))
def test_sharded_replica_scatter_compiles_per_shard(chip):
    topology, tp = MESHES[chip]
    mesh = targets.mesh(chip, (1, tp), ("data", "model"), topology)
    spec = P(None, "model")
    capacity = receiver._capacity(int(math.prod(LEAF) // tp * CHANGED))
    rows = NamedSharding(mesh, P("data", "model", None))
    args = (jax.ShapeDtypeStruct(LEAF, jnp.bfloat16, sharding=NamedSharding(mesh, spec)),
            jax.ShapeDtypeStruct((1, tp, capacity), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((1, tp, capacity), jnp.uint16, sharding=rows))
    fn = functools.partial(receiver._sharded_kernel_scatter, mesh=mesh, spec=spec, delta=True,
                           interpret=False)
    r = targets.compile_on(fn, args, chip, mesh=mesh, keep_hlo=True)
    assert r.ok, f"{chip} x{tp}: {r.error}"
    assert KERNEL_CALL[targets.chip(chip).platform] in r.hlo_text
    assert not [c for c in COLLECTIVES if c in r.hlo_text], "a collective in the per-shard scatter"
    shard = math.prod(LEAF) // tp * 2  # bytes; the update lists add 6 bytes per slot, padded
    # to the chip's tiles (TPU: 33.5 MB where shard + lists are 31.5 MB)
    assert shard + 6 * capacity <= r.argument_bytes <= shard + 16 * capacity, r.argument_bytes


def test_compile_only_sync_programs_carry_the_per_shard_kernel():
    """``jaxflow.sync.programs.sync_programs`` (what ``--compile-only`` reports for a publish)
    builds the replica scatter as a multi-chip replica runs it under ``auto``: the kernel."""
    from jaxflow.sync.programs import sync_programs

    mesh = targets.mesh("v5p", (1, 4), ("data", "model"), "v5p:2x2x1")
    sharding = NamedSharding(mesh, P(None, "model"))
    params = {"w": jax.ShapeDtypeStruct(LEAF, jnp.float32, sharding=sharding)}
    programs = {p.name: p for p in sync_programs(params, {"w": sharding}, {"w": sharding},
                                                  mesh, mesh)}
    scatter = programs["sync/replica_scatter_largest_leaf"]
    assert "Pallas kernel" in scatter.note, scatter.note
    r = targets.compile_on(scatter.fn, scatter.args, "v5p", mesh=scatter.mesh, keep_hlo=True)
    assert r.ok, r.error
    assert KERNEL_CALL["tpu"] in r.hlo_text
    assert not [c for c in COLLECTIVES if c in r.hlo_text]
