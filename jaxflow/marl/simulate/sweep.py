"""Every schedule at every node count of a ``flexmarl_scale`` config, as plain data.
"""

from __future__ import annotations

import dataclasses

from jaxflow.marl.simulate.calibration import calibrate, load_measurement
from jaxflow.marl.simulate.schedules import SYNC, Schedule
from jaxflow.marl.simulate.simulation import simulate
from jaxflow.marl.simulate.workload import AgentLoad, check_agents, sample_lengths


def schedules_from(config) -> dict[str, Schedule]:
    """The baseline, FlexMARL strict and the ablations named in the config."""
    mb = config.micro_batch
    out = {"sync": SYNC,
           "flexmarl": Schedule("flexmarl", True, "load", config.request_policy, 0, mb),
           "no_balance": Schedule("no_balance", True, "equal", "round_robin", 0, mb),
           "longest_first": Schedule("longest_first", True, "load", "longest_first", 0, mb)}
    for eta in config.etas:
        out[f"eta{eta}"] = Schedule(f"eta{eta}", True, "load", config.request_policy, eta, mb)
    return out


def run_scale(config, measured=None, *, cost_scale=None, schedules=None) -> dict:
    """Every schedule (or those named in ``schedules``) at every node count; plain data.
    ``measured``: a :class:`MeasuredRun` (None: the config's ``calibration`` file);
    ``cost_scale``: per-parameter cost multipliers (:func:`calibrate`)."""
    agents = tuple(AgentLoad(**dict(a)) if not isinstance(a, AgentLoad) else a
                   for a in config.agents)
    if config.sigma_scale < 0:
        raise ValueError(f"sigma_scale={config.sigma_scale}: must be >= 0")
    agents = tuple(dataclasses.replace(a, len_sigma=a.len_sigma * config.sigma_scale)
                   for a in agents)
    check_agents(agents)
    for key in ("devices_per_node", "slots", "inputs_per_node", "group_size", "versions"):
        if getattr(config, key) < 1:
            raise ValueError(f"{key}={getattr(config, key)}: must be >= 1")
    if config.global_inputs < 0:
        raise ValueError(f"global_inputs={config.global_inputs}: must be >= 0 (0 = weak "
                         "scaling with inputs_per_node)")
    if not config.nodes or min(config.nodes) < 1:
        raise ValueError(f"nodes={config.nodes}: need node counts >= 1")
    if measured is None:
        measured = load_measurement(config.calibration).measured
    costs, info = calibrate(agents, measured, config.hardware, cost_scale)
    scheds = schedules_from(config)
    if schedules is not None:
        scheds = {k: v for k, v in scheds.items() if k in schedules}
    rows = []
    for nodes in config.nodes:
        devices = nodes * config.devices_per_node
        lengths = sample_lengths(agents, versions=config.versions,
                                 inputs=config.global_inputs or nodes * config.inputs_per_node,
                                 group_size=config.group_size, seed=config.seed)
        for name, sched in scheds.items():
            res = simulate(agents, costs, lengths, devices=devices, slots=config.slots,
                           schedule=sched)
            rows.append({"nodes": nodes, "devices": devices, "schedule": name,
                         "wall_s": res.wall_s, "samples": res.samples,
                         "samples_per_s": res.samples_per_s, "utilisation": res.utilisation(),
                         "devices_per_role": res.devices})
    return {"rows": rows, "costs": costs, "calibration": info, "agents": agents}
