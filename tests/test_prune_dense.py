"""The dense capability model's training (``prune.dense.train_dense``, on ``run_steps``) ==
the step-by-step loop it replaced: the same params bit for bit and the same logged rows."""

import jax
import numpy as np

from configs.calibration_tradeoffs import TrainConfig
from jaxflow.distributed import global_batch
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.prune.capabilities import make_tokenizer, make_world, mixture_batch
from jaxflow.prune.dense import MIXTURE, train_dense
from jaxflow.train.lm_state import OptimConfig, init_train_state, lm_functions, make_optimizer, make_train_step

MODEL = TransformerConfig(vocab_size=60, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                          max_seq_len=32)
TRAIN = TrainConfig(steps=5, batch_size=8, seq_len=32, log_every=2)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2)


def test_train_dense_equals_the_step_loop():
    mesh = MeshConfig().make()
    fns = lm_functions(MODEL, mesh)
    world = make_world(0, math_digits=1)
    rows = []
    params = train_dense(fns, MODEL, OPTIM, TRAIN, world, seed=3,
                         log=lambda step, row: rows.append((step, row)))
    # the reference: every step by hand, a row of means every log_every steps and at the last
    tx = make_optimizer(OPTIM, TRAIN.steps)
    state, shardings = init_train_state(fns, MODEL, tx, jax.random.key(3))
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    step_fn = make_train_step(fns, tx, shardings, batch_sharding)
    tokenizer, window, want = make_tokenizer(), [], []
    for step in range(TRAIN.steps):
        host = mixture_batch(world, tokenizer, seed=3, step=step, rows=TRAIN.batch_size,
                             seq_len=TRAIN.seq_len, weights=MIXTURE)
        state, metrics = step_fn(state, global_batch(host, batch_sharding))
        window.append(jax.device_get(metrics))
        if (step + 1) % TRAIN.log_every == 0 or step + 1 == TRAIN.steps:
            want.append((step + 1, {k: float(np.mean([m[k] for m in window]))
                                    for k in ("loss", "token_accuracy")}))
            window = []
    assert [s for s, _ in rows] == [2, 4, 5]
    assert rows == want
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
