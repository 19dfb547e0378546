"""The experiment runner: ``python -m jaxflow.run --exp=NAME [--variant=quick] [--set k=v ...]``.

  --list                       every experiment, its description and variants
  --exp NAME --variant V       run configs/NAME.py's get_config(V)
  --set a.b=value              override a config field (repeatable), parsed as its type
  --out DIR [--resume]         run directory (default runs/NAME/<timestamp>); --resume continues
                               the killed run in DIR from its latest checkpoint
  --devices N                  N fake CPU devices (per process) on a CPU-only machine
  --coordinator HOST:PORT --num-processes N --process-id I
                               JAX multi-controller runtime (or --distributed-auto on TPU/SLURM)

User errors (unknown names, unparsable values, meshes the devices cannot form) exit with code 2
and one line naming the bad value and the valid choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Sequence

from jaxflow.config import ConfigError, apply_overrides, experiments, get_experiment

PROG = "python -m jaxflow.run"


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run a jaxflow experiment.")
    p.add_argument("--list", action="store_true", help="list experiments and exit")
    p.add_argument("--exp", help="experiment name (see --list)")
    p.add_argument("--variant", default="default", help="quick | default | full")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="run directory (default runs/NAME/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--devices", type=int, help="number of fake CPU devices per process")
    p.add_argument("--coordinator", help="HOST:PORT of the jax.distributed coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--distributed-auto", action="store_true",
                   help="jax.distributed.initialize() from the cluster environment (TPU pod, SLURM)")
    return p


def list_experiments() -> str:
    lines = []
    for name, spec in experiments().items():
        lines.append(f"{name:<22} [{', '.join(spec.variants)}]  {spec.description}")
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        root = pathlib.Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def _resolve_run(args) -> tuple[str, str, list[str]]:
    """(experiment, variant, overrides), reading the saved ones (and --devices) on --resume."""
    if not args.resume:
        if not args.exp:
            raise UsageError("--exp NAME is required (or --list to see the experiments)")
        return args.exp, args.variant, list(args.overrides)
    if not args.out:
        raise UsageError("--resume needs --out DIR (the run directory to continue)")
    saved = pathlib.Path(args.out) / "config.json"
    if not saved.exists():
        raise UsageError(f"--resume: {saved} does not exist; is {args.out!r} a jaxflow run directory?")
    meta = json.loads(saved.read_text())
    if args.exp and args.exp != meta["experiment"]:
        raise UsageError(f"--exp {args.exp!r} does not match the run in {args.out!r} ({meta['experiment']!r})")
    if args.devices is None:
        args.devices = meta.get("devices")
    return meta["experiment"], meta["variant"], list(meta["overrides"]) + list(args.overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except (UsageError, ConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def default_devices(args: argparse.Namespace, config) -> int | None:
    """``--devices``, else the experiment's own ``devices`` field (e.g. nestpipe's 8-device mesh)
    for a single-process run, so ``--exp=NAME --variant=quick`` runs as written on a CPU; the
    count only creates fake CPU devices, an accelerator backend is untouched."""
    if args.devices is not None or args.coordinator is not None or args.distributed_auto:
        return args.devices
    wanted = getattr(config, "devices", None)
    return wanted if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 1 else None


def _main(argv: list[str]) -> int:
    from jaxflow.mesh import MeshError

    args = build_parser().parse_args(argv)
    if args.list:
        print(list_experiments())
        return 0
    name, variant, overrides = _resolve_run(args)
    spec = get_experiment(name)
    config = apply_overrides(spec.get_config(variant), overrides)

    if args.out and not args.resume and (pathlib.Path(args.out) / "config.json").exists():
        raise UsageError(f"--out {args.out!r} already holds a run; add --resume to continue it or pick another directory")

    # Devices and the multi-controller runtime must be set before JAX touches a backend.
    from jaxflow import distributed

    args.devices = default_devices(args, config)
    if args.devices is not None:
        if args.devices < 1:
            raise UsageError(f"--devices {args.devices}: need at least 1")
        distributed.set_cpu_device_count(args.devices)
    try:
        started = distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, auto=args.distributed_auto
        )
    except ValueError as e:
        raise UsageError(str(e)) from None

    import jax

    mesh_cfg = getattr(config, "mesh", None)
    if mesh_cfg is not None and hasattr(mesh_cfg, "sizes"):
        try:
            mesh_cfg.sizes(jax.device_count())
        except MeshError as e:
            raise UsageError(f"{e} (set --devices or --set mesh.shape=...)") from None

    out_dir = _out_dir(args, name, started)
    primary = jax.process_index() == 0
    from jaxflow.experiment import RunContext, to_jsonable

    seed = int(getattr(config, "seed", 0))
    run = RunContext(name=name, variant=variant, out_dir=out_dir, is_primary=primary,
                     resume=args.resume, seed=seed)
    run.write_json("config.json", {"experiment": name, "variant": variant, "overrides": overrides,
                                   "devices": args.devices, "config": config})
    run.info(f"{name} [{variant}] -> {out_dir} ({jax.device_count()} {jax.default_backend()} devices, "
             f"{jax.process_count()} process(es))")
    start = time.time()
    try:
        result = dict(spec.entry_fn()(config, run) or {})
    except (ConfigError, MeshError) as e:
        raise UsageError(str(e)) from None
    finally:
        run.close()
    summary = {
        "experiment": name,
        "variant": variant,
        "argv": [PROG, *argv],
        "seed": seed,
        "config": to_jsonable(config),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "wall_seconds": time.time() - start,
        "git_commit": _git_commit(),
        **result,
    }
    run.write_json("summary.json", summary)
    if primary:
        from jaxflow.plots import plot_metrics

        plot_metrics(out_dir)
        headline = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.info("summary: " + json.dumps(to_jsonable(headline)))
        run.info(f"wrote {out_dir}/summary.json")
    return 0


def _out_dir(args, name: str, multi_process: bool) -> pathlib.Path:
    if args.out:
        return pathlib.Path(args.out)
    stamp = int(time.time() * 1000)
    if multi_process:  # every process must agree on the directory
        import numpy as np
        from jax.experimental import multihost_utils

        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    when = datetime.datetime.fromtimestamp(stamp / 1000).strftime("%Y%m%d-%H%M%S")
    return pathlib.Path("runs") / name / when


if __name__ == "__main__":
    sys.exit(main())
