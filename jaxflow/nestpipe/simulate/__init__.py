"""A discrete-event simulator of one embedding-heavy training step (NestPipe, the ``nestpipe_scale``
experiment) on 128 -> 1,536 workers for the pipelines sync / semi_sync / dbp / fwp / dbp+fwp.

What is simulated
-----------------
Every worker owns five resources, each serving its queue in issue order like a stream: a pool
of ``host_threads`` CPU threads (data prefetch, retrieval from the host-resident tables, write
back), the host-to-device link, a small "keys" communicator (key routing's All2All), the
network (the All2All of embeddings forward and of gradients backward) and the accelerator
(dense forward/backward + update, the dual-buffer patch). An op starts when its dependencies
have finished and its resource is free; a collective (route, All2All) starts when every worker
has reached it and ends when the slowest worker's part ends, so per-worker variance turns into
straggler waits: op durations are ``mean x lognormal(cv)``, drawn per worker, and a collective
costs the max of N draws. Because every resource serves its queue in issue order (streams,
communicators, a FIFO thread pool), the event queue reduces to issuing ops in program order: an
op's start and end are fixed when it is issued, from its dependencies' ends and its resource's
clock, with no heap. The simulator is vectorised over workers (every worker runs the same
program, so each resource queue has the same order everywhere) and is deterministic given a seed.

Per batch, the stages are: data -> h2d -> route (collective) -> retrieve -> [All2All forward ->
compute -> All2All backward] -> write back. Pipelines (what may overlap):
- ``sync``: all stages one after another, batch after batch (TorchRec's synchronous baseline).
- ``dbp``: batch t+1's data / h2d / route / retrieve run while batch t computes. Two embedding
  buffers: retrieve(t+1) writes the buffer batch t-1 used, so it waits for write_back(t-1) and
  for patch(t) (which reads that buffer); patch(t+1), a device copy of the rows in
  K(B_t) & K(B_t+1) from batch t's freshly updated buffer, runs on the accelerator after batch t's
  update (its backward All2All) and before batch t+1's All2All. data(t+1) waits for
  retrieve(t-1) (a pinned-memory ring of three batches), so prefetch may span two steps.
- ``fwp``: stages serial across batches, but the All2All + compute part is split into
  ``micro_batches`` pieces; the forward All2All of micro-batch i+1 is issued before the backward
  All2All of micro-batch i, so communication overlaps compute. Each piece moves 1/m of the bytes
  (pooled embeddings scale with samples) but pays the full per-call latency. This is the
  paper's overlapped frozen-window schedule (``nestpipe``'s fwp / dbp+fwp, ``per_micro_batch``,
  with async collectives, which the CPU where the calibration was measured does not have);
  ``nestpipe``'s ``sync_accum`` (the window routed and exchanged once, sync's collectives, only
  the backward split) is not modelled: it has nothing to overlap.
- ``dbp+fwp``: both. ``semi_sync``: dbp without the patch (one-step-stale rows, not exact).

Stage costs (calibration)
-------------------------
Mean per-worker costs are in "step units": the sum of the mean stage costs of ``sync`` at the
reference scale N0 = 128 is 1. The paper's shares at N0 give lookup (route + retrieve) = s_L0,
All2All (forward + backward) = s_A0 and the rest 1 - s_L0 - s_A0; inside those groups the split
follows this CPU's measured stage times (a calibration file written by a ``nestpipe`` run,
``data/nestpipe_quick.json`` by default, with its commit, command and device count; see
``calibration``): data : h2d : compute : write_back and route : retrieve.
(``rest_on_accelerator``: count the whole rest as accelerator compute instead; on this CPU data
prep is 34% of the rest, which the pipelines can hide; a large HSTU step is mostly compute.)
Scale laws (weak scaling: the per-worker batch is fixed, so data, h2d, compute, write back and
patch keep their cost):
- lookup(N) = lookup(N0) + c_peer (N - N0)          (per-peer request handling; linear in peers)
- All2All(N) per direction and call = lam (N - 1)  +  [gamma (N - 1) + beta phi(N)] / m:
  a per-peer, per-call latency ``lam`` (set a priori, ``peer_latency_us``; paid by every one of
  fwp's m calls), plus the byte-proportional part (1/m of it per micro-batch): the NIC time
  phi(N) = [(G-1)/r + (min(N,P) - G) + (N - P)+ * o] / N (each worker sends 1/N of its bytes to
  every peer; peers in its node, G per node, at r x the NIC bandwidth, peers in its pod of P at
  the NIC bandwidth, the rest through an o:1 oversubscribed spine, the bisection limit) and a
  congestion term gamma (N - 1) (incast, small messages: effective bandwidth falling with peers).
The free parameters (c_peer; gamma, beta) are solved from the shares at BOTH ends (s_L1, s_A1
at N1 = 1,536) with the rest's mean cost held fixed:
  lookup(N1) = (1 - s_L0 - s_A0) s_L1 / (1 - s_L1 - s_A1), and likewise for All2All.
So the model reproduces the paper's mean stage costs at 128 and 1,536 by construction; the
network shape (G, P, o, r) only decides the scales in between. Step units convert to ms through
the paper's 1,536-worker TorchRec step: the mean-cost sum at N1 is (1 - s_L0 - s_A0) /
(1 - s_L1 - s_A1) units = 5,793.83 ms (no efficiency number enters). The per-call latency
matters for fwp: at lam = 10 us a 1,536-peer call costs ~15 ms; if the paper's All2All growth
were all per-call latency (``peer_latency_us`` ~270), fwp would lose to sync (see sensitivity).

Scaling efficiency and the validation
-------------------------------------
Weak scaling: each worker keeps its batch, so throughput at N is N B / T_p(N) and the
efficiency of pipeline p at N is its throughput per worker relative to N0:
    E_p(N) = [N B / T_p(N)] / [N/N0 x N0 B / T_p(N0)] = T_p(N0) / T_p(N).
Each system is measured against its own 128-worker step: the paper's table satisfies this
(TorchRec 0.4434 x 5,793.83 ms = 2,569 ms at 128; NestPipe 0.9407 x 1,895.98 = 1,784 ms), and
its lookup and All2All times at 1,536 (2,871 and ~1,188 ms) match 49.6% and 20.5% of 5,793.83.
T_p(N) is the simulated steady-state step time (mean spacing of the last batches' completions).

Two kinds of check. ``baseline_consistency`` (in-sample) compares E_sync(1536) with TorchRec's
0.4434; with no variance, a serial step is the sum of the mean costs and the shares fed in fix
that sum's growth: E = (1 - s_L1 - s_A1) / (1 - s_L0 - s_A0) = 0.299 / 0.664 = 0.450 (reported as
``identity_efficiency``), so all it checks is what the simulator adds on top (the serial step
accounting, barriers, stragglers): it fails for a baseline that overlaps the lookup or for heavy
variance (cv ~0.3), and it cannot fail for a wrong share growth. ``paper_checks``
(out-of-sample): figures the fit never sees, each predicted and compared with a stated relative
tolerance: NestPipe's speedup (3.06x) and efficiency (0.9407) at 1,536, the 128-worker speedup
implied by the paper's table (2,569 / 1,784 ms = 1.44x), NestPipe's exposed lookup (30.19 ms)
and communication (154.23 ms) at 1,536, and two ablations (DBP alone removes ~98% of the lookup;
without clustering a 16-micro-batch frozen window leaves 25.2% of the communication exposed).
dbp+fwp stands for NestPipe (the model has no clustering).

Modules: ``network`` (network shape, stage cost model), ``cluster`` (resource clocks),
``schedules`` (the pipelines' programs, step times, efficiencies), ``calibration`` (data files,
the fit), ``scaling`` (the ``nestpipe_scale`` study: the fit from a config, the figures at the
largest scale, the sensitivities), ``checks`` (the out-of-sample paper checks, what each
pipeline models, the efficiency plot). The paper's figures are in ``data/paper_nestpipe.json``.
"""

from jaxflow.nestpipe.simulate.calibration import (
    DEFAULT_CALIBRATION,
    HOST_STAGES,
    MEASURED_PATHS,
    PAPER_ABLATIONS,
    PAPER_BASELINE_EFFICIENCY,
    PAPER_NESTPIPE_EXPOSED_MS,
    PAPER_SHARES,
    PAPER_TABLE,
    PAPER_WORKERS,
    STAGE_KEYS,
    Calibration,
    CalibrationWarning,
    calibrate,
    calibration_from_summary,
    calibration_summary,
    fold_rest_into_compute,
    load_calibration,
    write_calibration,
    write_calibration_from_run,
)
from jaxflow.nestpipe.simulate.checks import MODELLED_SCHEDULES, paper_checks, plot_efficiency
from jaxflow.nestpipe.simulate.cluster import Cluster
from jaxflow.nestpipe.simulate.network import NetworkShape, StageModel, bandwidth_factor
from jaxflow.nestpipe.simulate.scaling import ScalingStudy
from jaxflow.nestpipe.simulate.schedules import EXACT_PIPELINES, PIPELINES, efficiency_table, simulate_steps, step_time

__all__ = [
    "DEFAULT_CALIBRATION", "EXACT_PIPELINES", "HOST_STAGES", "MEASURED_PATHS", "MODELLED_SCHEDULES",
    "PAPER_ABLATIONS", "PAPER_BASELINE_EFFICIENCY", "PAPER_NESTPIPE_EXPOSED_MS",
    "PAPER_SHARES", "PAPER_TABLE", "PAPER_WORKERS", "PIPELINES", "STAGE_KEYS",
    "bandwidth_factor", "calibrate", "Calibration", "calibration_from_summary",
    "calibration_summary", "CalibrationWarning", "Cluster", "efficiency_table",
    "fold_rest_into_compute", "load_calibration", "NetworkShape", "paper_checks",
    "plot_efficiency", "ScalingStudy", "simulate_steps", "StageModel", "step_time",
    "write_calibration", "write_calibration_from_run",
]
