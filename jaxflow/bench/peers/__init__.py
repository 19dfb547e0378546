"""jaxflow and its peers (TorchRec, tunix, TRL) on the same work, measured inside the
project (the ``bench_peers`` experiment): each arm is a process of its own, the peers' run by their
own interpreters (``scripts/peer_venvs.sh``), and they take turns in alternated rounds.

Modules:
  arm_protocol  the arm side of the line protocol (standard library only; the peers' scripts
                import it from this folder)
  harness       arm processes, alternated rounds, paired ratios and their ranges, headlines
  workloads     the work written once as raw array files every arm reads
  cases         which arms run which case with which interpreter; a case's figures
  jaxflow_arm   jaxflow's arms (``python -m jaxflow.bench.peers.jaxflow_arm``)
  torchrec_arm  TorchRec's fused / unfused embedding arms (a script for the TorchRec venv)
  tunix_arm     tunix's Sampler on the generation cases, its GRPOLearner on the GRPO iteration
                (a script for the tunix venv)
  trl_arm       TRL's GRPOTrainer on the GRPO iteration (a script for the TRL venv)
"""

# the arm modules are run as programs (``-m`` / a script path), so the package does not import them
from jaxflow.bench.peers import arm_protocol, cases, harness, workloads
from jaxflow.bench.peers.cases import build_cases, summarize_case
from jaxflow.bench.peers.harness import ArmError, ArmProcess, ArmSpec, pair_ratios, run_alternated

__all__ = [
    "arm_protocol", "cases", "harness", "jaxflow_arm", "torchrec_arm", "trl_arm", "tunix_arm", "workloads",
    "ArmError", "ArmProcess", "ArmSpec", "build_cases", "pair_ratios", "run_alternated", "summarize_case",
]
