"""Meshes, role sub-meshes, logical-axis rules and the sharded-params check (8 fake devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.mesh import (
    DEFAULT_RULES,
    MeshConfig,
    MeshError,
    assert_params_sufficiently_sharded,
    check_rules,
    logical_to_spec,
    make_mesh,
    role_meshes,
    shardings_from_logical,
)


def test_make_mesh_fills_minus_one():
    mesh = make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    with pytest.raises(MeshError, match="not divisible by 3"):
        make_mesh({"data": -1, "model": 3})
    with pytest.raises(MeshError, match="needs 4 devices but 8"):
        make_mesh({"data": 2, "model": 2})


def test_role_meshes_are_disjoint_and_cover_requested_counts():
    meshes = role_meshes({"trainer": 6, "rollout": 2}, axes={"trainer": {"data": 3, "model": 2}})
    trainer = set(meshes["trainer"].devices.flat)
    rollout = set(meshes["rollout"].devices.flat)
    assert len(trainer) == 6 and len(rollout) == 2 and not trainer & rollout
    assert dict(meshes["trainer"].shape) == {"data": 3, "model": 2}
    with pytest.raises(MeshError, match="need 10 devices"):
        role_meshes({"trainer": 8, "rollout": 2})


def test_conflicting_rules_raise():
    with pytest.raises(MeshError, match="conflicting sharding rules for logical axis 'mlp'"):
        check_rules((("mlp", "model"), ("mlp", "data")))
    # the same mesh axis for two dimensions of one array is a conflict too
    with pytest.raises(MeshError, match="would shard both"):
        logical_to_spec(("mlp", "vocab"), DEFAULT_RULES)


def test_logical_rules_to_named_shardings():
    mesh = MeshConfig(shape=(4, 2)).make()
    tree = {"w": jax.ShapeDtypeStruct((16, 64), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    logical = {"w": ("embed", "mlp"), "b": ("mlp",)}
    sh = shardings_from_logical(tree, logical, mesh)
    assert sh["w"].spec == PartitionSpec(None, "model")
    assert sh["b"].spec == PartitionSpec(None)  # 3 is not divisible by 2: replicated


def test_assert_params_sufficiently_sharded():
    mesh = MeshConfig(shape=(4, 2)).make()
    big = np.zeros((256, 512), np.float32)
    sharded = jax.device_put(big, NamedSharding(mesh, PartitionSpec(None, "model")))
    replicated = jax.device_put(big, NamedSharding(mesh, PartitionSpec()))
    assert_params_sufficiently_sharded({"w": sharded}, mesh)
    with pytest.raises(AssertionError, match=r"\['w'\] \(256, 512\)"):
        assert_params_sufficiently_sharded({"w": replicated}, mesh)


def test_lm_params_are_sharded_by_logical_rules():
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.train.lm_state import init_params, lm_functions

    cfg = TransformerConfig(vocab_size=32, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=256)
    mesh = MeshConfig(shape=(4, 2)).make()
    fns = lm_functions(cfg, mesh)
    params = init_params(fns, cfg, jax.random.key(0))
    assert_params_sufficiently_sharded(params, mesh, min_size=64 * 256)
    w_up = params["layers"][0]["mlp"]["w_up"]
    assert w_up.sharding.spec == PartitionSpec(None, "model")
    assert len(w_up.addressable_shards[0].data.shape) == 2 and w_up.addressable_shards[0].data.shape[1] == 128


def test_jit_on_traces_under_its_mesh_called_alone_or_from_another_jit():
    """``jit_on(mesh, f)``: kernel dispatch inside ``f`` sees ``mesh`` (called at top level, or
    from inside another jitted function, where ``jax.set_mesh`` is refused), and a one-device
    role mesh counts as a single device whatever the host has."""
    import jax.numpy as jnp

    from jaxflow.mesh import MeshJit, jit_on, make_mesh
    from pallas_kernels import dispatch

    seen = []

    def f(x):
        context, mesh = dispatch.partition_context()
        seen.append((context, None if mesh is None else dict(mesh.shape)))
        return x * 2

    eight = make_mesh({"data": 4, "model": 2})
    step = jit_on(eight, f)
    assert isinstance(step, MeshJit)
    x = jnp.arange(8.0)
    assert float(step(x).sum()) == 56.0
    assert seen[-1] == ("mesh", {"data": 4, "model": 2})
    jax.jit(lambda x: jit_on(eight, lambda y: f(y) + 1)(x))(x)
    assert seen[-1] == ("mesh", {"data": 4, "model": 2})
    one = make_mesh({"data": 1}, jax.devices()[:1])
    jit_on(one, f)(x)
    assert seen[-1] == ("single", None)
    jax.jit(f)(x)  # no context on 8 devices
    assert seen[-1] == ("auto", None)
    assert "tpu" not in step.lower(jnp.arange(16.0)).as_text()  # lower enters the mesh too
    assert seen[-1][0] == "mesh"
