"""The devices and meshes a run gets, worked out before anything runs (the runner's start-up,
``--dry-run`` and the variant tests): ``default_devices`` from the flags and the config,
``resolve_meshes`` from the config and its driver (:mod:`jaxflow.contract`)."""

from __future__ import annotations

import argparse
from typing import Sequence

from jaxflow import contract


def default_devices(args: argparse.Namespace, config) -> int | None:
    """``--devices``, else the experiment's own ``devices`` field for a single-process run, so
    ``--exp=NAME --variant=quick`` runs as written on a CPU: an int N > 1 gives N fake CPU
    devices, ``None`` (a multi-device experiment that spans every device present) gives
    :data:`jaxflow.mesh.CPU_FAKE_DEVICES`. The count only creates fake CPU devices; on a GPU / TPU
    backend the meshes span the accelerators present (see :func:`resolve_meshes`)."""
    from jaxflow.mesh import CPU_FAKE_DEVICES

    if args.devices is not None or args.coordinator is not None or args.distributed_auto:
        return args.devices
    if not isinstance(config, contract.WithDevices):
        return None
    wanted = config.devices
    if wanted is None:
        return CPU_FAKE_DEVICES
    return wanted if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 1 else None


def resolve_meshes(spec, config, devices: Sequence | None = None) -> dict:
    """Every mesh the experiment ``spec`` would build from ``config`` on ``devices`` (default
    ``jax.devices()``), built without running anything: the driver's own
    ``resolve_meshes(config, devices)`` when it has one (:class:`jaxflow.contract.MeshResolver`),
    else the config's ``mesh`` (:class:`~jaxflow.mesh.MeshConfig`) and ``roles`` (trainer /
    rollout) fields (:mod:`jaxflow.contract`). ``{}`` for an
    experiment with neither (it runs on one device or on all of them).

    Raises:
      MeshError / ValueError / ConfigError: the devices cannot form a mesh the config asks for
        (e.g. a batch size not divisible by the resolved device count), naming the values.
    """
    import importlib

    import jax

    from jaxflow.mesh import trainer_rollout_meshes

    devices = list(jax.devices() if devices is None else devices)
    driver = importlib.import_module(spec.entry.partition(":")[0])
    if isinstance(driver, contract.MeshResolver):
        return dict(driver.resolve_meshes(config, devices))
    out = {}
    if (mesh_cfg := contract.config_mesh(config)) is not None:
        out["mesh"] = mesh_cfg.make(devices)
    if (roles := contract.config_roles(config)) is not None:
        out.update(trainer_rollout_meshes(roles, devices)[0])
    return out
