"""A trained policy out as a Hugging Face checkpoint directory, and the run-directory contract that
lets ``python -m jaxflow.export RUN_DIR --out DIR`` do it for any finished run.

:func:`export_hf` writes ``out_dir``: ``config.json`` + safetensors of the merged weights
(adapters folded in, :func:`jaxflow.models.lora.merge`), the source checkpoint's tokenizer files
(:data:`TOKENIZER_FILES`, those present), and with LoRA adapters a PEFT ``adapter/`` that
``peft.PeftModel.from_pretrained(base, out_dir / "adapter")`` loads onto the *base* checkpoint,
and :data:`EXPORT_MARKER` (what it was made from). It writes into a temporary sibling directory
and renames it into place, so a reader never sees a half-written export and an earlier export of
the same directory is replaced whole.

The contract a driver follows so that a run directory can be exported later (the ``rl``
experiment does):

1. Once, before training, call ``write_export_manifest(run.out_dir, hf_path=..., model_cfg=...,
   lora=...)`` (process 0 writes). It writes ``RUN_DIR/export.json`` (:data:`MANIFEST`: the
   source checkpoint directory, the model's config.json as jaxflow would write it, the param
   dtype, the LoRA config or null, where the params live in the checkpointed state, the
   checkpoint directory) and copies the source's tokenizer files into ``RUN_DIR/hf_source/``,
   so the run directory alone is enough to export.
2. Checkpoint the trainer state with :class:`jaxflow.checkpoint.Checkpointer` under
   ``RUN_DIR/checkpoints`` (the runner's ``run.checkpoint_dir``; another directory relative to
   the run directory goes in ``checkpoint_dir=``), the params of the policy at
   ``params_path`` of the state (default ``("policy", "params")``: GRPOTrainer's
   ``{"policy": TrainState, ...}`` saved by ``run_steps``), with or without adapters.
3. ``python -m jaxflow.export RUN_DIR [--step N] --out DIR`` then reads the manifest, restores
   only ``params_path`` of step N (the latest by default) with an orbax abstract restore, and
   calls :func:`export_hf`. A driver exporting during the run (``export.hf``) calls
   :func:`export_hf` itself on the live params.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Sequence

import jax

from jaxflow.errors import UserError, one_line
from jaxflow.models import lora as lora_lib
from jaxflow.models.architectures import config_from_hf, hf_config_from, read_transformer_config
from jaxflow.models.hf_save import write_checkpoint
from jaxflow.models.transformer import TransformerConfig

#: Tokenizer and generation files copied from the source checkpoint (those present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
#: The run directory's export manifest and its copy of the source tokenizer files.
MANIFEST, SOURCE_COPY = "export.json", "hf_source"
MANIFEST_FORMAT = "jaxflow-hf-export/1"
#: Written into every export (what it was made from); marks a directory an export may replace.
EXPORT_MARKER = "jaxflow_export.json"


class ExportError(UserError, ValueError):
    """An export that cannot be made: a bad output directory, a run directory without a manifest
    or with a bad one, a step without a checkpoint (the message names it and what is valid)."""


def check_out_dir(out_dir: str) -> None:
    """``out_dir`` may be written by :func:`export_hf`: absent, an empty directory, or an
    earlier export (it holds :data:`EXPORT_MARKER`; never another checkpoint, e.g. the source);
    ExportError naming it otherwise."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ExportError(f"--out {out_dir!r} is a file; valid: a new or empty directory, or an "
                          "earlier export")
    names = os.listdir(out_dir)
    if names and EXPORT_MARKER not in names:
        raise ExportError(f"--out {out_dir!r} holds other files ({', '.join(sorted(names)[:3])}"
                          f"{', ...' if len(names) > 3 else ''}); valid: a new or empty directory,"
                          " or an earlier export (replaced whole)")


def export_hf(params: Any, model_cfg: TransformerConfig, out_dir: str, *,
              source_dir: str | None = None, lora_cfg: lora_lib.LoraConfig | None = None,
              provenance: dict | None = None) -> list[str]:
    """Writes a policy as a Hugging Face checkpoint directory ``out_dir`` (module doc).

    Nothing is written when it raises. On several processes every process calls it (the params
    are gathered); process 0 writes.

    Args:
      params: the policy's params pure dict (trainer layout, any mesh), with or without
        ``*_lora_a / *_lora_b`` adapters.
      model_cfg: the model's config (its ``lora`` describes the adapters unless ``lora_cfg``).
      out_dir: the export directory: absent, empty, or an earlier export (replaced whole; a
        directory holding anything else, e.g. the source checkpoint, is refused).
      source_dir: the checkpoint the run started from: its :data:`TOKENIZER_FILES` present are
        copied (None: no tokenizer files).
      lora_cfg: the adapters' LoraConfig when ``model_cfg.lora`` is off.
      provenance: JSON-able facts recorded in the export's :data:`EXPORT_MARKER` (e.g. the run
        directory and step).

    Returns:
      The file names written (relative to ``out_dir``, sorted).

    Raises:
      ExportError: ``out_dir`` holds other files, ``source_dir`` is not a directory.
      AdapterError: adapters without a LoRA config or not matching it.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    check_out_dir(out_dir)
    if source_dir is not None and not os.path.isdir(source_dir):
        raise ExportError(f"source_dir {source_dir!r} is not a directory; valid: the checkpoint "
                          "directory the run started from (its tokenizer files are copied)")
    lora_lib.adapters_config(params, lora_cfg if lora_cfg is not None else model_cfg.lora)
    primary = jax.process_index() == 0
    parent = os.path.dirname(out_dir)
    if primary:
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent) if primary \
        else os.path.join(parent, ".export-tmp-not-written")
    try:
        adapter = write_checkpoint(params, model_cfg, tmp, lora=lora_cfg)
        if not primary:
            return []
        for name in TOKENIZER_FILES if source_dir is not None else ():
            if os.path.isfile(os.path.join(source_dir, name)):
                shutil.copyfile(os.path.join(source_dir, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump({"format": MANIFEST_FORMAT, "adapter": adapter, "source_dir": source_dir,
                       **({"provenance": provenance} if provenance else {})}, f, indent=2)
        written = sorted(os.path.relpath(os.path.join(d, f), tmp)
                         for d, _, files in os.walk(tmp) for f in files)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return written
    finally:
        if primary and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ExportManifest:
    """What ``RUN_DIR/export.json`` says (:func:`write_export_manifest`).

    Attributes:
      hf_path: the source checkpoint directory (absolute, as given at training time).
      model_cfg: the model's TransformerConfig (LoRA off; from the manifest's config.json).
      lora: the adapters' LoraConfig, or None (full fine-tuning).
      params_path: keys from the checkpointed state to the policy's params.
      checkpoint_dir: the orbax checkpoint directory (absolute).
      tokenizer_dir: the run directory's copy of the source tokenizer files (absolute).
    """

    hf_path: str
    model_cfg: TransformerConfig
    lora: lora_lib.LoraConfig | None
    params_path: tuple[str, ...]
    checkpoint_dir: str
    tokenizer_dir: str


def write_export_manifest(run_dir: Any, *, hf_path: str, model_cfg: TransformerConfig | None = None,
                          lora: lora_lib.LoraConfig | None = None,
                          params_path: Sequence[str] = ("policy", "params"),
                          checkpoint_dir: str = "checkpoints") -> str:
    """Writes ``run_dir/export.json`` and copies ``hf_path``'s tokenizer files into
    ``run_dir/hf_source/`` (step 1 of the module doc; process 0 only).

    Args:
      run_dir: the run directory (``run.out_dir``; a local path).
      hf_path: the checkpoint directory the run started from.
      model_cfg: the model as trained (dtype, sizes); None: read from ``hf_path``. Its ``lora``
        is used when ``lora`` is None.
      lora: the LoRA config of the trained adapters; None and ``model_cfg.lora`` off: full
        fine-tuning.
      params_path: keys from the checkpointed state to the policy params.
      checkpoint_dir: the checkpoint directory, relative to ``run_dir``.

    Returns:
      The manifest's path.
    """
    run_dir = os.fspath(run_dir)
    cfg = model_cfg if model_cfg is not None else read_transformer_config(hf_path)
    lora = lora if lora is not None else (cfg.lora if cfg.lora.enabled else None)
    base = dataclasses.replace(cfg, lora=lora_lib.LoraConfig())
    manifest = {"format": MANIFEST_FORMAT, "hf_path": os.path.abspath(hf_path),
                "config": hf_config_from(base), "dtype": base.param_dtype,
                "lora": None if lora is None or not lora.enabled else dataclasses.asdict(lora),
                "params_path": [str(k) for k in params_path], "checkpoint_dir": checkpoint_dir}
    path = os.path.join(run_dir, MANIFEST)
    if jax.process_index() != 0:
        return path
    copy = os.path.join(run_dir, SOURCE_COPY)
    os.makedirs(copy, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_path, name)):
            shutil.copyfile(os.path.join(hf_path, name), os.path.join(copy, name))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return path


def read_export_manifest(run_dir: str) -> ExportManifest:
    """The manifest of run directory ``run_dir``.

    Raises:
      ExportError: no ``export.json`` (the run's experiment does not export), or a field that
        is missing or of the wrong type (named).
    """
    path = os.path.join(run_dir, MANIFEST)
    if not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir!r} does not exist; valid: the --out of a "
                          "finished run")
    if not os.path.isfile(path):
        raise ExportError(f"{path} does not exist: the run's experiment wrote no export manifest"
                          "; valid: a run directory of an experiment that exports (rl)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {data.get('format') if isinstance(data, dict) else data!r}, "
                             f"expected {MANIFEST_FORMAT!r}")
        lora = None if data["lora"] is None else lora_lib.LoraConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in data["lora"].items()})
        model_cfg = config_from_hf(data["config"], dtype=data["dtype"], source=path)
        params_path = tuple(str(k) for k in data["params_path"])
        ckpt = os.path.join(run_dir, str(data["checkpoint_dir"]))
        hf_path = str(data["hf_path"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = f"lacks {e}" if isinstance(e, KeyError) else one_line(e)
        raise ExportError(f"{path} is not a valid export manifest ({reason}); valid: the file "
                          "write_export_manifest writes") from None
    return ExportManifest(hf_path=hf_path, model_cfg=model_cfg, lora=lora, params_path=params_path,
                          checkpoint_dir=os.path.abspath(ckpt),
                          tokenizer_dir=os.path.abspath(os.path.join(run_dir, SOURCE_COPY)))
