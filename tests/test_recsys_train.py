"""DLRM / DCN-v2 shapes, and a tiny dlrm_train run on 8 devices that learns the planted signal."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from configs import dlrm_train as cfg_mod
from jaxflow.experiment import standalone_context
from jaxflow.recsys.models import build_model, functional
from jaxflow.main.dlrm_train import main


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
