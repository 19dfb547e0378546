"""``--exp NAME --help`` lists the experiment's config keys with types and values; an unknown
``--set`` key suggests the closest full dotted key."""

import dataclasses

import pytest

from jaxflow import run as runner
from jaxflow.config import apply_overrides, describe, format_value, get_experiment, type_name
from tests._cli import one_line_error


def _keys(out: str) -> dict[str, tuple[str, str]]:
    """{key: (type, value)} from the listing after "config keys of"."""
    listing = out.split("--set KEY=VALUE):\n", 1)[1]
    rows = {}
    for line in listing.splitlines():
        key, rest = line.strip().split(None, 1)
        type_text, _, value = rest.rpartition("  ")
        rows[key] = (type_text.strip(), value.strip())
    return rows


def test_help_without_exp_lists_the_flags(capsys):
    assert runner.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--no-tensorboard" in out and "--wandb PROJECT" in out and "--exp NAME" in out
    assert "config keys of" not in out


def test_exp_help_lists_every_key_with_type_and_variant_value(capsys):
    assert runner.main(["--exp=lm_pretrain", "--variant=quick", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m jaxflow.run") and "config keys of lm_pretrain [quick]" in out
    keys = _keys(out)
    config = get_experiment("lm_pretrain").get_config("quick")
    assert keys["train.steps"] == ("int", str(config.train.steps))
    assert keys["optim.lr"] == ("float", repr(config.optim.lr))
    assert keys["mesh.shape"][0] == "tuple[int, ...]"
    assert keys["mesh.shape"][1] == ",".join(map(str, config.mesh.shape))
    assert keys["data.loss_on"] == ("str", config.data.loss_on)
    assert keys["model.tie_embeddings"] == ("bool", "true" if config.model.tie_embeddings else "false")
    assert keys["model.rope_scaling"][0] == "RopeScaling | None"
    # every key listed is one --set accepts, and every leaf of the config is listed
    flat = set()

    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            (walk(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value)
             else flat.add(f"{prefix}{f.name}"))

    walk(config)
    hidden = set(get_experiment("lm_pretrain").unread_keys(config))  # keys it refuses: not listed
    assert hidden == {"model.hf_path"} and not hidden & set(keys)
    assert flat - hidden <= set(keys)
    assert keys["model.dense_layers"] == ("tuple[int, ...]", '""')  # an empty tuple, as --set takes it
    for key, value in (("model.rope_scaling", "none (setting one of its keys switches it on)"),
                       ("model.rope_scaling.factor", "8.0")):  # an optional group that is off
        assert keys[key][1] == value
    shell = {k: ("" if v == '""' else v) for k, (t, v) in keys.items()  # "" as the shell passes it
             if t in ("int", "float", "bool", "str", "tuple[int, ...]") and not k.startswith("model.rope_")}
    assert apply_overrides(config, [f"{k}={v}" for k, v in shell.items()]) == config  # values parse back


def test_help_values_follow_variant_and_overrides(capsys):
    quick = get_experiment("lm_pretrain").get_config("quick")
    default = get_experiment("lm_pretrain").get_config("default")
    assert quick.train.steps != default.train.steps
    assert runner.main(["--exp=lm_pretrain", "--help"]) == 0
    assert _keys(capsys.readouterr().out)["train.steps"][1] == str(default.train.steps)
    assert runner.main(["--exp=lm_pretrain", "--variant=quick", "--set", "train.steps=7", "--help"]) == 0
    assert _keys(capsys.readouterr().out)["train.steps"][1] == "7"


def test_optional_groups_are_listed_with_their_keys(capsys):
    assert runner.main(["--exp=flagship", "--variant=quick", "--set", "sync=none", "--help"]) == 0
    keys = _keys(capsys.readouterr().out)
    assert keys["sync"] == ("SyncConfig | None", "none (setting one of its keys switches it on)")
    assert keys["sync.codec"][0] == "str" and keys["sync.every"] == ("int", "1")
    config = apply_overrides(get_experiment("flagship").get_config("quick"), ["sync.every=4"])
    assert dict((k, v) for k, _, v in describe(config))["sync.every"] == "4"


@pytest.mark.parametrize("argv, line", [
    (["--exp=nosuch", "--help"], "unknown experiment 'nosuch'"),
    (["--exp=lm_pretrain", "--variant=quik", "--help"], "did you mean 'quick'"),
    (["--exp=lm_pretrain", "--set", "train.stepz=3"], "did you mean 'train.steps'?"),
    (["--exp=lm_pretrain", "--set", "stepz=3"], "did you mean 'train.steps'?"),
    (["--exp=lm_pretrain", "--set", "trian.steps=3"], "unknown config key 'trian' (in --set trian.steps)"),
    (["--exp=lm_pretrain", "--set", "trian.steps=3"], "did you mean 'train.steps'?"),
    (["--exp=lm_pretrain", "--set", "model.dmodel=3"], "did you mean 'model.d_model'?"),
    (["--exp=flagship", "--set", "sync.codek=gap"], "did you mean 'sync.codec'?"),
])
def test_unknown_keys_suggest_the_full_dotted_key(capsys, argv, line):
    assert line in one_line_error(capsys, argv)


def test_type_names_and_values_as_set_takes_them():
    from typing import Literal

    assert type_name(int) == "int" and type_name(float | None) == "float | None"
    assert type_name(tuple[int, ...]) == "tuple[int, ...]" and type_name(tuple[int, str]) == "tuple[int, str]"
    assert type_name(Literal["xla", "flash"]) == "'xla' | 'flash'"
    assert [format_value(v) for v in (None, True, (2, 4), "", "gap", 0.5)] == \
        ["none", "true", "2,4", '""', "gap", "0.5"]
