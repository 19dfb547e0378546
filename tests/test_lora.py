"""LoRA (jaxflow.models.lora): off by default and exact, adapters init like PEFT, merged params
compute the adapter forward bit for bit, and a train step moves the adapters only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.mesh import make_mesh
from jaxflow.models import lora
from jaxflow.models.transformer import PRESETS, TransformerConfig
from jaxflow.train.lm_state import (
    OptimConfig,
    init_params,
    init_train_state,
    lm_functions,
    make_optimizer,
    make_train_step,
    model_optimizer,
)
from tests._cli import persistent_compile_cache

BASE = dataclasses.replace(PRESETS["tiny"], n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                           d_ff=48, max_seq_len=16)
LORA = dataclasses.replace(BASE, lora=lora.LoraConfig(rank=4, alpha=8.0))


@pytest.fixture(scope="module", autouse=True)
def _programs_compiled_once(tmp_path_factory):
    """The tests build the same programs again (each ``init_params`` and forward is a new
    ``jax.jit`` of the same function): each is compiled once and loaded after."""
    with persistent_compile_cache(tmp_path_factory.mktemp("xla_cache")):
        yield


def _mesh():
    return make_mesh({"data": 1}, jax.devices()[:1])


def _randomise_b(params, seed=1):
    """Non-zero B matrices (a trained adapter), everything else unchanged."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, x) in enumerate(leaves):
        if str(path[-1].key).endswith("_lora_b"):
            x = 0.05 * jax.random.normal(jax.random.key(seed + i), x.shape, x.dtype)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _flat(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_rank_zero_is_the_base_model_and_adapters_leave_the_base_init_alone():
    mesh = _mesh()
    key = jax.random.key(0)
    base = init_params(lm_functions(BASE, mesh), BASE, key)
    with_lora = init_params(lm_functions(LORA, mesh), LORA, key)
    assert not lora.has_adapters(base)
    assert BASE.lora == lora.LoraConfig() and not BASE.lora.enabled
    flat, flat_lora = _flat(base), _flat(with_lora)
    for name, x in flat.items():  # the same base values whatever the adapters
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat_lora[name]))
    extra = {n: x for n, x in flat_lora.items() if n not in flat}
    assert len(extra) == 2 * 7 * BASE.n_layers
    wq_a = flat_lora["['layers'][0]['attn']['wq_lora_a']"]
    wo_a = flat_lora["['layers'][0]['attn']['wo_lora_a']"]
    wo_b = flat_lora["['layers'][0]['attn']['wo_lora_b']"]
    assert wq_a.shape == (32, 4) and wo_a.shape == (4, 8, 4) and wo_b.shape == (4, 32)
    assert float(jnp.max(jnp.abs(wq_a))) <= 32 ** -0.5 and float(jnp.std(wq_a)) > 0.05
    assert all(not np.any(np.asarray(x)) for n, x in extra.items() if n.endswith("_lora_b']"))
    # add_adapters (a warm start gaining adapters) gives exactly the module's init
    added = _flat(lora.add_adapters(base, LORA))
    assert added.keys() == flat_lora.keys()
    for name, x in added.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat_lora[name]))


@pytest.mark.parametrize("scan", [False, True])
def test_zero_b_is_the_base_and_merged_params_give_the_adapter_forward_bit_for_bit(scan):
    mesh = _mesh()
    base_cfg = dataclasses.replace(BASE, scan_layers=scan)
    cfg = dataclasses.replace(LORA, scan_layers=scan)
    fns, base_fns = lm_functions(cfg, mesh), lm_functions(base_cfg, mesh)
    params = init_params(fns, cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, BASE.vocab_size)
    programs = {}

    def fwd(f, p):  # one jitted forward per model functions (params of one layout share it)
        if id(f) not in programs:
            programs[id(f)] = jax.jit(lambda q: f.model(q)(tokens))
        return programs[id(f)](p)

    base_logits = fwd(base_fns, lora.strip(params))
    np.testing.assert_array_equal(np.asarray(fwd(fns, params)), np.asarray(base_logits))
    trained = _randomise_b(params)
    adapter_logits = np.asarray(fwd(fns, trained))
    merged = jax.jit(lambda p: lora.merge(p, cfg.lora))(trained)
    assert _flat(merged).keys() == _flat(lora.strip(params)).keys()
    np.testing.assert_array_equal(np.asarray(fwd(base_fns, merged)), adapter_logits)
    assert np.max(np.abs(adapter_logits - np.asarray(base_logits))) > 1e-3  # the adapters act
    # eager nnx model (no jit) on the same params: the merge is the same arithmetic
    state = fns.nnx_state(trained)
    model = nnx.merge(fns.graphdef, state)
    np.testing.assert_allclose(np.asarray(model(tokens)), adapter_logits, rtol=0, atol=1e-5)


def test_train_step_moves_adapters_only_with_adapter_sized_optimizer_state():
    mesh = _mesh()
    fns = lm_functions(LORA, mesh)
    tx = model_optimizer(make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 20), LORA)
    state, shardings = init_train_state(fns, LORA, tx, jax.random.key(0))
    before = jax.device_get(state.params)
    bsh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    step = make_train_step(fns, tx, shardings, bsh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, BASE.vocab_size, (4, 13)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "loss_mask": np.ones((4, 12), np.float32), "segment_ids": np.ones((4, 12), np.int32),
             "positions": np.broadcast_to(np.arange(12, dtype=np.int32), (4, 12)).copy()}
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses
    after = jax.device_get(state.params)
    for name, x in _flat(lora.strip(before)).items():  # the frozen base: every bit unchanged
        np.testing.assert_array_equal(_flat(lora.strip(after))[name], x, err_msg=name)
    moved = [not np.array_equal(x, _flat(after)[n]) for n, x in _flat(lora.adapters(before)).items()]
    assert all(moved)
    n_adapter = sum(x.size for x in jax.tree.leaves(lora.adapters(before)))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter  # Adam mu and nu, adapters only


def test_bad_lora_config_names_the_value_and_what_is_valid():
    with pytest.raises(ValueError, match=r"lora.rank=-1"):
        lora.LoraConfig(rank=-1)
    with pytest.raises(ValueError, match=r"lora.targets=.*'qq'.*q, k, v, o, gate, up, down"):
        lora.LoraConfig(rank=2, targets=("qq",))
    with pytest.raises(ValueError, match="lora.publish='x'; valid: adapters, merged"):
        lora.LoraConfig(rank=2, publish="x")
    with pytest.raises(ValueError, match="MoE model takes attention adapters only; drop gate, up, down"):
        TransformerConfig(n_experts=4, d_ff_expert=16, lora=lora.LoraConfig(rank=2))
    assert TransformerConfig(n_experts=4, d_ff_expert=16,
                             lora=lora.LoraConfig(rank=2, targets=("q", "v"))).lora.rank == 2
    assert lora.LoraConfig(rank=2, targets="q").targets == ("q",)
