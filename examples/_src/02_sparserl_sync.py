# ruff: noqa: E402
# title: SparseRL-Sync between a trainer tree and a bf16 replica
# %% [markdown]
# # SparseRL-Sync: a trainer tree and its bf16 replicas
#
# The trainer keeps float32 params on its own device; rollout replicas on another device hold
# bf16 copies. After each optimizer step the sender encodes only the bf16 elements that changed,
# and every replica applies the payload and ends bit-identical to the trainer's bf16 cast.

# %% [markdown]
# Fake CPU devices must be requested before JAX does anything else (first cell of a notebook;
# a kernel that already used JAX needs a restart).

# %%
import jax

jax.config.update("jax_num_cpu_devices", 2)

# %%
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.mesh import role_meshes
from jaxflow.models import Transformer, TransformerConfig, token_logprobs
from jaxflow.sync.transport import InProcessLink

# %% [markdown]
# Two disjoint sub-meshes of the two devices: the trainer's and the rollout's. The trainer's
# params are the `nnx.State` that `nnx.split` returns (a value: training replaces it).

# %%
roles = role_meshes({"trainer": 1, "rollout": 1})
print({name: mesh.devices.tolist() for name, mesh in roles.items()})
cfg = TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                        max_seq_len=16)
model = Transformer(cfg, rngs=nnx.Rngs(0))
graphdef, state = nnx.split(model)
params = jax.device_put(state, NamedSharding(roles["trainer"], P()))

# %% [markdown]
# The sender starts from the trainer's bf16 cast at version 0; so do two replicas placed on
# the rollout mesh. Links carry payload bytes to a replica (in-process here; TCP and
# tensorstore links have the same interface).

# %%
sender = sync.SyncSender(params, version=0, codec="auto")
on_rollout = jax.tree.map(lambda _: NamedSharding(roles["rollout"], P()), params)
replicas = [sync.Replica(sync.to_bf16(params), version=0, shardings=on_rollout) for _ in range(2)]
links = [InProcessLink(r) for r in replicas]
print(sync.tree_digest(replicas[0].params) == sender.digest())

# %% [markdown]
# A few next-token training steps (optax AdamW, small learning rate, as in RL fine-tuning).
# After each, `publish` encodes the bf16 delta; replica 0 syncs every step, replica 1 only at
# the end, so it catches up through the chain of step payloads.

# %%
tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, cfg.vocab_size)
tx = optax.adamw(1e-4)
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state):
    def loss_fn(p):
        return -jnp.mean(token_logprobs(nnx.merge(graphdef, p), tokens)[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


for version in range(1, 4):
    params, opt_state, loss = train_step(params, opt_state)
    stats = sender.publish(params, version=version)
    report = sender.sync_all(links[:1])
    print(f"v{stats.version} loss {float(loss):.4f}: {stats.changed}/{stats.elements} bf16 elements "
          f"changed, payload {stats.payload_bytes} B vs dense {stats.dense_bytes} B ({stats.codec}), "
          f"route {report[0]['route']}")

# %% [markdown]
# The late replica catches up (the sender plans the cheapest route from its version), and
# `sync_all` itself checks every replica's digest against the sender's.

# %%
report = sender.sync_all(links)
print(report)
assert all(r["ok"] for r in report), report

# %% [markdown]
# Check: both replicas are at version 3 and bit-identical to the trainer's current params cast
# to bf16 (digest and every leaf), and the deltas were smaller than a dense bf16 copy.

# %%
want = sync.to_bf16(params)
for r in replicas:
    assert r.version == 3 and r.digest() == sync.tree_digest(want)
    for a, b in zip(jax.tree.leaves(r.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
assert stats.payload_bytes < stats.dense_bytes
print("replicas == bf16(trainer params):", sync.tree_digest(want))
