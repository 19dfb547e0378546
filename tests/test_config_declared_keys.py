"""Keys that only some experiments read (``jaxflow.config_reads``): refused at parse time by
the others with one line naming who reads them, left out of their ``--help``, and ``--dry-run``
shows the checkpoint a set ``hf_path`` would load."""

from __future__ import annotations

import json

import pytest

from jaxflow.config import ConfigError, experiments, get_experiment, marked_keys
from jaxflow.run import main
from tests._hf_fixtures import write_tiny_qwen3


def test_flagship_refuses_pretrain_hf_path_naming_the_experiments_that_read_it(capsys):
    code = main(["--exp=flagship", "--variant=quick", "--dry-run", "--set", "pretrain.model.hf_path=/ckpt"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "pretrain.model.hf_path is not read by flagship; model.hf_path is read by: " in err
    takers = err.rpartition("model.hf_path is read by: ")[2].strip().split(", ")
    assert {"calibration_tradeoffs", "sis_offpolicy", "sis_regime"} <= set(takers)
    assert "flagship" not in takers and "lm_pretrain" not in takers


@pytest.mark.parametrize("exp, key", [("lm_pretrain", "model.hf_path=/ckpt"),
                                      ("calibration_tradeoffs", "model.lora.rank=4"),
                                      ("flowtrain", "model.lora.rank=4")])
def test_an_undeclared_marked_key_is_refused_before_its_value_is_checked(exp, key):
    with pytest.raises(ConfigError, match=rf"^{key.partition('=')[0]} is not read by {exp}; "):
        get_experiment(exp).configure("quick", [key])


def test_declared_keys_are_taken():
    assert get_experiment("lm_pretrain").configure("quick", ["model.lora.rank=4"]).model.lora.rank == 4
    flagship = get_experiment("flagship").configure("quick", ["pretrain.model.lora.rank=2"])
    assert flagship.pretrain.model.lora.rank == 2


def test_help_leaves_out_the_keys_an_experiment_refuses(capsys):
    assert main(["--exp=flagship", "--variant=quick", "--help"]) == 0
    keys = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "pretrain.model.lora.rank" in keys and "rl.lora.rank" in keys
    assert "pretrain.model.hf_path" not in keys
    assert main(["--exp=sis_offpolicy", "--variant=quick", "--help"]) == 0
    assert "model.hf_path" in {line.split()[0] for line in capsys.readouterr().out.splitlines()
                               if line.startswith("  ")}


def test_every_reads_entry_names_a_marked_key_and_unread_ones_keep_their_defaults():
    for name, spec in experiments().items():
        config = spec.get_config("quick" if "quick" in spec.variants else spec.variants[0])
        marked = marked_keys(config)
        assert set(spec.reads) <= set(marked), (name, spec.reads, marked)
        for key in spec.unread_keys(config):  # what it does not read, its variants leave alone
            fresh = type(_owner(config, key))()
            leaf = key.rpartition(".")[2]
            assert getattr(_owner(config, key), leaf) == getattr(fresh, leaf), (name, key)


def _owner(config, key: str):
    obj = config
    for part in key.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


def test_dry_run_prints_the_checkpoint_config(tmp_path, capsys):
    path = str(tmp_path / "tiny")
    write_tiny_qwen3(path, seed=3)
    assert main(["--exp=sis_offpolicy", "--variant=quick", "--dry-run", "--set", f"model.hf_path={path}"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loaded = line["checkpoints"]["model.hf_path"]
    assert loaded["architecture"] == "qwen3" and loaded["vocab_size"] == json.load(
        open(f"{path}/config.json"))["vocab_size"]
    assert line["config"]["model"]["hf_path"] == path
