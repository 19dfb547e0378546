"""jaxflow.train.state.TrainState and jaxflow.train.loop.run_steps on a tiny least-squares model:
the optimizer step equals optax by hand, shardings are derived once and applied, checkpoints
round-trip, and the loop's resume, rows, evaluation, hooks, signal stop and fault behave."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import signals
from jaxflow.checkpoint import Checkpointer
from jaxflow.experiment import RunContext
from jaxflow.plots import read_metrics
from jaxflow.sync import tree_digest
from jaxflow.train.loop import Fault, run_steps
from jaxflow.train.state import TrainState, opt_state_shardings

X = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
Y = X @ np.arange(1, 5, dtype=np.float32)


def _params():
    return {"w": jnp.zeros((4,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def _step(state, x, y):
    loss, grads = jax.value_and_grad(_loss)(state.params, x, y)
    return state.apply_gradients(grads), {"loss": loss}


def _step_fn(state, step):
    i = (step * 4) % 16
    return _step(state, X[i:i + 4], Y[i:i + 4])


def test_apply_gradients_is_optax_by_hand():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.1))
    state = TrainState.create(tx, _params())
    params, opt = _params(), tx.init(_params())

    @jax.jit
    def by_hand(params, opt, x, y):  # the same program, written out
        grads = jax.grad(_loss)(params, x, y)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    for step in range(3):
        state, _ = _step_fn(state, step)
        i = (step * 4) % 16
        params, opt = by_hand(params, opt, X[i:i + 4], Y[i:i + 4])
    assert int(state.step) == 3
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_create_places_moments_like_params():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}
    shardings = {"w": NamedSharding(mesh, P("data")), "b": NamedSharding(mesh, P())}
    tx = optax.adam(1e-3)
    state = TrainState.create(tx, params, shardings)
    mu = state.opt_state[0].mu
    assert mu["w"].sharding.spec == P("data") and mu["b"].sharding.spec == P()
    assert state.opt_state[0].count.sharding.spec == P() and state.step.sharding.spec == P()
    assert opt_state_shardings(tx, params, shardings)[0].mu["w"] == shardings["w"]
    abstract = TrainState.abstract(tx, params, shardings)
    assert abstract.params["w"].sharding == shardings["w"] and abstract.opt_state[0].mu["w"].shape == (8, 4)
    sh = TrainState.shardings(tx, params, shardings)
    assert jax.tree.structure(sh) == jax.tree.structure(state)


def test_checkpoint_round_trip_and_a_treedef_without_addresses(tmp_path):
    state = TrainState.create(optax.adam(0.1), _params(), extra={"seen": jnp.int32(7)})
    state, _ = _step_fn(state, 0)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, state, force=True)
    from jaxflow.checkpoint import abstract_like

    back = ckpt.restore(1, abstract_like(state))
    ckpt.close()
    assert isinstance(back, TrainState) and back.tx is state.tx
    assert tree_digest(back) == tree_digest(state)
    assert "0x" not in str(jax.tree.structure(state))  # the same text in every process


def _run(tmp_path, **kw):
    return RunContext(name="t", variant="quick", out_dir=tmp_path, **kw)


def test_rows_eval_and_hooks(tmp_path):
    run = _run(tmp_path)
    seen = []
    result = run_steps(_step_fn, TrainState.create(optax.sgd(0.05), _params()), steps=7, run=run,
                       log_every=3, eval_fn=lambda s, done: {"eval": float(_loss(s.params, X, Y))},
                       eval_every=6, hooks=[lambda done, s, row: seen.append(done)],
                       row_fields={"cell": "a"})
    run.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [3, 6, 7] == seen
    assert [("eval" in r) for r in rows] == [False, True, True]
    assert all(r["cell"] == "a" for r in rows)
    assert int(result.state.step) == 7 and result.start == 0 and result.rows[-1]["cell"] == "a"


def test_resume_continues_bit_identically(tmp_path):
    full = run_steps(_step_fn, TrainState.create(optax.adam(0.1), _params()), steps=6)
    run = _run(tmp_path / "a")
    ckpt = Checkpointer(run.checkpoint_dir, save_every=3, async_save=False)
    run_steps(_step_fn, TrainState.create(optax.adam(0.1), _params()), steps=4, run=run,
              checkpointer=ckpt)
    run.close()
    resumed = _run(tmp_path / "a", resume=True)
    ckpt = Checkpointer(resumed.checkpoint_dir, save_every=3, async_save=False)
    out = run_steps(_step_fn, TrainState.create(optax.adam(0.1), _params()), steps=6, run=resumed,
                    checkpointer=ckpt)
    resumed.close()
    assert out.start == 4  # the forced final save of the first run, step 4
    assert tree_digest(out.state.params) == tree_digest(full.state.params)
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_stop_signal_checkpoints_the_step_and_stops(tmp_path):
    run = _run(tmp_path)
    ckpt = Checkpointer(run.checkpoint_dir, save_every=100, async_save=False)
    restore = signals.install()

    def step_fn(state, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during step 3: it finishes first
        return _step_fn(state, step)

    try:
        with pytest.raises(signals.RunStopped) as stop:
            run_steps(step_fn, TrainState.create(optax.sgd(0.1), _params()), steps=10, run=run,
                      checkpointer=ckpt)
    finally:
        restore()
        run.close()
    assert stop.value.step == 3
    assert Checkpointer(run.checkpoint_dir).latest_step() == 3


def test_fault_is_validated():
    with pytest.raises(ValueError, match="kill_after_checkpoint=0"):
        Fault(0)
    assert dataclasses.replace(Fault(), kill_after_checkpoint=3).kill_after_checkpoint == 3


def test_fault_kills_after_the_named_checkpoint(tmp_path):
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.getcwd()!r})
        import optax
        from tests.test_train_state_loop import _params, _run, _step_fn
        from jaxflow.checkpoint import Checkpointer
        from jaxflow.train.loop import Fault, run_steps
        from jaxflow.train.state import TrainState
        import pathlib
        run = _run(pathlib.Path({str(tmp_path)!r}), fault=Fault(kill_after_checkpoint=2))
        run_steps(_step_fn, TrainState.create(optax.sgd(0.1), _params()), steps=6, run=run,
                  checkpointer=Checkpointer(run.checkpoint_dir, save_every=2))
        print("not killed")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert "not killed" not in res.stdout
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 2


def test_warm_start_cache_entries_are_per_mesh():
    """The same pretraining config on 1 and on 2 devices trains different params (the gradient
    sums run in another order), so each mesh gets its own cache entry."""
    from configs.flagship import WARM_START
    from jaxflow.rl.warm_start import cache_dir

    one, two = (cache_dir(WARM_START, "cache", devices=n) for n in (1, 2))
    assert one != two and one.name.startswith("lm_pretrain-v2-")
    assert cache_dir(WARM_START, "cache", devices=2) == two
