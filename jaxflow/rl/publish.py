"""Moving the trainer's weights to the rollout sub-mesh: one function, ``publish_weights``.

Without ``sync``: every parameter is copied with ``jax.device_put`` into the rollout mesh's
shardings (a cross-mesh transfer when the roles are disjoint, a no-op copy when they share
devices); values are equal. With ``sync`` (a :class:`jaxflow.sync.weight_sync.WeightSync`):
the trainer's params are cast to bf16, the changed bit patterns since the last sync are
encoded and applied to the bf16 replicas on the rollout mesh, and the first replica's params
are returned (bit-identical to the trainer's bf16 cast).

A trainer publishes through a :class:`Publisher`: :class:`DensePublisher` (the f32 copy, with a
queue for async staleness k) or :class:`SyncPublisher` (SparseRL-Sync replicas), both keeping
the same state layout. A publish returns what it sent: the sync's
:class:`jaxflow.sync.weight_sync.SyncRecord`, or None when nothing went through a weight sync.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

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
    same = jax.tree.map(lambda x, s: getattr(x, "sharding", None) == s, params,
                        rollout_shardings)
    if all(jax.tree.leaves(same)):  # same devices: still a private copy, one program
        return _copy_tree(params)

    def move(x, sharding):
        if getattr(x, "sharding", None) == sharding:
            return jax.numpy.array(x, copy=True)
        return jax.device_put(x, sharding)

    return jax.tree.map(move, params, rollout_shardings)


@jax.jit
def _copy_tree(tree: Any) -> Any:
    """A copy of every leaf in fresh buffers (no donation, so no output aliases an input)."""
    return jax.tree.map(jax.numpy.copy, tree)


def published_bytes(params: Any) -> int:
    """Bytes a dense publish moves (the sum of the parameters' sizes)."""
    return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------- publishers
#
# The trainer's state holds what the rollouts sample with in one layout, whichever publisher:
#   state["published"]:          a tuple of n parameter trees on the rollout mesh, oldest first
#   state["published_version"]:  int32[n], the trainer version (optimizer step) of each entry
#   state["published_origin"]:   uint32[4], the digest of the params the run started from
# A rollout samples with entry 0. The dense publisher keeps n = k + 1 (async staleness k); the
# SparseRL-Sync publisher keeps n = 1, the serving bf16 replica's params. (version, origin)
# names a published tree within and across processes: a restored checkpoint keeps both.


class Publisher(Protocol):
    """How a trainer hands its weights to the rollout mesh (see the layout above)."""

    def init(self, params: Any, origin: jax.Array) -> tuple[tuple, jax.Array]:
        """(published, published_version) at version 0 from the trainer's initial params
        (whose :func:`params_origin` is ``origin``)."""

    def rollout_params(self, published: tuple, versions: jax.Array, origin: jax.Array) -> Any:
        """The params a rollout samples with (rollout mesh, f32)."""

    def publish(self, published: tuple, versions: jax.Array, params: Any, step: jax.Array, *,
                rollout: int, origin: jax.Array) -> tuple[tuple, jax.Array, Any]:
        """(published, published_version, sent) after rollout ``rollout``'s updates, which
        left the trainer at optimizer step ``step`` with ``params``. ``sent``: the
        ``SyncRecord`` of the weight sync this publish made, or None (a dense copy, or a
        rollout that was not due to sync)."""


class DensePublisher:
    """Dense f32 copies into the rollout mesh's shardings, a queue of ``staleness + 1``: rollout r
    samples the weights published after rollout ``r - 1 - staleness`` (version 0 before that)."""

    def __init__(self, rollout_shardings: Any, *, staleness: int = 0):
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness={staleness!r}: need an int >= 0")
        self.rollout_shardings, self.staleness = rollout_shardings, staleness

    def init(self, params, origin):
        n = self.staleness + 1
        published = tuple(publish_weights(params, self.rollout_shardings) for _ in range(n))
        return published, _versions(jax.numpy.zeros((n,), jax.numpy.int32), params)

    def rollout_params(self, published, versions, origin):
        return published[0]

    def publish(self, published, versions, params, step, *, rollout, origin):
        new = publish_weights(params, self.rollout_shardings)
        return (tuple(published[1:]) + (new,),
                jax.numpy.concatenate([versions[1:], step[None]]), None)


class SyncPublisher:
    """SparseRL-Sync: the trainer's bf16 cast is synced into replicas on the rollout mesh every
    ``config.every`` rollouts; the state holds the serving replica's bf16 params.

    The :class:`jaxflow.sync.weight_sync.WeightSync` lives here, outside the state. A state
    whose (published version, origin) is not the replica's -- a restored checkpoint, a fresh
    publisher, a run started from other params -- is served after a dense resync of fresh
    replicas from the state's own bf16 params, so resuming is bit-exact. Within one run (one
    origin) a state is a pure function of its version, so equal versions hold equal params.

    Args:
      rollout_shardings: the rollout mesh's parameter shardings.
      config: a :class:`jaxflow.sync.weight_sync.SyncConfig`.
      links: extra links (e.g. TCP replica processes) that receive every sync too.
    """

    def __init__(self, rollout_shardings: Any, config: Any, *, links: Sequence[Any] = ()):
        self.rollout_shardings, self.config, self.links = rollout_shardings, config, tuple(links)
        self.weight_sync = None  # jaxflow.sync.weight_sync.WeightSync, once init / served
        self._origin: bytes | None = None  # the lineage weight_sync serves

    def init(self, params, origin):
        from jaxflow.sync.weight_sync import WeightSync

        self.weight_sync = WeightSync(params, self.rollout_shardings, self.config, version=0,
                                      links=self.links)
        if self.links:  # extra links (replica processes) start fresh
            self.weight_sync.catch_up()
        self._origin = np.asarray(origin).tobytes()
        bf16 = self.weight_sync.rollout_params()
        return (bf16,), _versions(jax.numpy.zeros((1,), jax.numpy.int32), params)

    def serving(self, published, versions, origin):
        """The WeightSync at the state's published version and origin (resynced when not)."""
        from jaxflow.sync.weight_sync import WeightSync

        version, lineage = int(versions[0]), np.asarray(origin).tobytes()
        ws = self.weight_sync
        if ws is None or ws.version != version or self._origin != lineage:
            self.weight_sync = ws = WeightSync.resume(
                published[0], self.rollout_shardings, self.config, version=version,
                links=self.links)
            self._origin = lineage
        return ws

    def rollout_params(self, published, versions, origin):
        from jaxflow.sync.replica import VersionMismatch

        ws = self.serving(published, versions, origin)
        bf16 = ws.rollout_params()  # the per-rollout version check (catch-up or error)
        expected = int(versions[0])
        if ws.replicas[0].version != expected:
            raise VersionMismatch(f"rollout replica is at version {ws.replicas[0].version}, "
                                  f"the state's published version is {expected}")
        return jax.tree.map(
            lambda x: x.astype(jax.numpy.float32) if jax.numpy.issubdtype(
                x.dtype, jax.numpy.floating) else x, bf16)

    def publish(self, published, versions, params, step, *, rollout, origin):
        ws = self.serving(published, versions, origin)
        if not ws.due(rollout + 1):  # ``every`` counts rollouts
            return published, versions, None
        record = ws.publish(params, version=int(step))
        return (ws.rollout_params(),), step[None], record


def _versions(zeros: jax.Array, like: Any) -> jax.Array:
    """``zeros`` replicated on the devices of ``like``'s first leaf."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = getattr(jax.tree.leaves(like)[0], "sharding", None)
    if isinstance(sharding, NamedSharding):
        from jaxflow.distributed import put

        return put(np.asarray(zeros), NamedSharding(sharding.mesh, PartitionSpec()))
    return zeros


def params_origin(params: Any) -> jax.Array:
    """uint32[4]: the on-device digest (``jaxflow.sync.digest.device_digest``) of ``params``,
    the tag ``state["published_origin"]`` that tells one run's published trees from another's."""
    from jaxflow.sync.digest import device_digest

    words = np.frombuffer(bytes.fromhex(device_digest(params)), np.uint32).copy()
    return _versions(jax.numpy.asarray(words), params)
