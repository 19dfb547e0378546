"""Discrete-event simulation of multi-agent LLM RL at cluster scale (FlexMARL, arXiv 2602.09578).

What is simulated, per node count (``devices_per_node`` accelerators per node, one rollout
replica per accelerator):

* Workload: agents in turn order (e.g. solver -> verifier); per version, ``inputs`` prompts and
  ``group_size`` trajectories per agent; response lengths drawn per request from a capped
  lognormal per agent (the skew). A downstream agent's group for input i becomes ready when the
  upstream agent's trajectory 0 of input i finishes (the workflow's edge), and its prompt
  includes that response.
* Decode on a replica is continuous batching with ``slots`` concurrent sequences; one decode
  step with ``b`` active sequences costs ``t(b) = weight_s + b * seq_s`` (memory-bound weight
  read + per-sequence compute), so the cost per token falls with occupancy and a long tail
  decodes at low occupancy. Finished sequences free their slot at once (no wasted steps, in both
  schedules). Prefill is not modelled.
* Training costs ``train_token_s`` per (prompt + response) token, data parallel over the
  agent's training devices (at most one sample per device in flight); a publish costs
  ``publish_s`` per agent and version; a swap of an agent's training state between device and
  host costs ``swap_s``.

Schedules (:class:`Schedule`):

* ``sync`` (MARTI-style baseline): devices split equally between agents and colocated (each
  agent's devices roll out, then train); turns are rolled out in order with a barrier between
  turns; requests are assigned round-robin; after the last turn every agent swaps its training
  state in, trains its full batch, publishes and swaps out; the next version starts after a
  global barrier.
* ``flexmarl``: rollout and training disaggregated, devices split between roles and, within a
  role, between agents in proportion to the expected load (agent-level balancing, from the
  length distributions' means, not the drawn lengths); requests streamed to the agent's
  replicas with a request-level policy (``round_robin`` / ``longest_first`` / ``work_stealing``,
  the rules of :mod:`jaxflow.marl.balance`); each agent's trainer consumes micro-batches as
  samples finish and steps + publishes when version v is complete; rollouts of an agent's
  version u start once its weights of version >= u - eta are published (eta = 0: strict, no
  staleness; eta > 0: bounded staleness). Agents' versions advance independently.

``longest_first`` and ``work_stealing`` use the drawn lengths (an oracle; a real system
estimates them). Busy time: a replica is busy while it has >= 1 active sequence; a training
device while it trains; publish and swap time count as idle. Everything is pure Python/numpy and
deterministic given the seed.

Costs (:func:`calibrate`): the measured ``flexmarl`` quick run's lockstep baseline
(a calibration file written by that run, ``data/flexmarl_quick.json`` by default, with its
commit, command and device count; :func:`load_measurement`) gives dev-CPU
seconds per parameter for a trained token, a decode step (split into a per-sequence part =
trained token / 4 by FLOPs and the rest, the weight part) and a publish; they are scaled to the
simulated agents by parameter count (FLOPs and bytes both grow with it) and by one speed factor
that puts training at ``8 P / (peak * mfu)`` per token on the accelerator. Swap time is
``swap_bytes_per_param * P / host bandwidth`` (an assumption, not measured). The ``flexmarl_scale`` experiment
(``jaxflow/main/flexmarl_scale.py``) sweeps it.

Modules: ``workload`` (agents, lengths, costs), ``pool`` (a rollout replica pool),
``schedules`` (schedules, results, device split), ``simulation`` (the two simulators),
``calibration`` (measured run -> costs), ``sweep`` (a config's node sweep).
"""

from jaxflow.marl.simulate.calibration import (
    COST_KEYS,
    DEFAULT_CALIBRATION,
    MEASURED_PATHS,
    Calibration,
    CalibrationWarning,
    Hardware,
    MeasuredRun,
    calibrate,
    calibration_summary,
    load_measurement,
    measured_from_summary,
    per_param_costs,
    sync_counts,
    write_calibration,
    write_calibration_from_run,
)
from jaxflow.marl.simulate.pool import POLICIES, RolloutPool
from jaxflow.marl.simulate.schedules import (
    AGENT_SPLITS,
    FLEXMARL,
    SYNC,
    Schedule,
    SimResult,
    expected_loads,
    plan_split,
    split_devices,
)
from jaxflow.marl.simulate.simulation import simulate, simulate_flexmarl, simulate_sync
from jaxflow.marl.simulate.sweep import run_scale, schedules_from
from jaxflow.marl.simulate.workload import AgentCosts, AgentLoad, check_agents, sample_lengths

__all__ = ["COST_KEYS", "DEFAULT_CALIBRATION", "MEASURED_PATHS", "Calibration", "CalibrationWarning",
           "Hardware", "MeasuredRun", "calibrate", "calibration_summary", "load_measurement",
           "measured_from_summary", "per_param_costs", "sync_counts", "write_calibration",
           "write_calibration_from_run", "POLICIES", "RolloutPool", "AGENT_SPLITS", "FLEXMARL", "SYNC",
           "Schedule", "SimResult", "expected_loads", "plan_split", "split_devices", "simulate",
           "simulate_flexmarl", "simulate_sync", "run_scale", "schedules_from", "AgentCosts",
           "AgentLoad", "check_agents", "sample_lengths"]
