"""Every int / float config key of every experiment has a declared domain, and ``--set`` either
refuses a value with one line or keeps it inside that domain (``jaxflow.config_domains``)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from jaxflow.config import ConfigError, _strip_optional, apply_overrides, describe, experiments
from jaxflow.config_domains import COUNT, POSITIVE, Domain, Int, Real, declared_domains, domains
from jaxflow.run import main

#: The values the sweep sets on every numeric key (as typed on the command line).
SWEEP = ("0", "-1", "inf", "nan", "1e308", str(2**63))


def _numeric(type_name: str) -> bool:
    return ("int" in type_name or "float" in type_name) and "str" not in type_name


def _parent(config, key: str):
    """The (possibly switched-on) group holding ``key``'s leaf field, and the leaf's name."""
    *path, leaf = key.split(".")
    obj = config
    for part in path:
        obj = getattr(obj, part)
    return obj, leaf


def _quick_configs():
    return [(name, spec.get_config("quick" if "quick" in spec.variants else spec.variants[0]))
            for name, spec in experiments().items()]


def _owner_class(config, key: str) -> type:
    """The class declaring ``key``'s leaf (an optional group that is off: its declared class)."""
    obj = config
    for part in key.split(".")[:-1]:
        value = getattr(obj, part)
        obj = value if value is not None else _strip_optional(typing.get_type_hints(type(obj))[part])[0]()
    return type(obj)


def test_every_numeric_key_of_every_experiment_declares_a_domain():
    missing = []
    for name, config in _quick_configs():
        for key, type_name, _ in describe(config):
            cls, leaf = _owner_class(config, key), key.rpartition(".")[2]
            if _numeric(type_name) and leaf not in declared_domains(cls):
                missing.append(f"{name}: {key} ({cls.__qualname__}.{leaf})")
    assert not missing, "numeric fields without a declared domain (@domains): " + "; ".join(missing)


def test_sweep_every_numeric_key_refuses_or_stays_in_its_domain():
    checked = 0
    for name, config in _quick_configs():
        for key, type_name, _ in describe(config):
            if not _numeric(type_name):
                continue
            for text in SWEEP:
                try:
                    built = apply_overrides(config, [f"{key}={text}"])
                except ConfigError as e:
                    assert "\n" not in str(e) and key in str(e), (name, key, text, str(e))
                    continue
                parent, leaf = _parent(built, key)
                domain = declared_domains(type(parent))[leaf]
                value = getattr(parent, leaf)
                values = value if isinstance(value, tuple) else (value,)
                assert all(v is None or domain.contains(v) for v in values), (name, key, text, value, domain)
                checked += 1
    assert checked > 100  # plenty of values are valid somewhere (0 for counts that allow it, 1e308 rates)


def test_int_fields_refuse_floats_and_values_beyond_their_bound():
    config = experiments()["lm_pretrain"].get_config("quick")
    for text, says in [("1e23", "not an integer"), ("2.5", "not an integer"),
                       (str(2**63), "<= 2147483647"), (str(2**31), "<= 2147483647")]:
        with pytest.raises(ConfigError, match=says):
            apply_overrides(config, [f"train.steps={text}"])
    assert apply_overrides(config, [f"train.steps={2**31 - 1}"]).train.steps == 2**31 - 1


def test_domain_membership_and_messages():
    assert COUNT.contains(1) and not COUNT.contains(0) and not COUNT.contains(True)
    assert not COUNT.contains(2**31) and not COUNT.contains(1.0)
    assert POSITIVE.contains(1e308) and not POSITIVE.contains(math.inf) and not POSITIVE.contains(0.0)
    assert not POSITIVE.contains(math.nan) and POSITIVE.contains(3)
    half_open = Real(0.0, 1.0, high_open=True)
    assert half_open.contains(0.0) and not half_open.contains(1.0)
    assert half_open.describe() == "a number in [0, 1)"
    assert Int(-1, 5).describe() == "an integer >= -1 and <= 5"
    assert POSITIVE.describe() == "a finite number > 0"
    capped = Real(0.0, inf_off=True)  # a cap that inf turns off
    assert capped.contains(math.inf) and not capped.contains(-math.inf) and not capped.contains(math.nan)
    assert capped.describe() == "a finite number >= 0 (or inf: off)"


def test_domains_decorator_checks_construction_and_replace():
    @domains(n=COUNT, xs=POSITIVE, maybe=COUNT)
    @dataclasses.dataclass(frozen=True)
    class Toy:
        n: int = 1
        xs: tuple[float, ...] = (1.0,)
        maybe: int | None = None

    assert Toy(n=3, xs=(0.5, 2.0), maybe=None).n == 3
    with pytest.raises(ValueError, match=r"^n=0; valid: an integer >= 1 and <= 2147483647$"):
        Toy(n=0)
    with pytest.raises(ValueError, match=r"xs=\(1.0, inf\) holds inf; valid: each a finite number > 0"):
        dataclasses.replace(Toy(), xs=(1.0, math.inf))
    with pytest.raises(TypeError, match="not fields: m"):
        domains(m=COUNT)(Toy)
    assert isinstance(declared_domains(Toy)["n"], Domain)


@pytest.mark.parametrize("argv, says", [
    (["--exp=lm_pretrain", "--set", "model.norm_eps=inf"], "norm_eps=inf; valid: a finite number > 0"),
    (["--exp=lm_pretrain", "--set", "train.steps=1e23"], "train.steps='1e23': not an integer"),
    (["--exp=lm_pretrain", "--set", "mesh.axes=data,data"], "mesh.axes=('data', 'data')"),
    (["--exp=flowtrain", "--set", "data.patch_size=0"], "patch_size=0; valid: an integer >= 1"),
    (["--exp=nestpipe", "--set", "micro_batches=0"], "micro_batches=0; valid: an integer >= 1"),
    (["--exp=oxygenrec", "--set", "data.synthetic.new_fraction=inf"], "new_fraction=inf; valid: a number in [0, 1)"),
    (["--exp=dlrm_train", "--set", "model.embed_dim=0"], "embed_dim=0; valid: an integer >= 1"),
])
def test_cli_dry_run_refuses_the_named_cases_with_one_line(argv, says, capsys):
    assert main([*argv, "--variant=quick", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
