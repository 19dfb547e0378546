"""Moving the trainer's weights to the rollout sub-mesh: one function, ``publish_weights``.

Without ``sync``: every parameter is copied with ``jax.device_put`` into the rollout mesh's
shardings (a cross-mesh transfer when the roles are disjoint, a no-op copy when they share
devices); values are equal. With ``sync`` (a :class:`jaxflow.sync.weight_sync.WeightSync`):
the trainer's params are cast to bf16, the changed bit patterns since the last sync are
encoded and applied to the bf16 replicas on the rollout mesh, and the first replica's params
are returned (bit-identical to the trainer's bf16 cast). :class:`jaxflow.rl.grpo.GRPOTrainer`
passes its own WeightSync here when its ``sync.codec`` is not "none".
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def publish_weights(params: Any, rollout_shardings: Any, *, sync: Any = None,
                    version: int | None = None) -> Any:
    """A copy of ``params`` (pure-dict pytree on the trainer mesh) laid out on the rollout mesh.

    Args:
      params: the trainer's parameters.
      rollout_shardings: same structure, a ``jax.sharding.Sharding`` per leaf (e.g.
        ``lm_functions(model_cfg, rollout_mesh).param_shardings``).

    Returns:
      The parameters on the rollout devices, bit-identical values. The trainer may donate or
      update its own copy afterwards: the result shares no buffers with ``params`` when the
      meshes are disjoint, and is an explicit copy when they share devices.
      With ``sync``: the bf16 rollout replica's params at ``version`` (default: the sync's
      version + 1); ``rollout_shardings`` was fixed when the WeightSync was built.
    """
    if sync is not None:
        sync.publish(params, version=sync.version + 1 if version is None else version)
        return sync.rollout_params()
    def move(x, sharding):
        if getattr(x, "sharding", None) == sharding:
            return jax.numpy.array(x, copy=True)  # same devices: still a private copy
        return jax.device_put(x, sharding)

    return jax.tree.map(move, params, rollout_shardings)


def published_bytes(params: Any) -> int:
    """Bytes a dense publish moves (the sum of the parameters' sizes)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(params)))
