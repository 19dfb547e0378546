"""Device meshes for multi-agent RL: per agent a trainer mesh and a rollout mesh.

Agent-centric allocation (FlexMARL): the rollout role takes half the devices and the trainer
devices are split over agents in proportion to their parameter counts, so agents train on
disjoint devices. Tensor parallelism: ``trainer_model`` / ``rollout_model`` cap the "model"
axis of each mesh (heads / mlp / vocab sharded by the logical rules); each mesh takes the
largest divisor of its cap that its devices allow (1: data parallel only, no "model" axis).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax

from jaxflow.marl.balance import allocate_workers
from jaxflow.mesh import host_block, process_role_meshes, role_meshes


def _degree(cap: int, n_devices: int, units: int = 1) -> int:
    """The largest divisor d of ``cap`` with ``n_devices % d == 0`` and
    ``n_devices // d >= units`` (1 always qualifies)."""
    return max(d for d in range(1, cap + 1)
               if cap % d == 0 and n_devices % d == 0 and n_devices // d >= units)


def _axes(model: int) -> dict[str, int]:
    return {"data": -1} if model == 1 else {"data": -1, "model": model}


def agent_centric_meshes(wf, n_dev: int, *, devices: Sequence | None = None,
                         trainer_model: int = 1, rollout_model: int = 1) -> dict[str, dict]:
    """Per agent: {"trainer": mesh, "rollout": mesh} on the first ``n_dev`` of ``devices``
    (default ``jax.devices()``). 1 device: everything colocated. Otherwise the rollout role
    gets n // 2 devices (one mesh all agents share); with fewer trainer devices than agents
    one trainer mesh is shared, else the trainer devices are split over agents in proportion
    to their parameter counts (agent-centric allocation,
    :func:`~jaxflow.marl.balance.allocate_workers`, in blocks of the trainers' model degree),
    so agents train on disjoint devices. Meshes are data x model with the model degree
    :func:`_degree` of the caps (see module doc).

    Across P processes (multi-controller JAX) every mesh spans every process alike
    (:func:`jaxflow.mesh.process_role_meshes`): each process gives each role ``count / P`` of
    its devices, so every process runs every agent's programs in the same order, and the
    trainer blocks are lcm(model degree, P) devices (with 2 processes x 4 devices the quick
    config's trainers get 2 + 2 devices where one process gives 3 + 1). On an abstract pod
    slice (one process compiling for many hosts) the blocks are also whole hosts in id order
    (:func:`jaxflow.mesh.host_block`: 8 chips on v5p:4x4x4, 32 on v6e:16x16), the sub-meshes
    libtpu compiles for.

    Raises:
      MeshError: across processes, a role's devices cannot be split evenly over them.
    """
    names = wf.order()
    devices = list(jax.devices() if devices is None else devices)[:n_dev]
    if n_dev == 1:
        mesh = role_meshes({"trainer": 1}, devices=devices)["trainer"]
        return {n: {"trainer": mesh, "rollout": mesh} for n in names}
    # trainer blocks: whole processes (multi-controller) or whole hosts (an abstract pod slice)
    block = math.lcm(jax.process_count(), host_block(devices))
    n_roll = n_dev // 2
    n_train = n_dev - n_roll
    roll_axes = _axes(_degree(rollout_model, n_roll))
    if n_train < len(names) * block:
        m = process_role_meshes({"trainer": n_train, "rollout": n_roll},
                                {"trainer": _axes(_degree(trainer_model, n_train)),
                                 "rollout": roll_axes}, devices=devices)
        return {n: m for n in names}
    # the largest model degree whose blocks (lcm with `block`) give every agent one
    tp = max(d for d in range(1, trainer_model + 1) if trainer_model % d == 0
             and n_train % d == 0 and n_train // math.lcm(d, block) >= len(names))
    unit = math.lcm(tp, block)
    sizes = {n: float(_n_params(wf.agent(n).model)) for n in names}
    split = allocate_workers(sizes, n_train // unit)
    axes = {f"trainer/{n}": _axes(tp) for n in names} | {"rollout": roll_axes}
    m = process_role_meshes({f"trainer/{n}": split[n] * unit for n in names} | {"rollout": n_roll},
                            axes, devices=devices)
    return {n: {"trainer": m[f"trainer/{n}"], "rollout": m["rollout"]} for n in names}


def _n_params(cfg) -> int:
    """Approximate parameter count of a ``TransformerConfig`` (for the split only)."""
    d, f, L, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    return v * d + L * (4 * d * d + 3 * d * f)  # order of magnitude: for the split only
