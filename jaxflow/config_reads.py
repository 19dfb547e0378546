"""Fields of shared config classes that only some experiments read, and who reads them.

``TransformerConfig.hf_path`` is in every experiment's model config, but only the drivers that
load a checkpoint read it; ``TransformerConfig.lora`` only those that train through
``jaxflow.train.pretrain`` or the GRPO trainer. Such a field is declared with
:func:`experiment_field`; an experiment takes it by listing the field's dotted key in its config
module's ``READS`` (``READS = ("model.hf_path",)``). Everywhere else ``--set`` refuses it at
parse time (:meth:`jaxflow.config.ExperimentSpec.configure`), naming the experiments that read
it, and ``--help`` leaves it out, so a key never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any, Sequence

#: Field metadata key marking a field only some experiments read (:func:`experiment_field`).
EXPERIMENT_READS = "read_by_experiment"


def experiment_field(default: Any) -> Any:
    """``dataclasses.field(default=default)`` for a field of a shared config class that only
    some drivers read (``TransformerConfig.hf_path``, ``TransformerConfig.lora``): an experiment
    takes it by listing its dotted key (``"model.hf_path"``) in its config module's ``READS``;
    in every other experiment ``--set`` refuses it and ``--help`` does not list it."""
    return dataclasses.field(default=default, metadata={EXPERIMENT_READS: True})


def _group_value(obj: Any, name: str) -> Any:
    """``obj.name``; an optional group that is off as its class's defaults."""
    value = getattr(obj, name)
    if value is None:
        group, optional = _strip_optional(typing.get_type_hints(type(obj)).get(name))
        if optional and dataclasses.is_dataclass(group):
            return typing.cast(Any, group)()
    return value


def marked_key(config: Any, key: str) -> str | None:
    """The dotted key of the :func:`experiment_field` on ``key``'s path (``model.lora`` for
    ``model.lora.rank``), or None (also for unknown keys: :func:`apply_overrides` names those)."""
    obj, parts = config, key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
        if part not in fields:
            return None
        if fields[part].metadata.get(EXPERIMENT_READS):
            return ".".join(parts[:i + 1])
        obj = _group_value(obj, part)
    return None


def marked_keys(config: Any, prefix: str = "") -> list[str]:
    """Dotted keys of every :func:`experiment_field` reachable in ``config``."""
    out = []
    for f in dataclasses.fields(config):
        key = f"{prefix}{f.name}"
        if f.metadata.get(EXPERIMENT_READS):
            out.append(key)
        elif dataclasses.is_dataclass(value := _group_value(config, f.name)):
            out.extend(marked_keys(value, key + "."))
    return out


def unread_message(name: str, key: str, marked: str, experiments: Sequence[str]) -> str:
    """``KEY is not read by NAME; K is read by: A, B`` over those of ``experiments`` (config
    module names) whose ``READS`` hold a key of the same field name (``hf_path``)."""
    leaf = marked.rpartition(".")[2]
    takers: dict[str, list[str]] = {}
    for other in experiments:
        try:
            reads = getattr(importlib.import_module(f"configs.{other}"), "READS", ())
        except Exception:  # noqa: BLE001 (a module that does not import cannot read it either)
            continue
        for k in reads:
            if k.rpartition(".")[2] == leaf:
                takers.setdefault(k, []).append(other)
    where = "; ".join(f"{k} is read by: {', '.join(v)}" for k, v in sorted(takers.items()))
    return f"{key} is not read by {name}; {where or 'no experiment reads ' + leaf}"


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False
