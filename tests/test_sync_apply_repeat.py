"""Regression: apply() must not mutate the device set shared by arrays of one sharding."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow import sync


def test_repeated_apply_on_jax_arrays_keeps_device_set():
    rng = np.random.default_rng(0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    base = {"w": jax.device_put(jnp.asarray(rng.standard_normal((64,)), jnp.bfloat16), replicated)}
    params, version = base, 0
    device_set = set(base["w"].sharding.device_set)
    for v in range(1, 5):
        new = {"w": params["w"] + jnp.bfloat16(0.5) * (jnp.arange(64) % v == 0)}
        payload = sync.encode(params, new, base_version=version, version=v)
        params = sync.apply(sync.Payload.from_bytes(payload.to_bytes()), params, version=version)
        version = v
        assert np.array_equal(np.asarray(params["w"]).view(np.uint16), np.asarray(new["w"]).view(np.uint16))
    assert set(base["w"].sharding.device_set) == device_set == set(jax.devices()[:2])
