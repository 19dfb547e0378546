"""jaxflow: pure-functional, mesh-sharded JAX implementations of large-scale training systems.

Subpackages (one idea each):
  jaxflow.align         FIGA token marks and loss, SFT / DPO baselines, oracle-revised pairs
  jaxflow.bench         the benchmarks' measurements: kernels vs references, sync codecs, HF loading
  jaxflow.compile_only  ahead-of-time compilation of an experiment for abstract chips (--compile-only)
  jaxflow.data          built-in generators (arithmetic corpus, character tokenizer)
  jaxflow.decorate      DecorateLM data engineering: rating, tagging, editing, a distilled student
  jaxflow.embeddings    sharded embedding tables: placement, All2All routing, sparse optimizers
  jaxflow.flow          FlowTrain: decoupled ViT encoder / LM backbone training, dynamic packing
  jaxflow.genrec        OxygenREC generative recommendation over semantic IDs, constrained decoding
  jaxflow.main          the experiment drivers, one per experiment: main(config, run) -> summary
  jaxflow.marl          FlexMARL multi-agent RL: experience store, micro-batch pipeline, simulator
  jaxflow.models        decoder-only LM (flax nnx), its KV-cache sampler, Hugging Face checkpoints
  jaxflow.nestpipe      NestPipe staleness-free embedding pipelines and their scaling simulator
  jaxflow.prune         SparseGPT, Wanda and magnitude pruning, sequential LM pruning, calibration
  jaxflow.recsys        DLRM and DCN-v2, Criteo / MovieLens readers, AUC and log loss
  jaxflow.rollout       the RL rollout engine: paged KV cache, continuous batching, shared prefixes
  jaxflow.results       recorded runs and the pages rendered from them (stale when the code moves)
  jaxflow.rl            policy losses (GRPO/DAPO/GSPO/CISPO/SA-GCPO with SIS/TIS/MIS/RS), GRPO trainer
  jaxflow.study         seed studies: seed grids, cell resume, paired intervals, timing, reports
  jaxflow.sync          SparseRL-Sync lossless sparse bf16 weight-delta codecs and transports
  jaxflow.train         sharded train state, the one training loop, LM pretraining

Core modules:
  jaxflow.run           the experiment runner CLI (python -m jaxflow.run)
  jaxflow.export        a run's policy as a Hugging Face checkpoint (python -m jaxflow.export)
  jaxflow.run_meshes    the devices and meshes a run gets, worked out before anything runs
  jaxflow.run_dirs      run directories: a fresh --out, what --resume reads back
  jaxflow.run_lock      one writer per run directory (process 0's run.lock)
  jaxflow.config        Python configs (configs/NAME.py) and --set overrides
  jaxflow.config_domains  the declared domain of every numeric config field, checked on build
  jaxflow.config_reads  config keys only some experiments read (READS), refused by the others
  jaxflow.contract      what the runner may read of a config and a driver (Protocols)
  jaxflow.system        the System protocol every paper's system implements (typed state, pure step)
  jaxflow.experiment    the run context an entry function receives
  jaxflow.errors        the user-error hierarchy (exit status 2, one line)
  jaxflow.mesh          meshes, role sub-meshes, logical-axis sharding rules
  jaxflow.distributed   the multi-controller runtime (one process per host)
  jaxflow.rendezvous    the processes of a job starting together (barrier, one config)
  jaxflow.checkpoint    orbax checkpoints of whole train states
  jaxflow.signals       SIGINT / SIGTERM: finish the step, checkpoint, stop
  jaxflow.supervise     the parent process of a multi-process run
  jaxflow.metric_writers  where a run's metric rows go
  jaxflow.plots         PNG plots of a run's metrics
  jaxflow.stats         paired intervals and curve areas for seed studies
  jaxflow.timing        fair side-by-side timing
  jaxflow.provenance    where a measured number came from (commit, command, machine)
  jaxflow.cache         build-once cache entries
  jaxflow.host_jit      numba for the host loops numpy cannot vectorise
  jaxflow.job_auth      the job secret and the frame MACs of the job's sockets

The Pallas kernels are the sibling package ``pallas_kernels``. ``__all__`` names the subpackages
and modules (``from jaxflow import *`` imports them all; ``import jaxflow`` imports none).
"""

__version__ = "0.1.0"

__all__ = [
    "align", "bench", "compile_only", "data", "decorate", "embeddings", "flow", "genrec", "main", "marl",
    "models", "nestpipe", "prune", "recsys", "results", "rl", "rollout", "study", "sync", "train",
    "cache", "checkpoint", "config", "config_domains", "config_reads", "contract", "distributed", "errors",
    "experiment", "export", "host_jit", "job_auth",
    "mesh", "metric_writers", "plots", "provenance", "run", "run_dirs", "run_lock", "run_meshes", "signals",
    "rendezvous", "stats", "supervise", "system", "timing",
]
