"""The `figa` experiment: its config contract and a tiny end-to-end run of its driver."""

import dataclasses

import numpy as np
import pytest

from configs import figa as figa_config
from configs.lm_pretrain import Config as PretrainConfig
from configs.lm_pretrain import DataConfig, TrainConfig
from jaxflow.align import batch_schedule, train_method
from jaxflow.experiment import standalone_context
from jaxflow.main import figa
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig


def test_config_contract():
    assert figa_config.ENTRY == "jaxflow.main.figa:main"
    quick = figa_config.get_config("quick")
    assert quick.methods == ("sft", "dpo", "figa") and quick.seeds == 3
    assert quick.dpo_beta == 0.1 and quick.figa.alpha == 1.0 and quick.figa.beta == 0.5
    assert quick.figa.gamma == 0.0 and quick.figa.neg_nll_max == 0.6
    for variant in figa_config.VARIANTS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            figa_config.get_config(variant).seeds = 1
    with pytest.raises(ValueError, match=r"has unknown \['ppo'\]"):
        dataclasses.replace(quick, methods=("sft", "ppo"))
    with pytest.raises(ValueError, match="unknown variant 'huge'"):
        figa_config.get_config("huge")


def test_batch_schedule_covers_every_pair_each_epoch():
    sched = batch_schedule(10, 5, 4, seed=0)  # 20 slots = 2 epochs of 10
    assert sched.shape == (5, 4)
    flat = sched.reshape(-1)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))


def test_tiny_run_end_to_end(tmp_path):
    pretrain = PretrainConfig(
        seed=0,
        model=TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                d_ff=64, max_seq_len=16),
        data=DataConfig(max_digits=1, heldout_mod=5),
        train=TrainConfig(steps=20, batch_size=16, seq_len=16, log_every=20, eval_every=20,
                          eval_examples=16, checkpoint_every=20, keep_checkpoints=1),
        optim=OptimConfig(lr=3e-3, warmup_steps=5))
    cfg = dataclasses.replace(
        figa_config.get_config("quick"), seeds=1, pretrain=pretrain,
        cache_root=str(tmp_path / "cache"),
        data=figa_config.DataConfig(pairs=16, prompts_per_round=16),
        train=figa_config.TrainConfig(steps=2, pairs_per_batch=4, eval_every=2,
                                      eval_examples=8, eval_samples=0, log_every=1))
    run = standalone_context("figa", out_dir=str(tmp_path / "run"))
    summary = figa.main(cfg, run)
    rows = {r["method"]: r for r in summary["results"]}
    assert set(rows) == {"sft", "dpo", "figa"}
    for r in rows.values():
        assert r["seeds"] == 1 and 0 <= r["heldout_greedy_mean"] <= 1
        assert [c["step"] for c in r["curve"]] == [0, 2]
    assert summary["pair_pools"][0]["pairs"] >= 1
    assert np.isfinite(summary["warm_start"]["heldout_greedy"])
    assert (tmp_path / "run" / "plots" / "figa_curves.png").exists()
    assert "| figa | 1 |" in summary["table"]
    # the headline: figa minus the stronger of sft / dpo, from the per-seed finals
    from jaxflow.study.headlines_rl import figa as figa_headlines

    assert {m: set(v) for m, v in summary["final_by_seed"].items()} == {m: {0} for m in rows}
    (head,) = figa_headlines(summary)
    best = max(("sft", "dpo"), key=lambda m: rows[m]["heldout_greedy_mean"])
    assert head.baseline == best and head.value == pytest.approx(
        rows["figa"]["heldout_greedy_mean"] - rows[best]["heldout_greedy_mean"])


class _Rows:
    """A stand-in RunContext that keeps what is logged."""

    resume, fault = False, None

    def __init__(self):
        self.logged = []

    def log(self, step, row):
        self.logged.append((step, dict(row)))


@pytest.mark.parametrize("steps,log_every,eval_every", [(7, 3, 2), (6, 2, 3), (5, 1, 5), (4, 5, 5)])
def test_train_method_logs_the_rows_of_the_hand_written_loop(steps, log_every, eval_every):
    """``train_method`` (``run_steps``) logs, evaluates and returns exactly what the driver's
    former hand-written loop did: a row ``{seed, method, step}`` plus that step's metrics every
    ``log_every`` steps and the evaluation every ``eval_every`` steps (both at the last), logged
    at the global step when it holds either."""
    import jax.numpy as jnp
    import optax

    from jaxflow.train.state import TrainState

    def step(state, ref_params, rows):  # params count the steps; the loss is the batch index
        return (state.replace(params={"w": state.params["w"] + 1.0}),
                {"loss": jnp.float32(rows + ref_params), "tokens": jnp.float32(2 * rows)})

    def evaluate(params):
        return {"heldout_greedy": float(params["w"]) / 10}

    state = TrainState.create(optax.sgd(0.1), {"w": jnp.zeros(())})
    run = _Rows()
    curve, first = train_method(step, state, lambda i: i, ref_params=0.5, evaluate=evaluate,
                                     steps=steps, log_every=log_every, eval_every=eval_every,
                                     run=run, step_offset=100, row_fields={"seed": 3, "method": "m"})
    expected, expected_curve = [], []
    for i in range(steps):  # the loop figa.main ran before run_steps
        done = i + 1
        row = {"seed": 3, "method": "m", "step": done}
        if done % log_every == 0 or done == steps:
            row.update({"loss": float(i + 0.5), "tokens": float(2 * i)})
        if done % eval_every == 0 or done == steps:
            ev = evaluate({"w": float(done)})
            expected_curve.append({"step": done, **ev})
            row.update(ev)
        if len(row) > 3:
            expected.append((100 + done, row))
    assert run.logged == expected
    assert [list(r) for _, r in run.logged] == [list(r) for _, r in expected]  # key order too
    assert curve == expected_curve
    assert first == {"loss": 0.5, "tokens": 0.0}
