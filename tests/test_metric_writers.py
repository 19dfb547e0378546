"""Metric writers: metrics.jsonl unchanged, TensorBoard event files read back equal to it, resume
rewinds both, W&B through the same rows, only process 0 writes, the runner's switches."""

import dataclasses
import json
import pathlib
import sys
import types
import typing

import numpy as np
import pytest

from jaxflow import metric_writers
from jaxflow import run as runner
from jaxflow.experiment import MissingExtraError, RunContext
from jaxflow.train.loop import run_steps


def _tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard itself reads the event files in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, _nan_text(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _nan_text(value: float):
    """NaN as "nan", so that two read-backs compare equal with ==."""
    return "nan" if np.isnan(value) else value


def _jsonl_scalars(path) -> dict[str, list[tuple[int, float]]]:
    """The same view of metrics.jsonl: numeric fields (bools and "step" aside) as float32."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in metric_writers.scalars(row).items():
            out.setdefault(key, []).append((row["step"], _nan_text(float(np.float32(value)))))
    return out


def _rows(steps, scale=1.0):
    return [(s, {"loss": scale / s, "tokens_seen": 64 * s, "lr": 1e-3, "name": "cell-a",
                 "ok": True, "hist": [1, 2], "diverged": float("nan") if s == 8 else 0.0})
            for s in steps]


def test_jsonl_bytes_are_the_rows_as_json_lines(tmp_path):
    run = RunContext(name="t", variant="quick", out_dir=tmp_path)
    for step, metrics in _rows([1, 2, 3]):
        run.log(step, metrics)
    run.close()
    expected = "".join(json.dumps({"step": s, **{k: ("nan" if isinstance(v, float) and v != v else v)
                                               for k, v in m.items()}}) + "\n" for s, m in _rows([1, 2, 3]))
    assert (tmp_path / "metrics.jsonl").read_text() == expected


def test_tensorboard_events_equal_the_jsonl_rows(tmp_path):
    run = RunContext(name="t", variant="quick", out_dir=tmp_path)
    result = run_steps(lambda state, step: (state + 1, {"loss": 1.0 / (step + 1), "count": step + 1}),
                       0, steps=6, run=run, log_every=2)
    for step, metrics in _rows([7, 8]):
        run.log(step, metrics)
    run.close()
    assert result.state == 6
    tb = _tensorboard_scalars(tmp_path / "tensorboard")
    assert tb == _jsonl_scalars(tmp_path / "metrics.jsonl")
    assert tb["loss"][:3] == [(2, np.float32(0.75)), (4, np.float32((1 / 3 + 1 / 4) / 2)),
                              (6, np.float32((1 / 5 + 1 / 6) / 2))]
    assert [s for s, _ in tb["tokens_seen"]] == [7, 8]  # counters are logged too
    assert tb["diverged"] == [(7, 0.0), (8, "nan")]
    assert not {"name", "ok", "hist", "step"} & set(tb)  # strings, bools, lists: JSONL only


def test_resume_rewinds_jsonl_and_tensorboard(tmp_path):
    # tensorboard numbers the event files a process opens (a name's last field): the run's two
    # files get 10^k - 1 and 10^k here ("10" sorts before "9" as text: read first, if opened in
    # the same second)
    from tensorboard.summary.writer import event_file_writer

    counter = event_file_writer._global_uid
    target = 10 ** len(str(counter._value + 1)) - 1
    while counter._value < target:
        counter.get()
    first = RunContext(name="t", variant="quick", out_dir=tmp_path)
    for step, metrics in _rows([1, 2, 3, 4]):
        first.log(step, metrics)
    first.close()
    resumed = RunContext(name="t", variant="quick", out_dir=tmp_path, resume=True)
    resumed.truncate_metrics_after(2)
    for step, metrics in _rows([3, 4, 5], scale=10.0):
        resumed.log(step, metrics)
    resumed.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4, 5]
    tb = _tensorboard_scalars(tmp_path / "tensorboard")
    assert tb == _jsonl_scalars(tmp_path / "metrics.jsonl")
    assert tb["loss"] == [(1, 1.0), (2, 0.5), (3, np.float32(10 / 3)), (4, 2.5), (5, 2.0)]


def test_tensorboard_off_and_other_processes_write_nothing(tmp_path):
    off = RunContext(name="t", variant="quick", out_dir=tmp_path / "off", tensorboard=False)
    off.log(1, {"loss": 1.0})
    off.close()
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == ["metrics.jsonl"]
    other = RunContext(name="t", variant="quick", out_dir=tmp_path / "p1", is_primary=False)
    other.log(1, {"loss": 1.0})
    other.truncate_metrics_after(0)
    other.close()
    assert not (tmp_path / "p1").exists()


def test_wandb_writer_logs_each_rows_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    run = RunContext(name="exp", variant="quick", out_dir=tmp_path, tensorboard=False,
                     wandb_project="proj", config=ToyConfig(steps=5))
    run.log(3, {"loss": 0.5, "name": "x", "bad": float("inf")})
    run.close()
    assert calls == [("init", {"project": "proj", "name": "exp-quick", "dir": str(tmp_path),
                               "config": {"steps": 5}}),
                     ("log", 3, {"loss": 0.5, "bad": float("inf")}), ("finish",)]


def test_missing_wandb_is_a_one_line_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(MissingExtraError, match="pip install wandb"):
        metric_writers.import_wandb()
    code = runner.main(["--exp=lm_pretrain", "--variant=quick", "--wandb=proj", f"--out={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [f"{runner.PROG}: error: --wandb needs the wandb package: "
                                              "pip install wandb"], err
    assert not (tmp_path / "r").exists()


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    steps: int = 3


def toy_main(config, run):
    """A toy experiment's entry: ``config.steps`` rows, as every driver writes them."""
    for step in range(1, config.steps + 1):
        run.log(step, {"loss": 1.0 / step, "rollout": step, "phase": "train"})
    return {"final_loss": 1.0 / config.steps}


@pytest.fixture
def toy_experiment(monkeypatch):
    from jaxflow.config import ExperimentSpec

    module = types.SimpleNamespace(get_config=lambda variant: ToyConfig())
    spec = ExperimentSpec(name="toy", description="", entry=f"{__name__}:toy_main",
                          variants=("quick", "default"), module=typing.cast(types.ModuleType, module))
    monkeypatch.setattr(runner, "get_experiment", lambda name: spec)


def test_runner_writes_tensorboard_by_default_and_not_with_the_flag_off(tmp_path, capsys, toy_experiment):
    assert runner.main(["--exp=toy", "--variant=quick", f"--out={tmp_path / 'on'}"]) == 0, \
        capsys.readouterr().err[-2000:]
    tb = _tensorboard_scalars(tmp_path / "on" / "tensorboard")
    assert tb == _jsonl_scalars(tmp_path / "on" / "metrics.jsonl")
    assert tb == {"loss": [(1, 1.0), (2, 0.5), (3, np.float32(1 / 3))], "rollout": [(1, 1.0), (2, 2.0), (3, 3.0)]}
    assert sorted(p.name for p in (tmp_path / "on" / "plots").iterdir()) == ["loss.png"]  # not rollout
    assert runner.main(["--exp=toy", "--variant=quick", "--no-tensorboard", f"--out={tmp_path / 'off'}"]) == 0
    assert (tmp_path / "off" / "metrics.jsonl").read_text() == (tmp_path / "on" / "metrics.jsonl").read_text()
    assert not (tmp_path / "off" / "tensorboard").exists()

def test_counter_rule():
    from jaxflow.plots import is_counter

    assert is_counter("rollout", [1, 2, 3, 1, 2, 3])  # restarted per seed
    assert is_counter("tokens_seen", [64, 128, 192]) and is_counter("sync_bit_exact", [1.0, 1.0, 1.0])
    assert is_counter("trainer_version", [0, 3, 1]) and is_counter("seed", [5, 2])  # by name
    assert not is_counter("correct", [0, 3, 1]) and not is_counter("loss", [1.0, 0.5, 0.75])
    assert not is_counter("loss", [2.0, 1.5]) and not is_counter("nonzero_count", [4, 2, 3])
    assert not is_counter("sync_payload_bytes", [100.0, 200.0, 300.0])  # floats that vary measure
    assert not is_counter("rollout", [1.0, 2.0, 3.0])  # ... even when they climb like a counter


def test_plots_titled_by_experiment_without_counters_integer_step_ticks(tmp_path, monkeypatch):
    import matplotlib.figure

    from jaxflow.plots import plot_metrics

    run_dir = tmp_path / "user" / "custom-out"  # a custom --out: the directories name no experiment
    run = RunContext(name="myexp", variant="quick", out_dir=run_dir, tensorboard=False)
    run.write_json("config.json", {"experiment": "myexp"})
    for step in (1, 2, 3):  # 3 steps: matplotlib's default locator would tick 1.5, 2.5
        run.log(step, {"loss": 1.0 / step, "rollout": step, "seed_index": 0, "synced": 1.0,
                       "correct": [2, 0, 1][step - 1], "name": "x"})
    run.close()
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, path, *a, **kw):
        ax = fig.axes[0]
        seen[pathlib.Path(path).name] = (ax.get_title(), list(ax.get_xticks()))
        return save(fig, path, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    written = plot_metrics(run_dir)
    assert sorted(p.name for p in written) == ["correct.png", "loss.png"]
    assert all(p.exists() for p in written)
    assert seen["loss.png"][0] == "myexp: loss"
    assert all(float(t).is_integer() for t in seen["loss.png"][1]), seen
    assert plot_metrics(run_dir, title="other")[0].exists() and seen["loss.png"][0] == "other: loss"


def test_resume_keeps_the_runs_tensorboard_choice(tmp_path, monkeypatch, capsys, toy_experiment):
    import jaxflow.checkpoint
    from jaxflow.run_dirs import resolve_run

    assert runner.main(["--exp=toy", "--no-tensorboard", f"--out={tmp_path}"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["tensorboard"] is False
    monkeypatch.setattr(jaxflow.checkpoint, "has_progress", lambda out: True)  # as if checkpointed
    parse = runner.build_parser().parse_args
    for flags, expected in (([], False), (["--tensorboard"], True), (["--no-tensorboard"], False)):
        args = parse(["--resume", f"--out={tmp_path}", *flags])
        resolve_run(args, runner.run_path(str(tmp_path)))
        assert args.tensorboard is expected, flags
    fresh = parse(["--exp=toy"])
    resolve_run(fresh, None)
    assert fresh.tensorboard is True
