"""The ``flexmarl_scale`` experiment: the FlexMARL cluster simulator at 8-64 nodes.

The model (workload, rollout pool, schedules, calibration) is :mod:`jaxflow.marl.simulate`;
this driver sweeps it and reports the speedups beside the paper's figures with a plot
(:mod:`jaxflow.marl.scale_report`).
"""

from __future__ import annotations

from jaxflow.marl.scale_report import plot_scale, scale_summary
from jaxflow.marl.simulate import calibration_summary, load_measurement


def main(config, run) -> dict:
    """The ``flexmarl_scale`` experiment: summary keys per node count (strings)."""
    cal = load_measurement(config.calibration)
    calibration = calibration_summary(cal)
    if calibration["warning"]:
        run.info(f"WARNING calibration {cal.path}: {calibration['warning']}")
    summary = scale_summary(config, cal.measured, calibration, run.log, run.info)
    if run.is_primary:
        plot_scale(summary, config.nodes, run.out_dir / "plots" / "flexmarl_scale.png")
    return summary
