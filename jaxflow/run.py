"""The experiment runner: ``python -m jaxflow.run --exp=NAME [--variant=quick] [--set k=v ...]``.

  --list                       every experiment, its description and variants
  --exp NAME [--variant V] --help
                               the flags, then the experiment's config keys (``--set`` names)
                               with their types and the variant's values
  --dry-run                    resolve the config (overrides applied) and its meshes on the
                               devices present (and the config of each checkpoint a set
                               ``hf_path`` names), print them as one JSON line, run nothing
  --exp NAME --variant V       run configs/NAME.py's get_config(V)
  --set a.b=value              override a config field (repeatable), parsed as its type
  --out DIR|URI [--resume]     run directory, a path or a URI (file:///abs/dir, gs://bucket/dir;
                               default runs/NAME/<timestamp>); --resume continues the stopped run
                               in DIR from its latest checkpoint, with the config it was run with
  --break-lock                 take over DIR's lock left by a run on another host (one run
                               writes a run directory at a time: ``jaxflow.run_lock``)
  --devices N                  N fake CPU devices (per process) on a CPU-only machine; on a
                               GPU / TPU the meshes span the accelerators present (a config's
                               ``devices=N`` field takes the first N)
  --coordinator HOST:PORT --num-processes N --process-id I
                               JAX multi-controller runtime (or --distributed-auto on TPU/SLURM)
  --peer-timeout S             a process whose peer is silent S seconds exits (default 60)
  --rendezvous-timeout S       how long the processes wait for each other at the start: to join,
                               to compare their resolved configs, before the first collective
                               (default 300; jaxflow.rendezvous)
  --compile-only --target T    compile every program of the experiment for T's abstract chips
                               (tpu-v5p:4x4x4, gpu-h100x8, ...; jaxflow.compile_only), run
                               nothing; a table, and compile_report.json in the run directory
  --no-tensorboard             no TensorBoard event files (default: under RUN_DIR/tensorboard;
                               --resume keeps the run's choice; metrics.jsonl is always written,
                               ``jaxflow.metric_writers``)
  --wandb PROJECT              also log the metric rows to this W&B project (pip install wandb)

User errors (unknown names, unparsable or out-of-range values, a bad --out or --coordinator, a run
that cannot be resumed, meshes the devices cannot form, a missing optional extra) exit with code
2 and one line naming the bad value and the valid choices; nothing is written to the run
directory before the run is known to start (a fresh run that fails that way leaves none).
SIGINT / SIGTERM: the step in flight finishes, a checkpoint is written where the experiment
keeps them, one line gives the resume command; exit 130 / 143 (``jaxflow.signals``). Before
the run starts (imports, flags, JAX start-up) the same exit codes and one line, nothing
written. A lost peer: exit 75, one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any, Sequence

from jaxflow import signals

if __name__ == "__main__":  # before the heavy imports below
    signals.exit_before_start("python -m jaxflow.run")

from etils import epath  # noqa: E402

from jaxflow import contract, provenance, results, run_dirs, run_lock  # noqa: E402
from jaxflow.config import experiments, get_experiment  # noqa: E402
from jaxflow.errors import UserError, one_line  # noqa: E402
from jaxflow.experiment import is_local, run_path  # noqa: E402
from jaxflow.run_dirs import UsageError, check_fresh_out, out_dir_for, resolve_run, roll_back  # noqa: E402
from jaxflow.run_meshes import default_devices, resolve_meshes  # noqa: E402, F401 (re-exported)

PROG = "python -m jaxflow.run"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run a jaxflow experiment.", add_help=False)
    p.add_argument("-h", "--help", action="store_true",
                   help="show this help (with --exp NAME: also its config keys) and exit")
    p.add_argument("--list", action="store_true", help="list experiments and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve the config and its meshes, print them, run nothing")
    p.add_argument("--exp", help="experiment name (see --list)")
    p.add_argument("--variant", default=None, help="quick | default | full (default: default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable); --exp NAME --help lists the keys")
    p.add_argument("--out", help="run directory or URI (default runs/NAME/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--break-lock", action="store_true",
                   help="take over --out's lock left by a run on another host (jaxflow.run_lock)")
    p.add_argument("--devices", type=int, help="number of fake CPU devices per process")
    p.add_argument("--coordinator", help="HOST:PORT of the jax.distributed coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--distributed-auto", action="store_true",
                   help="jax.distributed.initialize() from the cluster environment (TPU pod, SLURM)")
    p.add_argument("--peer-timeout", type=float, default=None, metavar="SECONDS",
                   help="exit when a peer process is silent this long (default 60)")
    p.add_argument("--rendezvous-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long the processes wait for each other at the start (default 300)")
    p.add_argument("--kill-after-checkpoint", type=int, default=None, metavar="STEP",
                   help="test hook: SIGKILL the run once the checkpoint of STEP is committed")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every program for --target's chips, run nothing")
    p.add_argument("--target", help="tpu-v5e:2x2 | tpu-v5p:4x4x4 | gpu-h100x8 | ...")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard event files under RUN_DIR/tensorboard (default: on; "
                        "--resume: as the run had it)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log metrics to this W&B project")
    p.add_argument("--record", action="store_true", help="record the finished run in experiments/results")
    p.add_argument("--secret-file", metavar="PATH",
                   help="the job secret its sockets authenticate with (jaxflow.job_auth; "
                        "default: JAXFLOW_JOB_SECRET)")
    return p


def list_experiments() -> str:
    lines = []
    for name, spec in experiments().items():
        lines.append(f"{name:<22} [{', '.join(spec.variants)}]  {spec.description}")
    return "\n".join(lines)


def _git_commit() -> str:
    return provenance.git_commit() or "unknown"


def _check_flags(args) -> None:
    from jaxflow import distributed
    from jaxflow.compile_only.cli import flag_problem

    if (problem := flag_problem(args)) is not None:
        raise UsageError(problem)

    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices {args.devices}; valid: an integer >= 1")
    if args.kill_after_checkpoint is not None and args.kill_after_checkpoint < 1:
        raise UsageError(f"--kill-after-checkpoint {args.kill_after_checkpoint}; valid: a step >= 1")
    if args.peer_timeout is not None and not 0 < args.peer_timeout < float("inf"):
        raise UsageError(f"--peer-timeout {args.peer_timeout}; valid: seconds > 0")
    if args.rendezvous_timeout is not None and not 0 < args.rendezvous_timeout < float("inf"):
        raise UsageError(f"--rendezvous-timeout {args.rendezvous_timeout}; valid: seconds > 0")
    if args.coordinator is None and args.distributed_auto is False:
        if args.num_processes is not None or args.process_id is not None:
            raise UsageError("--num-processes / --process-id need --coordinator HOST:PORT")
    if args.coordinator is not None:
        if args.num_processes is None or args.process_id is None:
            raise UsageError("--coordinator needs --num-processes and --process-id")
        if args.num_processes < 1:
            raise UsageError(f"--num-processes {args.num_processes}; valid: an integer >= 1")
        if not 0 <= args.process_id < args.num_processes:
            raise UsageError(f"--process-id {args.process_id}; valid: 0..{args.num_processes - 1}")
        try:
            distributed.parse_coordinator(args.coordinator)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.secret_file is not None:  # checked here; every socket (and child) reads it from env
        from jaxflow import job_auth

        job_auth.read_secret_file(args.secret_file)
        os.environ[job_auth.SECRET_FILE_ENV] = os.path.abspath(args.secret_file)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if (worker := _supervised_worker(argv)) is not None:
            return worker()
        return _main(argv)
    except UserError as e:  # config, mesh, checkpoint, file, data, missing extra, flags
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (SIGINT) before the run started; nothing was written",
              file=sys.stderr)
        return 128 + signal.SIGINT
    except signals.RunStopped as stop:  # --compile-only: nothing to resume
        print(f"{PROG}: {stop}; nothing to resume", file=sys.stderr)
        return stop.exit_code


def _supervised_worker(argv: list[str]):
    """For a process of a multi-process run (flags already valid): a function running this
    command as a supervised child (see ``jaxflow.supervise``)."""
    from jaxflow import supervise

    try:
        args = build_parser().parse_args(argv)
    except UsageError:
        return None  # _main reports it
    if os.environ.get(supervise.SUPERVISED_ENV) == "1":
        supervise.die_with_parent()
        return None
    if args.list or args.help or args.coordinator is None or args.process_id is None:
        return None
    _check_flags(args)
    from jaxflow.distributed import parse_coordinator

    host, port = parse_coordinator(args.coordinator)
    command = [sys.executable, "-m", "jaxflow.run", *argv]
    from jaxflow.rendezvous import DEFAULT_RENDEZVOUS_TIMEOUT_S

    timeout = args.rendezvous_timeout or DEFAULT_RENDEZVOUS_TIMEOUT_S
    return lambda: supervise.supervise(command, host=host, port=port, process_id=args.process_id,
                                       rendezvous_timeout_s=timeout)


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _prepare_compilers(platforms: Sequence[str]) -> None:
    """For an experiment that compiles for abstract chips: the compilers must be installed
    (else a UsageError naming the install command) and their environment set before jax
    starts a backend (``pallas_kernels.targets.compile_env``)."""
    from pallas_kernels import targets

    for platform in platforms:
        try:
            targets.require(platform)
        except targets.CompilerMissing as e:
            raise UsageError(f"this experiment compiles for {platform.upper()} chips: {e}") from None
    if not _backends_initialized():
        for key, value in targets.compile_env().items():
            os.environ.setdefault(key, value)


@dataclasses.dataclass
class _Plan:
    """A run resolved from the flags, before JAX starts a backend."""

    args: argparse.Namespace
    argv: list[str]
    name: str
    variant: str
    overrides: list[str]
    spec: Any
    config: Any
    out: epath.Path | None


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_experiments())
        return 0
    if args.help:
        print(help_text(args))
        return 0
    plan = _plan(args, argv)
    if args.compile_only:
        return _compile_only(plan)
    started = _start_runtime(plan)
    import jax

    from jaxflow.mesh import MeshError

    try:
        meshes = resolve_meshes(plan.spec, plan.config, jax.devices())
    except (MeshError, ValueError) as e:
        raise UsageError(f"{e} (set --devices, --set devices=N or --set mesh.shape=...)") from None
    if started and not args.dry_run:  # every process compiled, then met: gloo's 30 s never expire
        from jaxflow.distributed import connect_collectives

        everyone = set(range(jax.process_count()))
        for mesh in meshes.values():
            if {d.process_index for d in mesh.devices.flat} == everyone:
                connect_collectives(mesh)
    if args.dry_run:
        _print_dry_run(plan, meshes)
        return 0
    return _execute(plan, started)


def help_text(args: argparse.Namespace) -> str:
    """``--help``: the flags; with ``--exp`` also that experiment's config keys, types and the
    values of ``--variant`` (default ``default``) with the ``--set`` overrides given applied."""
    text = build_parser().format_help()
    if not args.exp:
        return text + "\nWith --exp NAME [--variant V] --help: that experiment's config keys too."
    variant = args.variant or "default"
    keys = get_experiment(args.exp).keys_text(variant, list(args.overrides))  # not those it refuses
    return f"{text}\nconfig keys of {args.exp} [{variant}] (--set KEY=VALUE):\n{keys}"


def _compile_only(plan: _Plan) -> int:
    """``--compile-only``: the programs compiled for ``--target`` (``jaxflow.compile_only.cli``)."""
    from jaxflow.compile_only import cli

    out = out_dir_for(plan.out, plan.name, False)
    if plan.out is None:
        check_fresh_out(out)
    restore_signals = signals.install()
    try:
        return cli.run(plan, out, git_commit=_git_commit(), prog=PROG)
    except cli.CompileOnlyUsageError as e:
        raise UsageError(str(e)) from None
    finally:
        restore_signals()


def _plan(args: argparse.Namespace, argv: list[str]) -> _Plan:
    """Flags checked, the run resolved (resume read), the config built, --out checked."""
    _check_flags(args)
    try:
        out = run_path(args.out) if args.out else None
        if out is not None and not is_local(out):
            out.exists()  # the filesystem package for the URI's scheme must be installed
    except ValueError as e:
        raise UsageError(f"--out: {e}") from None
    except ImportError as e:
        raise UsageError(f"--out {args.out!r} needs a filesystem package: {e} (for gs://: "
                         "pip install gcsfs)") from None
    if out is not None and not (args.dry_run or args.compile_only or args.process_id or args.distributed_auto):
        run_lock.check_free(out, break_lock=args.break_lock)  # a live run holding it: before JAX starts
    name, variant, overrides = resolve_run(args, out)
    if args.wandb:
        from jaxflow.metric_writers import import_wandb

        import_wandb()  # missing: exit 2 before anything is written
    spec = get_experiment(name)
    config = spec.configure(variant, overrides)  # a key this experiment does not read: refused
    if out is not None and args.resume:
        run_dirs.check_resumed_config(out, config)  # before anything is restored
    if out is not None and not args.resume:
        check_fresh_out(out)
    return _Plan(args, argv, name, variant, overrides, spec, config, out)


def _start_runtime(plan: _Plan) -> bool:
    """Compilers' environment, the device count and the multi-controller runtime, all before
    JAX touches a backend; True when ``jax.distributed`` was started."""
    from jaxflow import distributed

    args = plan.args
    if plan.spec.compilers:
        _prepare_compilers(plan.spec.compilers)
    args.devices = default_devices(args, plan.config)
    if args.devices is not None and not (args.dry_run and _backends_initialized()):
        # (an in-process --dry-run after JAX started, e.g. from a test, resolves the meshes
        # on the devices already there: the count can no longer change)
        try:
            distributed.set_cpu_device_count(args.devices)
        except RuntimeError:  # an in-process call (a notebook) after JAX started its backends
            import jax

            raise UsageError(f"--devices {args.devices}: JAX already runs in this process with "
                             f"{jax.device_count()} devices and cannot change; pass "
                             f"--devices={jax.device_count()} or start a new process") from None
    if args.coordinator is not None or args.distributed_auto:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # JAX's preemption service takes it
    peer_timeout = args.peer_timeout or distributed.DEFAULT_PEER_TIMEOUT_S
    try:
        started = distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, auto=args.distributed_auto,
            peer_timeout_s=peer_timeout,
            rendezvous_timeout_s=args.rendezvous_timeout or distributed.DEFAULT_RENDEZVOUS_TIMEOUT_S)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if started:  # every process runs the same programs: the same resolved config, or one line
        from jaxflow.config import flatten
        from jaxflow.experiment import to_jsonable

        distributed.check_same_config({"experiment": plan.name, "variant": plan.variant,
                                       **to_jsonable(flatten(plan.config))})
    return started


def _print_dry_run(plan: _Plan, meshes: dict) -> None:
    import jax

    from jaxflow.experiment import to_jsonable
    from jaxflow.models.pretrained import checkpoint_configs

    loaded = to_jsonable(checkpoint_configs(plan.config))  # what a set *.hf_path would load
    print(json.dumps({"experiment": plan.name, "variant": plan.variant, "overrides": plan.overrides,
                      "backend": jax.default_backend(), "device_count": jax.device_count(),
                      "meshes": {k: dict(m.shape) for k, m in meshes.items()},
                      "config": to_jsonable(plan.config), **({"checkpoints": loaded} if loaded else {})}))


def _execute(plan: _Plan, started: bool) -> int:
    """Runs the experiment in its run directory; writes summary.json; the exit code."""
    import jax

    from jaxflow import distributed
    from jaxflow.experiment import RunContext
    from jaxflow.train.loop import Fault

    args = plan.args
    out_dir = out_dir_for(plan.out, plan.name, started)
    if plan.out is None:
        check_fresh_out(out_dir)
    primary = jax.process_index() == 0
    # With several processes JAX's preemption service owns SIGTERM (orbax reads it per step).
    restore_signals = signals.install(multi_process=jax.process_count() > 1)
    run, finished, lock = None, False, run_lock.RunLock.unlocked()
    held = run_dirs.HeldSaveErrors()  # orbax's save tracebacks: shown unless explained in one line
    try:
        fault = Fault(args.kill_after_checkpoint) if args.kill_after_checkpoint is not None else None
        run = RunContext(name=plan.name, variant=plan.variant, out_dir=out_dir, is_primary=primary,
                         resume=args.resume, seed=contract.config_seed(plan.config), fault=fault,
                         tensorboard=args.tensorboard, wandb_project=args.wandb, config=plan.config)
        saved_config = {"experiment": plan.name, "variant": plan.variant, "overrides": plan.overrides,
                        "devices": args.devices, "tensorboard": args.tensorboard, "config": plan.config}
        existed = set(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else None
        lock = run_lock.lock_run_dir(out_dir, break_lock=args.break_lock, info=run.info) if primary else lock
        if args.resume:
            run.write_json_later("config.json", saved_config)  # at the first new metrics row
        else:
            run.write_json("config.json", saved_config)
        run.info(f"{plan.name} [{plan.variant}] -> {out_dir} ({jax.device_count()} "
                 f"{jax.default_backend()} devices, {jax.process_count()} process(es))")
        if args.record and primary and not (args.resume and (out_dir / "measured.json").exists()):
            results.mark_start(out_dir, plan.name)  # the measured code's hash and the load, now
        start = time.time()
        try:
            result = dict(plan.spec.entry_fn()(plan.config, run) or {})
        except UserError:  # raised anywhere inside the experiment: exit 2, one line (main)
            run.close()
            if not args.resume and primary:
                roll_back(out_dir, existed)
            raise
        except Exception:
            if started:
                distributed.await_lost_peer()  # exits with one line naming a lost peer, if one is
            raise
        run.close()
        run.flush_pending()
        _write_summary(plan, run, result, time.time() - start)
        if args.record and primary:
            run.info(f"recorded {results.record_and_render(out_dir)}")
        finished = True
        if (signum := signals.requested()) is not None:  # after the experiment's last poll
            raise signals.RunStopped(signum)
    except signals.RunStopped as stop:
        if run is not None:
            run.close()
        from jaxflow.checkpoint import has_progress

        line = signals.outcome(stop, f"{PROG} --resume --out {out_dir}", out_dir, finished=finished,
                               has_checkpoint=out_dir.is_dir() and has_progress(out_dir))
        print(f"[jaxflow] {stop}: {line}", file=sys.stderr, flush=True)
        return stop.exit_code
    except Exception as e:
        if (failure := run_dirs.one_line_failure(e, out_dir, f"{PROG} --resume --out {out_dir}")) is None:
            raise
        held.drop()  # the one line says what went wrong
        raise failure from None
    finally:
        held.release()
        restore_signals()
        if run is not None:
            run.close()
        lock.release()
    return 0


def _write_summary(plan: _Plan, run, result: dict, wall_seconds: float) -> None:
    """summary.json (the conventions' keys, then the experiment's own), the plots, one line."""
    import jax

    from jaxflow.experiment import to_jsonable
    from jaxflow.study.report import with_headlines

    summary = with_headlines({  # the conventions' keys, the experiment's, its HEADLINES' figures
        "experiment": plan.name,
        "variant": plan.variant,
        "argv": [PROG, *plan.argv],
        "seed": run.seed,
        "config": to_jsonable(plan.config),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "wall_seconds": wall_seconds,
        "git_commit": _git_commit(),
        **result,
    }, plan.spec.headlines, log=run.info)
    run.write_json("summary.json", summary)
    if run.is_primary:
        headline = {k: v for k, v in result.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if is_local(run.out_dir):
            from jaxflow.plots import plot_metrics

            plot_metrics(run.out_dir, title=plan.name)
        run.info("summary: " + json.dumps(to_jsonable(headline)))
        run.info(f"wrote {run.out_dir}/summary.json")


if __name__ == "__main__":
    code = main()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # stopped: no interpreter teardown
        signals.exit_now(code)
    sys.exit(code)
