"""DLRM / DCN-v2 shapes, and a tiny dlrm_train run on 8 devices that learns the planted signal."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from configs import dlrm_train as cfg_mod
from jaxflow.experiment import standalone_context
from jaxflow.main.dlrm_train import main
from jaxflow.recsys.models import build_model, functional
from tests._cli import persistent_compile_cache


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The runs below build the same programs again (the straight, split and resumed runs; the
    System and the hand-composed step): each is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


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


def test_dlrm_system_is_a_system_and_steps_as_the_embedding_step():
    """``DLRMSystem`` satisfies the protocol (typed frozen state), and two of its steps equal,
    bit for bit, the embedding library's step on ``{"emb", "dense"}`` composed by hand (what
    the driver ran before the system existed); ``evaluate`` is flat floats."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxflow.recsys import DataSource, DLRMSystem, make_embeddings, make_model, make_step_and_predict, place_batch
    from jaxflow.system import check_system, is_system_state
    from jaxflow.train.state import TrainState

    base = cfg_mod.get_config("quick")
    config = dataclasses.replace(
        base, data=dataclasses.replace(base.data, vocab_sizes=(200, 50, 30, 20, 300, 10)),
        model=dataclasses.replace(base.model, embed_dim=8, bottom=(16,), top=(16,)),
        placement=dataclasses.replace(base.placement, replicate_below=25, table_wise_below=100),
        train=dataclasses.replace(base.train, batch_size=64, eval_batches=2))
    system = DLRMSystem()
    assert check_system(system) == []
    mesh = config.mesh.make()
    state = system.init(config, {"mesh": mesh}, jax.random.key(0))
    assert is_system_state(state) and isinstance(state.dense, TrainState)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.dense = None
    data = DataSource(config, config.seed)  # by hand: the pieces the driver built itself
    emb = make_embeddings(config, mesh, data.vocab)
    params, apply = make_model(config, data.num_dense, len(data.vocab))
    dense = TrainState.create(optax.adam(config.train.dense_lr), params,
                              jax.tree.map(lambda _: NamedSharding(mesh, P()), params))
    ref, (step, _) = {"emb": emb.init(config.seed), "dense": dense}, make_step_and_predict(emb, apply)
    for i in range(2):
        state, metrics = system.step(state, state.data.train(i, 64))
        ref, ref_metrics = step(ref, *place_batch(mesh, data.train(i, 64)))
        assert float(metrics["loss"]) == float(ref_metrics["loss"])
    got, want = jax.device_get((state.emb, state.dense.params)), jax.device_get((ref["emb"], ref["dense"].params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    ev = system.evaluate(state)
    assert set(ev) == {"auc", "logloss", "eval_ctr", "oracle_auc", "oracle_logloss"}
    assert all(isinstance(v, float) for v in ev.values())
