"""DLRM / DCN-v2 shapes, and a tiny dlrm_train run on 8 devices that learns the planted signal."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from configs import dlrm_train as cfg_mod
from jaxflow.experiment import standalone_context
from jaxflow.main.dlrm_train import main
from jaxflow.recsys.models import build_model, functional


@pytest.mark.parametrize("arch", ["dlrm", "dcn_v2"])
def test_model_shapes(arch):
    params, apply = functional(build_model(arch, 13, 5, 8, bottom=(16,), top=(16,), deep=(16,)))
    out = apply(params, jnp.ones((3, 13)), jnp.ones((3, 5, 8)))
    assert out.shape == (3,) and np.isfinite(np.asarray(out)).all()


def test_dlrm_train_tiny_learns():
    base = cfg_mod.get_config("quick")
    config = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, vocab_sizes=(200, 50, 30, 20, 300, 10), zipf_a=1.2),
        model=dataclasses.replace(base.model, embed_dim=8, bottom=(16,), top=(16,)),
        placement=dataclasses.replace(base.placement, replicate_below=25, table_wise_below=100),
        train=dataclasses.replace(base.train, steps=60, batch_size=256, log_every=30,
                                  checkpoint_every=1000, eval_batches=4, dense_lr=3e-3, sparse_lr=0.1))
    with pytest.raises(ValueError, match="data.source='parquet'"):
        dataclasses.replace(base.data, source="parquet")
    run = standalone_context("dlrm_train")
    out = main(config, run)
    assert set(out["placements"].values()) == {"row_wise", "table_wise", "replicated"}
    assert np.isfinite(out["logloss"])
    # the planted signal is learnable: well above chance, below the oracle
    assert 0.6 < out["auc"] <= out["oracle_auc"] + 0.02, out


def test_dlrm_train_resumed_rows_equal_a_straight_run(tmp_path):
    """``run_steps`` owns the loop: 3 steps, then ``--resume`` to 7 (restoring the embedding
    tables and the dense ``TrainState`` from the step-3 checkpoint) logs the same training
    rows, bit for bit, as 7 steps straight (train_loss / max_unique_per_device every 3 steps
    and at the last), and the same evaluation."""
    import json

    from jaxflow.experiment import RunContext

    base = cfg_mod.get_config("quick")

    def config(steps):
        return dataclasses.replace(
            base,
            data=dataclasses.replace(base.data, vocab_sizes=(200, 50, 30, 20, 300, 10), zipf_a=1.2),
            model=dataclasses.replace(base.model, embed_dim=8, bottom=(16,), top=(16,)),
            placement=dataclasses.replace(base.placement, replicate_below=25, table_wise_below=100),
            train=dataclasses.replace(base.train, steps=steps, batch_size=64, log_every=3,
                                      checkpoint_every=3, eval_batches=2))

    def train_rows(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "train_loss" in r]

    straight, split = tmp_path / "straight", tmp_path / "split"
    out = main(config(7), RunContext("dlrm_train", "quick", straight))
    main(config(3), RunContext("dlrm_train", "quick", split))
    resumed = main(config(7), RunContext("dlrm_train", "quick", split, resume=True))
    assert [r["step"] for r in train_rows(straight)] == [3, 6, 7]
    assert set(train_rows(straight)[0]) == {"step", "train_loss", "max_unique_per_device"}
    assert train_rows(split) == train_rows(straight)
    assert resumed["auc"] == out["auc"] and resumed["logloss"] == out["logloss"]
