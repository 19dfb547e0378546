"""``OxygenRECSystem``: a ``jaxflow.system.System`` whose SFT stage is ``genrec.train.fit`` bit
for bit, whose steps are pure (the same state and batches give the same result), and whose RL
stage (SA-GCPO) runs and evaluates to flat floats. A tiny catalogue, a few steps."""

import dataclasses

import jax
import numpy as np
import pytest

from configs import oxygenrec as cfg_mod
from jaxflow.genrec import ARMS, OxygenRECSystem, build_setup, model_config, train_stage
from jaxflow.genrec import train as train_lib
from jaxflow.genrec.data.synthetic import SyntheticGenRecConfig
from jaxflow.genrec.rl import RLConfig
from jaxflow.system import check_system, is_system_state
from tests._cli import persistent_compile_cache


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The module's tests build the same programs several times (``fit`` and the SFT stage,
    each test's own ``init``): each is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


@pytest.fixture(scope="module")
def setup():
    base = cfg_mod.get_config("quick")
    config = dataclasses.replace(
        base, seed=0,
        data=dataclasses.replace(base.data, synthetic=SyntheticGenRecConfig(
            n_genres=3, n_sub=2, items_per_cell=6, n_users=60, min_history=4, max_history=8,
            test_users=16)),
        model=dataclasses.replace(base.model, levels=2, width=8, kmeans_iters=5, d_model=16,
                                  n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1),
        sft=dataclasses.replace(base.sft, steps=3, batch_size=16),
        rl=RLConfig(steps=2, batch_size=8, group_size=2, updates_per_batch=1), beam_size=10)
    mesh = train_lib.data_mesh()
    return config, mesh, build_setup(config, 0, mesh)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_sft_stage_is_fit_and_steps_are_pure(setup):
    config, mesh, shared = setup
    system = OxygenRECSystem(ARMS["tiger_instruction"])
    assert check_system(system) == []
    state = system.init(config, {"mesh": mesh}, jax.random.key(0), setup=shared)
    assert is_system_state(state) and state.stage == "sft"
    trained, rows = train_stage(system, state, steps=3)
    assert [set(r) for r in rows] == [{"loss", "generation_loss"}] * 3  # no Q2I in this arm
    again, _ = train_stage(system, state, steps=3)  # ``state`` was not touched by the first run
    for a, b in zip(_leaves(trained.train.params), _leaves(again.train.params)):
        np.testing.assert_array_equal(a, b)
    mc = model_config(config, shared.data, levels=shared.sid.levels, instructions=True, igr=False)
    sft = dataclasses.replace(config.sft, use_instruction=True, q2i_weight=0.0)
    _, params, hist = train_lib.fit(shared.data, shared.sid.codes, mc, sft, seed=0, mesh=mesh)
    assert hist == [r["loss"] for r in rows]
    for a, b in zip(_leaves(trained.train.params), _leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_rl_stage_runs_from_the_sft_params_and_evaluates(setup):
    config, mesh, shared = setup
    system = OxygenRECSystem()
    state, _ = train_stage(system, system.init(config, {"mesh": mesh}, jax.random.key(0),
                                               setup=shared), steps=2)
    rl = system.start_rl(state)
    assert rl.stage == "rl" and int(rl.train.step) == 0
    for a, b in zip(_leaves(rl.train.params), _leaves(state.train.params)):
        np.testing.assert_array_equal(a, b)
    after, rows = train_stage(system, rl, steps=2)
    assert [set(r) for r in rows] == [{"reward", "loss"}] * 2
    assert all(0 <= r["reward"] <= 1 and np.isfinite(r["loss"]) for r in rows)
    assert int(after.train.step) == 2 * config.rl.updates_per_batch
    assert not np.array_equal(np.asarray(jax.random.key_data(after.key)),
                              np.asarray(jax.random.key_data(rl.key)))  # the stream moved on
    ev = system.evaluate(after)
    assert {"recall", "ndcg", "reward"} <= set(ev) and all(isinstance(v, float) for v in ev.values())
    assert {f"{s}/recall" for s in shared.data.scenarios} <= set(ev)


def test_programs_take_the_runs_arrays_and_lower(setup):
    """``programs``: ``sft/step`` gets the layout of the state ``init`` makes and of the batches
    ``sft_batches`` draws (tree, shapes, dtypes, shardings); both programs lower as they are."""
    from jaxflow.genrec import sft_batches

    config, mesh, shared = setup
    system = OxygenRECSystem()
    programs = {p.name: p for p in system.programs(config, {"mesh": mesh})}
    assert list(programs) == ["sft/step", "rl/update"]
    state = system.init(config, {"mesh": mesh}, jax.random.key(0), setup=shared)

    def like(tree):
        return [(jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), x.sharding.spec)
                for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert like(programs["sft/step"].args) == like((state.train, sft_batches(state)(0)))
    for p in programs.values():
        with jax.set_mesh(p.mesh):
            p.fn.lower(*p.args)
