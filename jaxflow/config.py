"""Experiment configs: loading `configs/NAME.py` modules and applying `--set a.b=value` overrides.

Configs are frozen dataclasses (nested frozen dataclasses allowed). An override is parsed as the
field's declared type: int, float, bool, str, ``X | None`` and tuples (comma lists, e.g.
``--set model.shape=2,4``; an empty string gives an empty tuple). An optional group (``sync:
SyncConfig | None = None``) is switched on by setting one of its fields (``--set sync.codec=gap``)
and off by ``--set sync=none``. A float override is never
NaN. Config classes validate their own values where they are declared (``__post_init__`` with
:func:`require_positive` / :func:`require_finite` / :func:`require_range`); those errors reach the
user as one line naming the ``--set`` that caused them; every numeric field also declares its domain
(:mod:`jaxflow.config_domains`), and an int field takes an integer literal only (``1e23`` is refused).
A key of a field only some experiments read (``hf_path``, ``lora``: :mod:`jaxflow.config_reads`) is
refused by the others (:meth:`ExperimentSpec.configure`). An unknown key's error suggests the closest
full dotted key (``train.stepz`` -> ``train.steps``); :func:`describe_keys` lists every key with
its type and value (the runner's ``--exp NAME --help``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import pkgutil
import types
import typing
from typing import Any, Callable

from jaxflow.config_reads import experiment_field, marked_key, marked_keys, unread_message  # noqa: F401
from jaxflow.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in choosing or overriding a config; the message is one readable line."""


@dataclasses.dataclass(frozen=True)
class ExperimentSpec:
    """One registered experiment: its config module and what `--list` shows."""

    name: str
    description: str
    entry: str
    variants: tuple[str, ...]
    module: types.ModuleType
    compilers: tuple[str, ...] = ()  # "tpu" / "gpu": compiles for abstract chips (the aot extra)
    reads: tuple[str, ...] = ()  # the keys of fields marked by experiment_field it reads (READS)
    #: "package.module:function" building the summary's headline figures (HEADLINES;
    #: jaxflow.study.headline): summary -> [Headline, ...]
    headlines: str = ""

    def get_config(self, variant: str) -> Any:
        if variant not in self.variants:
            raise ConfigError(
                f"unknown variant {variant!r} for experiment {self.name!r}; "
                f"valid: {', '.join(self.variants)}{_did_you_mean(variant, self.variants)}"
            )
        return self.module.get_config(variant)

    def configure(self, variant: str, overrides: list[str]) -> Any:
        """The ``variant`` config with ``overrides`` applied; ConfigError (one line) for a bad
        variant, key or value, or a key of a field this experiment does not read
        (:func:`experiment_field`), naming the experiments that read it."""
        config = self.get_config(variant)
        for item in overrides:
            key = item.partition("=")[0].strip()
            marked = marked_key(config, key)
            if marked is not None and marked not in self.reads:
                raise ConfigError(unread_message(self.name, key, marked, experiment_names()))
        return apply_overrides(config, overrides)

    def keys_text(self, variant: str, overrides: list[str]) -> str:
        """:func:`describe_keys` of the configured ``variant`` without :meth:`unread_keys`
        (``--exp NAME --help``)."""
        config = self.configure(variant, overrides)
        return describe_keys(config, hidden=self.unread_keys(config))

    def unread_keys(self, config: Any) -> tuple[str, ...]:
        """The marked keys of ``config`` (:func:`experiment_field`) this experiment does not read:
        ``--set`` refuses them and ``--help`` leaves them out."""
        return tuple(k for k in marked_keys(config) if k not in self.reads)

    def entry_fn(self):
        module_name, _, fn_name = self.entry.partition(":")
        return getattr(importlib.import_module(module_name), fn_name)


class Variants:
    """A config module's ``get_config``: each variant declared once, as a zero-argument factory.

        get_config = Variants(quick=lambda: Config(steps=20), default=Config)
        VARIANTS = get_config.variants          # ("quick", "default"), for --list

    Calling it with an unknown name raises ValueError naming the valid ones.
    """

    def __init__(self, **factories: Callable[[], Any]):
        if not factories:
            raise ValueError("Variants needs at least one variant")
        self._factories = dict(factories)

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def __call__(self, variant: str) -> Any:
        if variant not in self._factories:
            raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(self._factories)}")
        return self._factories[variant]()


def require_positive(obj: Any, *names: str, allow_zero: bool = False) -> None:
    """Raises ValueError unless every field ``names`` of ``obj`` is an int >= 1 (>= 0 with
    ``allow_zero``); for counts, sizes and intervals (``steps``, ``batch_size``, ``log_every``)."""
    low = 0 if allow_zero else 1
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}; valid: an integer >= {low}")


def require_finite(obj: Any, *names: str, positive: bool = False) -> None:
    """Raises ValueError unless every field ``names`` of ``obj`` is a finite number (> 0 with
    ``positive``); for rates and coefficients (``lr``, ``weight_decay``)."""
    for name in names:
        value = getattr(obj, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (positive and value <= 0):
            raise ValueError(f"{name}={value!r}; valid: a finite number{' > 0' if positive else ''}")


def require_range(obj: Any, name: str, low: float, high: float, *, high_open: bool = False) -> None:
    """Raises ValueError unless ``low <= obj.name <= high`` (``< high`` with ``high_open``)."""
    value = getattr(obj, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name}={value!r}; valid: [{low}, {high}{')' if high_open else ']'}")


def _did_you_mean(value: str, choices) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def experiment_names() -> list[str]:
    """Names of the modules of the `configs` package (without importing them), sorted."""
    import configs

    return sorted(i.name for i in pkgutil.iter_modules(configs.__path__) if not i.name.startswith("_"))


def _load(name: str) -> ExperimentSpec | None:
    module = importlib.import_module(f"configs.{name}")
    if not hasattr(module, "get_config"):
        return None
    return ExperimentSpec(
        name=name,
        description=getattr(module, "DESCRIPTION", "").strip(),
        entry=module.ENTRY,
        variants=tuple(getattr(module, "VARIANTS", ("quick", "default", "full"))),
        module=module,
        compilers=tuple(getattr(module, "COMPILERS", ())),
        reads=tuple(getattr(module, "READS", ())),
        headlines=getattr(module, "HEADLINES", ""),
    )


def experiments() -> dict[str, ExperimentSpec]:
    """All experiments, from the modules of the `configs` package, sorted by name."""
    specs = {name: _load(name) for name in experiment_names()}
    return {name: spec for name, spec in specs.items() if spec is not None}


def get_experiment(name: str) -> ExperimentSpec:
    """The experiment called ``name`` (imports only its config module); ConfigError naming the
    valid ones otherwise."""
    names = experiment_names()
    spec = _load(name) if name in names else None
    if spec is None:
        raise ConfigError(
            f"unknown experiment {name!r}; valid: {', '.join(names)}{_did_you_mean(name, names)}"
        )
    return spec


def _type_hints(cls: type) -> dict[str, Any]:
    return _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))


_HINTS: dict[type, dict[str, Any]] = {}  # get_type_hints per class, once (the override sweep)


def _strip_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def parse_value(text: str, tp: Any, key: str) -> Any:
    """Parses ``text`` as type ``tp`` (the declared type of field ``key``)."""
    tp, optional = _strip_optional(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return _parse_int(text, key)
        if tp is float:
            value = float(text)
            if math.isnan(value):
                raise ConfigError(f"--set {key}={text!r}: NaN is not a valid value; valid: a number")
            return value
        if tp is str:
            return text
        if origin is tuple or tp is tuple:
            args = typing.get_args(tp)
            parts = [p.strip() for p in text.split(",")] if text.strip() else []
            if args and args[-1] is Ellipsis:
                return tuple(parse_value(p, args[0], key) for p in parts)
            if args:
                if len(parts) != len(args):
                    raise ConfigError(
                        f"--set {key}={text!r}: expected {len(args)} comma-separated values"
                    )
                return tuple(parse_value(p, a, key) for p, a in zip(parts, args))
            return tuple(parts)
        if typing.get_origin(tp) is typing.Literal:
            choices = typing.get_args(tp)
            if text in choices:
                return text
            raise ConfigError(
                f"--set {key}={text!r}: valid values are {', '.join(map(str, choices))}"
                f"{_did_you_mean(text, choices)}"
            )
    except ConfigError:
        raise
    except (ValueError, TypeError):
        name = getattr(tp, "__name__", str(tp))
        raise ConfigError(f"--set {key}={text!r}: cannot parse {text!r} as {name}") from None
    raise ConfigError(f"--set {key}: field type {tp} cannot be set from the command line")


def _parse_int(text: str, key: str) -> int:
    """``text`` as an int field's value: an integer literal (no float notation: ``1e23`` and
    ``2.5`` are refused rather than rounded)."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--set {key}={text!r}: not an integer; valid: an integer literal "
                          f"such as 100 (no decimal point or exponent)") from None
    return value  # its bounds are the field's declared domain (jaxflow.config_domains)


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """Returns ``config`` with each ``a.b=value`` override applied (frozen dataclasses).

    Overrides of one dataclass are applied together, so fields validated against each other
    (``n_heads`` and ``n_kv_heads``) can change in one command; a later override of the same key
    wins.

    Raises:
      ConfigError: malformed override, unknown key (with the closest valid key), bad value.
    """
    tree: dict = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=100")
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is set as a value and as a group")
        node[leaf] = (text, key)
    return _apply_tree(config, tree, "", config)


def _apply_tree(obj: Any, tree: dict, prefix: str, root: Any) -> Any:
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"--set {prefix.rstrip('.')}: is not a config group")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = _type_hints(type(obj))
    changes, texts = {}, []
    for name, sub in tree.items():
        full_key = f"{prefix}{name}"
        if name not in fields:
            typed = sub[1] if not isinstance(sub, dict) else _tree_texts(sub)[0].partition("=")[0]
            where = f" (in --set {typed})" if typed != full_key else ""
            raise ConfigError(
                f"unknown config key {full_key!r}{where}; valid keys here: {', '.join(sorted(fields))}"
                f"{_did_you_mean_key(typed, root)}"
            )
        current = getattr(obj, name)
        group_type, optional = _strip_optional(hints.get(name, type(current)))
        if isinstance(sub, dict):
            if current is None and optional and dataclasses.is_dataclass(group_type):
                current = typing.cast(Any, group_type)()  # an optional group switched on by setting a field
            changes[name] = _apply_tree(current, sub, full_key + ".", root)
            texts.extend(_tree_texts(sub))
            continue
        text, key = sub
        if dataclasses.is_dataclass(current) or (current is None and optional
                                                 and dataclasses.is_dataclass(group_type)):
            if optional and text.strip().lower() in ("none", "null"):
                changes[name] = None  # an optional group switched off
                texts.append(f"{key}={text}")
                continue
            group = sorted(f.name for f in dataclasses.fields(group_type))
            off = f" (or {key}=none)" if optional else ""
            raise ConfigError(f"--set {key}: is a group; set one of {', '.join(group)}{off}")
        changes[name] = _check_known_range(name, parse_value(text, hints.get(name, type(current)),
                                                             key), key, text)
        texts.append(f"{key}={text}")
    try:
        return dataclasses.replace(typing.cast(Any, obj), **changes)
    except (ValueError, TypeError) as e:  # __post_init__ validation
        where = " ".join(texts) or prefix.rstrip(".")
        raise ConfigError(f"--set {where}: {e}") from None


#: Seeds become ``jax.random.key`` / numpy ``SeedSequence`` words: unsigned 32-bit.
SEED_RANGE = (0, 2**32 - 1)


def _check_known_range(name: str, value: Any, key: str, text: str) -> Any:
    """``value`` of field ``name`` when it is in the range every config shares for that kind of
    field (a seed: :data:`SEED_RANGE`); ConfigError naming the ``--set`` otherwise."""
    if (name == "seed" or name.endswith("_seed")) and isinstance(value, int) \
            and not isinstance(value, bool) and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise ConfigError(f"--set {key}={text!r}: a seed is an unsigned 32-bit integer; valid: "
                          f"{SEED_RANGE[0]}..{SEED_RANGE[1]}")
    return value


def _tree_texts(tree: dict) -> list[str]:
    out = []
    for sub in tree.values():
        if isinstance(sub, dict):
            out.extend(_tree_texts(sub))
        else:
            out.append(f"{sub[1]}={sub[0]}")
    return out


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every leaf field of a (nested) dataclass config."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def _fields_of(config: Any) -> list[tuple[str, Any, Any, bool]]:
    """(name, declared type, value, optional group switched off) of each field of ``config``;
    an optional group that is None is described by its class's defaults."""
    hints = _type_hints(type(config))
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        tp = hints.get(f.name, type(value))
        group, optional = _strip_optional(tp)
        off = value is None and optional and dataclasses.is_dataclass(group)
        out.append((f.name, tp, typing.cast(Any, group)() if off else value, off))
    return out


def describe(config: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, type, value)`` for every field ``--set`` can reach in ``config``: the leaves
    of nested groups, and each optional group (``sync: SyncConfig | None``) with its own
    keys (when it is off, their class defaults, and the value says ``--set KEY=none`` is its
    current state). Values are written as ``--set`` takes them (``2,4``, ``true``, ``none``)."""
    rows = []
    for name, tp, value, off in _fields_of(config):
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            _, optional = _strip_optional(tp)
            if optional:
                state = "none (setting one of its keys switches it on)" if off else "on (KEY=none: off)"
                rows.append((key, type_name(tp), state))
            rows.extend(describe(value, key + "."))
        else:
            rows.append((key, type_name(tp), format_value(value)))
    return rows


def describe_keys(config: Any, hidden: tuple[str, ...] = ()) -> str:
    """:func:`describe` as aligned lines ``  KEY  TYPE  VALUE``, without the keys at or under
    ``hidden`` (an experiment's :meth:`ExperimentSpec.unread_keys`)."""
    rows = [r for r in describe(config) if not any(r[0] == h or r[0].startswith(h + ".") for h in hidden)]
    wk = max((len(k) for k, _, _ in rows), default=0)
    wt = min(max((len(t) for _, t, _ in rows), default=0), 40)
    return "\n".join(f"  {k:<{wk}}  {t:<{wt}}  {v}".rstrip() for k, t, v in rows)


def type_name(tp: Any) -> str:
    """A declared field type as text: ``int``, ``tuple[int, ...]``, ``'xla' | 'flash'``,
    ``float | None``, ``SyncConfig | None``."""
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{type_name(inner)} | None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple:
        if args and args[-1] is Ellipsis:
            return f"tuple[{type_name(args[0])}, ...]"
        return f"tuple[{', '.join(type_name(a) for a in args)}]" if args else "tuple"
    if tp is type(None):
        return "None"
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def format_value(value: Any) -> str:
    """``value`` as ``--set`` would take it: ``none``, ``true`` / ``false``, comma lists, ``""``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(format_value(v) for v in value) if value else '""'
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def _did_you_mean_key(typed: str, root: Any) -> str:
    """`` (did you mean 'a.b'?)`` for the full dotted key of ``root`` closest to ``typed``: by
    the whole key, else by its last part (``stepz`` -> ``train.steps``); "" when none is close."""
    keys = [k for k, _, _ in describe(root)]
    close = difflib.get_close_matches(typed, keys, n=1, cutoff=0.6)
    if not close:
        leaf = typed.rpartition(".")[2]
        leaves = difflib.get_close_matches(leaf, sorted({k.rpartition(".")[2] for k in keys}), n=1, cutoff=0.6)
        same = [k for k in keys if leaves and k.rpartition(".")[2] == leaves[0]]
        close = difflib.get_close_matches(typed, same, n=1, cutoff=0.0)
    return f" (did you mean {close[0]!r}?)" if close else ""
