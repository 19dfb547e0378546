"""Moving the trainer's weights to the rollout sub-mesh: one function, ``publish_weights``.

Dense for now: every parameter is copied with ``jax.device_put`` into the rollout mesh's
shardings (a cross-mesh transfer when the roles are disjoint, a no-op copy when they share
devices). The weight-sync issues replace the inside of this function (sparse / compressed
deltas); its contract stays: trainer params in, rollout-mesh params out, equal values.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def publish_weights(params: Any, rollout_shardings: Any) -> Any:
    """A copy of ``params`` (pure-dict pytree on the trainer mesh) laid out on the rollout mesh.

    Args:
      params: the trainer's parameters.
      rollout_shardings: same structure, a ``jax.sharding.Sharding`` per leaf (e.g.
        ``lm_functions(model_cfg, rollout_mesh).param_shardings``).

    Returns:
      The parameters on the rollout devices, bit-identical values. The trainer may donate or
      update its own copy afterwards: the result shares no buffers with ``params`` when the
      meshes are disjoint, and is an explicit copy when they share devices.
    """
    def move(x, sharding):
        if getattr(x, "sharding", None) == sharding:
            return jax.numpy.array(x, copy=True)  # same devices: still a private copy
        return jax.device_put(x, sharding)

    return jax.tree.map(move, params, rollout_shardings)


def published_bytes(params: Any) -> int:
    """Bytes a dense publish moves (the sum of the parameters' sizes)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(params)))
