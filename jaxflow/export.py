"""``python -m jaxflow.export RUN_DIR [--step N] --out DIR``: a finished (or stopped) run's
policy as a Hugging Face checkpoint directory.

Reads ``RUN_DIR/export.json`` (written by the experiment, see
:mod:`jaxflow.models.hf_export` for the contract), restores only the policy's params of
checkpoint step N (the latest by default) with an orbax abstract restore on this host's first
device, and writes ``DIR`` with :func:`jaxflow.models.hf_export.export_hf`: merged safetensors,
config.json, the source checkpoint's tokenizer files and, when the run trained LoRA adapters,
a PEFT ``adapter/``.

Bad input (no run directory, no manifest, an unknown step, an ``--out`` holding other files, a
checkpoint that does not match the manifest's model) prints one line ``error: ...`` and exits 2,
with nothing written.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Any, Sequence

from jaxflow.errors import UserError, one_line

PROG = "python -m jaxflow.export"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage too)
        raise UserError(f"{message}; usage: {PROG} RUN_DIR [--step N] --out DIR")


def checkpoint_steps(checkpoint_dir: str) -> list[int]:
    """The complete orbax checkpoint steps directly under ``checkpoint_dir``, ascending."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()
                  and os.path.exists(os.path.join(checkpoint_dir, n, "_CHECKPOINT_METADATA")))


class _NoItemMetadataNotice(logging.Filter):
    """Drops orbax's notice that an item directory has no step-level metadata file (reading one
    item of a step alone is what the CLI means to do)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Metadata file does not exist" not in record.getMessage()


@contextlib.contextmanager
def _quiet_item_metadata():
    logger, notice = logging.getLogger("absl"), _NoItemMetadataNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def restore_params(step_dir: str, params_path: Sequence[str]) -> Any:
    """The subtree ``params_path`` of the state saved in orbax step directory ``step_dir``
    (``jaxflow.checkpoint.Checkpointer``'s layout: ``step_dir/state``), read alone (the
    optimizer state is not) onto this host's first device; str keys.

    Raises:
      ExportError: the state has no such subtree, or its files cannot be read.
    """
    item_dir = os.path.join(step_dir, "state")
    with _quiet_item_metadata():
        return _restore(item_dir, step_dir, params_path)


def _restore(item_dir: str, step_dir: str, params_path: Sequence[str]) -> Any:
    import jax
    import orbax.checkpoint as ocp

    from jaxflow.models.hf_export import ExportError

    try:
        tree = ocp.StandardCheckpointer().metadata(item_dir)
        tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
        for key in params_path:
            tree = tree[key]
    except (KeyError, TypeError):
        raise ExportError(f"checkpoint {step_dir} holds no {'.'.join(params_path)} (the manifest's "
                          "params_path); valid: a checkpoint of the run's trainer state") from None
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise many types for bad files
        raise ExportError(f"checkpoint {step_dir} is unreadable ({type(e).__name__}: "
                          f"{one_line(e)[:160]})") from None
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    for key in reversed(params_path):
        abstract = {key: abstract}
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), abstract)
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            out = ckpt.restore(item_dir, args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=restore_args, partial_restore=True))
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"checkpoint {step_dir} is unreadable ({type(e).__name__}: "
                          f"{one_line(e)[:160]})") from None
    for key in params_path:
        out = out[key]
    return out


def check_params(params: Any, model_cfg: Any, lora: Any, where: str) -> None:
    """The restored params have exactly the paths and shapes of ``model_cfg`` (+ ``lora``'s
    adapters); ExportError naming the first difference otherwise."""
    import dataclasses

    from jaxflow.models.hf_export import ExportError
    from jaxflow.models.hf_save import abstract_model, flat_params
    from jaxflow.models.lora import LoraConfig

    cfg = dataclasses.replace(model_cfg, lora=lora if lora is not None else LoraConfig())
    from flax import nnx

    want = {p: tuple(a.shape) for p, a in flat_params(nnx.to_pure_dict(abstract_model(cfg)[2])).items()}
    got = {p: tuple(a.shape) for p, a in flat_params(params).items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    bad = [p for p in want if p in got and want[p] != got[p]]
    if missing or extra or bad:
        what = (f"lacks {'.'.join(missing[0])}" if missing else
                f"has {'.'.join(extra[0])}, not a parameter of the model" if extra else
                f"has {'.'.join(bad[0])} of shape {got[bad[0]]}, the model's is {want[bad[0]]}")
        raise ExportError(f"{where} {what}; valid: params of the model in export.json "
                          f"({cfg.architecture}, {cfg.n_layers} layers, LoRA "
                          f"{'rank ' + str(cfg.lora.rank) if cfg.lora.enabled else 'off'})")


def export_run(run_dir: str, out: str, *, step: int | None = None) -> tuple[int, list[str]]:
    """Exports step ``step`` (None: the latest) of run directory ``run_dir`` to ``out``.

    Returns:
      (the step exported, the files written relative to ``out``).

    Raises:
      ExportError: a bad run directory, manifest, step, checkpoint or ``out`` (nothing written).
    """
    from jaxflow.models.hf_export import ExportError, check_out_dir, export_hf, read_export_manifest

    manifest = read_export_manifest(run_dir)
    out = os.path.abspath(out)
    check_out_dir(out)
    steps = checkpoint_steps(manifest.checkpoint_dir)
    if not steps:
        raise ExportError(f"{manifest.checkpoint_dir} holds no complete checkpoint; valid: a run "
                          "that saved at least one checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"--step {step}: no checkpoint of that step in {manifest.checkpoint_dir};"
                          f" available steps: {', '.join(map(str, steps))}")
    step_dir = os.path.join(manifest.checkpoint_dir, str(step))
    params = restore_params(step_dir, manifest.params_path)
    check_params(params, manifest.model_cfg, manifest.lora,
                 f"checkpoint {step_dir} {'.'.join(manifest.params_path)}")
    source = manifest.tokenizer_dir if os.path.isdir(manifest.tokenizer_dir) else None
    files = export_hf(params, manifest.model_cfg, out, source_dir=source, lora_cfg=manifest.lora,
                      provenance={"run_dir": os.path.abspath(run_dir), "step": step,
                                  "hf_path": manifest.hf_path})
    return step, files


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit status (0, or 2 with one ``error:`` line on bad input)."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (the run's --out)")
    parser.add_argument("--step", type=int, default=None, metavar="N",
                        help="the checkpoint step to export (default: the latest)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="the export directory: new, empty, or an earlier export")
    try:
        args = parser.parse_args(argv)
        step, files = export_run(args.run_dir, args.out, step=args.step)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    adapter = " + PEFT adapter/" if any(f.startswith("adapter" + os.sep) for f in files) else ""
    print(f"wrote {os.path.abspath(args.out)} (step {step} of {args.run_dir}: {len(files)} files, "
          f"merged weights{adapter})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
