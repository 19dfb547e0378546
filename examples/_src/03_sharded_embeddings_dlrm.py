# ruff: noqa: E402
# title: sharded embeddings and a DLRM step
# %% [markdown]
# # Sharded embedding tables and a DLRM train step
#
# Three embedding tables placed three ways over a 4-device mesh (rows split, one whole table
# per device, replicated), looked up with the All2All route, then trained with a DLRM on
# synthetic Criteo-like clicks: dense params by optax, embedding rows by a sparse optimizer.

# %% [markdown]
# Four fake CPU devices, requested before any other JAX use.

# %%
import jax

jax.config.update("jax_num_cpu_devices", 4)

# %%
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer, make_train_step
from jaxflow.embeddings.reference import reference_lookup
from jaxflow.mesh import make_mesh
from jaxflow.recsys import SyntheticConfig, SyntheticCriteo, build_model, functional
from jaxflow.train.state import TrainState

# %% [markdown]
# The data: a deterministic stream of click batches with 4 dense features and one id per
# table (`batch(step, size)`); ids follow a Zipf law, so most rows are rarely or never seen.

# %%
vocab = {"c0": 2000, "c1": 64, "c2": 8}
data = SyntheticCriteo(SyntheticConfig(vocab_sizes=tuple(vocab.values()), num_dense=4, informative=3), seed=0)
b = data.batch(0, 4)
print({k: v.shape for k, v in b.items() if k != "sparse"}, {k: v.ravel() for k, v in b["sparse"].items()})

# %% [markdown]
# The tables: `TableSpec` names each table's placement; `ShardedEmbeddings` packs them on the
# mesh's "data" axis with a row-wise Adagrad optimizer. `capacity` bounds the distinct ids a
# device may look up per step (here: every id of its batch slice).

# %%
mesh = make_mesh({"data": 4})
specs = [TableSpec("c0", vocab["c0"], 8, placement="row_wise"),
         TableSpec("c1", vocab["c1"], 8, placement="table_wise"),
         TableSpec("c2", vocab["c2"], 8, placement="replicated")]
B = 64
emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer("rowwise_adagrad", 0.05), capacity=B // 4 * 3)
emb_state = emb.init(seed=0)
print({g: (t.shape, t.sharding.spec) for g, t in emb_state["tables"].items()})

# %% [markdown]
# A lookup routes each id to the device that owns its row and back; it equals a plain
# `jnp.take` on the unsharded tables.

# %%
ids = {n: jnp.asarray(v) for n, v in data.batch(1, B)["sparse"].items()}
pooled = emb.lookup(emb_state, ids)  # {table: [B, 8]}
tables0, _ = emb.to_dense(emb_state)  # host copies of every table, for the checks below
want = reference_lookup(specs, tables0, ids)
for name in vocab:
    np.testing.assert_allclose(pooled[name], want[name], rtol=0, atol=1e-7)
print("sharded lookup == jnp.take on the full tables")

# %% [markdown]
# The DLRM (bottom MLP on dense features, dot interactions, top MLP) as a pure
# `(params, dense, sparse) -> logits` function; its params live in a replicated `TrainState`
# with an Adam optimizer. `make_train_step` builds one jitted `shard_map` step that looks up,
# takes gradients, psums the dense ones, sends row gradients to their owners and updates both.

# %%
params, apply = functional(build_model("dlrm", 4, len(vocab), 8, bottom=(16, 8), top=(16,)))
replicated = NamedSharding(mesh, P())
dense = TrainState.create(optax.adam(1e-2), params, jax.tree.map(lambda _: replicated, params))


def loss_fn(params, outputs, batch):
    sparse = jnp.stack([outputs[n] for n in vocab], axis=1)  # [b, tables, 8]
    logits = apply(params, batch["dense"], sparse)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["label"])), {}


def heldout_logloss(state, batches=16):
    """Mean log-loss on held-out clicks (batches of B, the lookup's capacity): the sharded
    lookup, then the dense model."""
    losses = []
    for i in range(batches):
        batch = data.eval_batch(i, B)
        out = emb.lookup(state["emb"], {k: jnp.asarray(v) for k, v in batch["sparse"].items()})
        logits = apply(state["dense"].params, batch["dense"], jnp.stack([out[k] for k in vocab], axis=1))
        losses.append(optax.sigmoid_binary_cross_entropy(logits, batch["label"]))
    return float(jnp.mean(jnp.concatenate(losses)))


step_fn = make_train_step(emb, loss_fn)  # donates its state argument
state = {"emb": emb_state, "dense": dense}
heldout_before = heldout_logloss(state)

# %% [markdown]
# Thirty steps, each on a fresh batch split over the devices. `check_stats` turns the step's
# overflow / bad-id counters into an error (a host sync; every step here).

# %%
split = NamedSharding(mesh, P("data"))
losses, seen = [], {n: set() for n in vocab}
for step in range(30):
    batch = data.batch(100 + step, B)
    for n in vocab:
        seen[n].update(batch["sparse"][n].ravel().tolist())
    state, metrics = step_fn(state, jax.device_put(batch["sparse"], split),
                             jax.device_put({"dense": batch["dense"], "label": batch["label"]}, split))
    check_stats(metrics, emb.capacity)
    losses.append(float(metrics["loss"]))
print("loss per step:", np.round(losses, 3))

# %% [markdown]
# Checks: the held-out log-loss fell, the sparse optimizer changed only rows that some batch
# looked up, and every looked-up row of the big table moved.

# %%
heldout_after = heldout_logloss(state)
print(f"held-out log-loss {heldout_before:.4f} -> {heldout_after:.4f}")
assert heldout_after < heldout_before - 0.01
tables1, _ = emb.to_dense(state["emb"])
for name, rows in vocab.items():
    untouched = np.setdiff1d(np.arange(rows), sorted(seen[name]))
    np.testing.assert_array_equal(tables1[name][untouched], tables0[name][untouched])
touched = sorted(seen["c0"])
assert np.all(np.any(tables1["c0"][touched] != tables0["c0"][touched], axis=1))
print(f"c0: {len(touched)} of {vocab['c0']} rows trained, the rest unchanged")
