"""FlexMARL across processes (multi-controller JAX): what keeps every process in step.

Every mesh of the run spans every process alike
(:func:`jaxflow.marl.meshes.agent_centric_meshes`), so each process runs the same programs on
its own devices; three things would otherwise differ:

* host copies: a parameter or rollout array on a multi-process mesh is fetched with
  :func:`host_tree` (a gather on its own mesh when sharded, a local read when replicated);
* moves between meshes (publishing trainer weights to the rollout mesh, per-row keys made on a
  local device): JAX reshards across processes only within one device set, so they go through
  the host (:func:`put_global`), each process putting its own shards without JAX's
  cross-process equality check (:func:`jaxflow.distributed.put`: that check is a collective
  over every device, which threads would start in different orders);
* decisions taken from a clock (which mode the auto probe picks, which published version a
  bounded-staleness rollout uses): process 0 decides and every process reads its decision from
  the coordination service (:func:`jaxflow.distributed.agree`), never a device collective, so
  a thread may ask while other threads run programs.

With one process every function here is the plain single-controller operation.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxflow.distributed import agree, put, to_host

__all__ = ["agree", "host_tree", "multi_process", "put_global"]


def multi_process() -> bool:
    """True in a multi-controller run (more than one JAX process)."""
    return jax.process_count() > 1


def host_tree(tree: Any) -> Any:
    """Every leaf as a numpy array, the same on every process (:func:`jaxflow.distributed.to_host`)."""
    return jax.tree.map(to_host, tree)


def put_global(x: Any, sharding: jax.sharding.Sharding) -> Any:
    """``jax.device_put(x, sharding)`` that also works when ``sharding`` spans other processes'
    devices and ``x`` is a device array elsewhere (another mesh, or a local device): through
    the host, PRNG key arrays as their key data. ``x`` must hold the same value on every process."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and x.sharding == sharding):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(to_host(jax.random.key_data(x)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return put(to_host(x), sharding)
