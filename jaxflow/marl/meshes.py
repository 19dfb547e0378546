"""Device meshes for multi-agent RL: per agent a trainer mesh and a rollout mesh.

Agent-centric allocation (FlexMARL): the rollout role takes half the devices and the trainer
devices are split over agents in proportion to their parameter counts, so agents train on
disjoint devices.
"""

from __future__ import annotations

from jaxflow.marl.balance import allocate_workers
from jaxflow.mesh import role_meshes


def agent_centric_meshes(wf, n_dev: int) -> dict[str, dict]:
    """Per agent: {"trainer": mesh, "rollout": mesh}. 1 device: everything colocated. 2: the
    trainer / rollout halves. >= 3: rollout gets n // 2 devices and the trainer devices are
    split over agents in proportion to their parameter counts (agent-centric allocation,
    :func:`~jaxflow.marl.balance.allocate_workers`), so agents train on disjoint devices."""
    names = wf.order()
    if n_dev == 1:
        mesh = role_meshes({"trainer": 1})["trainer"]
        return {n: {"trainer": mesh, "rollout": mesh} for n in names}
    n_roll = n_dev // 2
    n_train = n_dev - n_roll
    if n_train < len(names):
        m = role_meshes({"trainer": n_train, "rollout": n_roll})
        return {n: m for n in names}
    sizes = {n: float(_n_params(wf.agent(n).model)) for n in names}
    split = allocate_workers(sizes, n_train)
    m = role_meshes({f"trainer/{n}": split[n] for n in names} | {"rollout": n_roll})
    return {n: {"trainer": m[f"trainer/{n}"], "rollout": m["rollout"]} for n in names}


def _n_params(cfg) -> int:
    """Approximate parameter count of a ``TransformerConfig`` (for the split only)."""
    d, f, L, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab_size
    return v * d + L * (4 * d * d + 3 * d * f)  # order of magnitude: for the split only
