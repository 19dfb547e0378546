"""The runner's CLI: --list, overrides, and every user error -> exit 2 with one line."""

import dataclasses
import json

import pytest

from jaxflow import run as runner
from jaxflow.config import ConfigError, apply_overrides, parse_value
from tests._cli import TINY_LM, run_cli


def _error_line(capsys, argv):
    code = runner.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_list_shows_every_experiment_with_variants(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "lm_pretrain" in out and "quick, default, full" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--exp=lm_pretrian"], "did you mean 'lm_pretrain'"),
        (["--exp=lm_pretrain", "--variant=quik"], "did you mean 'quick'"),
        (["--exp=lm_pretrain", "--set", "train.stepz=3"], "did you mean 'train.steps'"),
        (["--exp=lm_pretrain", "--set", "train.steps=three"], "train.steps='three': not an integer"),
        (["--exp=lm_pretrain", "--set", "train.steps"], "expected KEY=VALUE"),
        (["--exp=lm_pretrain", "--set", "model.d_model=30"], "divisible"),
        (["--exp=lm_pretrain", "--set", "data.loss_on=some"], "valid: answer, all"),
        (["--exp=lm_pretrain", "--set", "mesh.shape=-1,3"], "not divisible by 3"),
        (["--exp=lm_pretrain", "--set", "mesh.shape=3,1"], "needs 3 devices but 8"),
        (["--exp=lm_pretrain", "--bogus"], "unrecognized arguments"),
        (["--resume"], "--resume needs --out"),
        ([], "--exp NAME is required"),
    ],
)
def test_user_errors_exit_2_with_one_line(capsys, argv, expected):
    assert expected in _error_line(capsys, argv)


def test_existing_run_dir_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert "--resume" in _error_line(capsys, ["--exp=lm_pretrain", f"--out={tmp_path}"])


def test_overrides_parse_declared_types():
    from configs.lm_pretrain import get_config

    cfg = apply_overrides(get_config("quick"), ["train.steps=7", "optim.lr=0.5", "mesh.shape=2,4",
                                                "model.tie_embeddings=true"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 0.5 and cfg.mesh.shape == (2, 4)
    assert cfg.model.tie_embeddings is True
    assert parse_value("", tuple[int, ...], "k") == ()
    assert parse_value("none", int | None, "k") is None
    with pytest.raises(ConfigError, match="group"):
        apply_overrides(cfg, ["train=3"])


def test_devices_flag_gives_fake_devices_and_mesh_check(tmp_path):
    # 6 devices cannot form a (4, -1) mesh: exit 2 before anything runs.
    bad = run_cli(["--exp=lm_pretrain", "--variant=quick", "--devices=6", "--set", "mesh.shape=4,-1",
                   f"--out={tmp_path / 'bad'}"])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "6 devices" in bad.stderr
    assert not (tmp_path / "bad").exists()
    ok = run_cli(["--exp=lm_pretrain", "--variant=quick", "--devices=4", "--set", "mesh.shape=2,2",
                  "--set", "train.steps=2", "--set", "train.log_every=1", *TINY_LM, f"--out={tmp_path / 'ok'}"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["device_count"] == 4
    assert summary["config"]["mesh"]["shape"] == [2, 2]


def test_experiment_devices_field_is_the_default_device_count():
    from configs import lm_pretrain, nestpipe

    config = nestpipe.get_config("quick")
    parse = runner.build_parser().parse_args
    assert config.devices is None  # every device present; 8 fake ones on a CPU
    assert runner.default_devices(parse(["--exp=nestpipe"]), config) == 8
    pinned = dataclasses.replace(config, devices=4)
    assert runner.default_devices(parse(["--exp=nestpipe"]), pinned) == 4
    assert runner.default_devices(parse(["--exp=nestpipe", "--devices=2"]), config) == 2
    multi = parse(["--exp=nestpipe", "--coordinator=127.0.0.1:1", "--num-processes=2",
                   "--process-id=0"])
    assert runner.default_devices(multi, config) is None  # each process brings its own
    lm = lm_pretrain.get_config("quick")
    assert runner.default_devices(parse(["--exp=lm_pretrain"]), lm) is None
