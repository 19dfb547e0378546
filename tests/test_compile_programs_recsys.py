"""compile_programs of dlrm_train, bench_embedding and nestpipe (on 8 fake CPU devices): the
abstract arguments are the shapes, dtypes and shardings the run's own arrays have; the
production tables and the full variants hold together. The compile for real chips is
``tests/aot/test_compile_programs_recsys.py``."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from configs.dlrm_train import PRODUCTION_VOCABS
from jaxflow.config import apply_overrides, experiments
from jaxflow.embeddings import ShardedEmbeddings, TableSpec, make_sparse_optimizer
from jaxflow.embeddings.spec import plan_tables
from jaxflow.embeddings.step import abstract_state
from jaxflow.mesh import make_mesh
from jaxflow.run_meshes import resolve_meshes


def _like(tree):
    """(path, shape, dtype, sharding spec) of every leaf (static pytree data such as a
    TrainState's ``tx`` left out)."""
    return [(jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), x.sharding.spec)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _programs(name, overrides):
    import importlib

    spec = experiments()[name]
    config = apply_overrides(spec.get_config("quick"), overrides)
    driver = importlib.import_module(spec.entry.partition(":")[0])
    return config, driver, driver.compile_programs(config, resolve_meshes(spec, config))


def test_production_tables():
    assert len(PRODUCTION_VOCABS) == 26
    assert min(PRODUCTION_VOCABS) == 10_000_000 and max(PRODUCTION_VOCABS) == 100_000_000
    assert all(v % 64 == 0 for v in PRODUCTION_VOCABS)  # the baselines row-shard on 8 / 64
    for shards in (8, 64):  # one packed group whose keys fit int32 (plan_tables raises if not)
        specs = [TableSpec(f"c{i}", v, 128) for i, v in enumerate(PRODUCTION_VOCABS)]
        assert len(plan_tables(specs, shards).groups) == 1
    for name in ("dlrm_train", "bench_embedding", "nestpipe"):
        config = experiments()[name].get_config("full")
        rows = (config.data.vocab_sizes if name == "dlrm_train" else config.table_rows()
                if name == "bench_embedding" else config.vocab_sizes)
        assert tuple(rows) == PRODUCTION_VOCABS, name


def test_abstract_state_is_what_init_places():
    mesh = make_mesh({"data": 8})
    specs = [TableSpec("rw", 50, 8, "row_wise"), TableSpec("tw", 20, 8, "table_wise"),
             TableSpec("rep", 30, 4, "replicated")]
    for opt in ("rowwise_adagrad", "adam", "sgd"):
        emb = ShardedEmbeddings(specs, mesh, make_sparse_optimizer(opt, 0.1), capacity=16)
        assert _like(abstract_state(emb)["emb"]) == _like(emb.init(0)), opt
        assert abstract_state(emb)["dense"] == {}


def test_bench_embedding_vocab_sizes_must_match_the_tables():
    config = experiments()["bench_embedding"].get_config("quick")
    assert config.table_rows() == (config.vocab_size,) * config.num_tables
    with pytest.raises(ValueError, match=r"vocab_sizes has 2 entries but num_tables=8"):
        dataclasses.replace(config, vocab_sizes=(10, 20))
    with pytest.raises(ValueError, match=r"pooling_backend='fast'; valid: xla, auto"):
        dataclasses.replace(config, pooling_backend="fast")
    full = experiments()["bench_embedding"].get_config("full")
    assert not full.sparse_one_device  # 528 GB of tables on one device


def test_dlrm_programs_take_the_runs_arrays():
    """train/step and eval/predict get the arrays of the state ``DLRMSystem.init`` makes and the
    batches ``place_batch`` places: same tree, shapes, dtypes, shardings."""
    from jaxflow.recsys import DLRMSystem, place_batch

    overrides = ["data.vocab_sizes=583,12517,100000", "model.embed_dim=8", "model.bottom=16",
                 "model.top=16", "train.batch_size=64"]
    config, _, programs = _programs("dlrm_train", overrides)
    assert [p.name for p in programs] == ["train/step", "eval/predict"]
    mesh = config.mesh.make()
    state = DLRMSystem().init(config, {"mesh": mesh}, jax.random.key(config.seed))
    ids, rest = place_batch(mesh, state.data.train(0, config.train.batch_size))
    step, predict = programs
    assert _like(step.args) == _like(({"emb": state.emb, "dense": state.dense}, ids, rest))
    assert _like(predict.args) == _like((state.emb["tables"], state.dense.params, ids, rest))
    assert step.kind == "train" and predict.kind == "forward" and step.tokens == 64
    assert step.model_flops == 3 * predict.model_flops > 0
    assert "row-wise" in step.note and "table-wise" in step.note and "replicated" in step.note


def test_dlrm_model_flops_by_hand():
    from jaxflow.recsys import dense_model_flops, make_model

    config = experiments()["dlrm_train"].get_config("quick")
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, embed_dim=4, bottom=(8,), top=(6,)))
    params, _ = make_model(config, 3, 2, abstract=True)
    # bottom 3->8->4, top (4 + 3*2/2 = 7)->6->1: weights and biases
    n = (3 * 8 + 8) + (8 * 4 + 4) + (7 * 6 + 6) + (6 * 1 + 1)
    forward = 2 * n * 10 + 2 * 10 * 3 ** 2 * 4
    assert dense_model_flops("dlrm", params, 10, 2, 4, train=False) == forward
    assert dense_model_flops("dlrm", params, 10, 2, 4) == 3 * forward


def test_bench_embedding_programs_take_the_runs_arrays():
    from jaxflow.embeddings.bench import make_steps

    overrides = ["num_tables=2", "vocab_size=800", "dim=8", "batch_size=64", "kernel_vocab=64",
                 "kernel_bags=16"]
    config, _, programs = _programs("bench_embedding", overrides)
    assert [p.name for p in programs] == ["jaxflow/step", "dense_take/step", "sparse_take/step",
                                          "sparse_take_one_device/step", "kernel/pallas",
                                          "kernel/reference"]
    st = make_steps(config, config.mesh.make())
    by_name = {p.name: p for p in programs}
    assert _like(by_name["jaxflow/step"].args[0]["emb"]) == _like(st.emb.init(0))
    one = by_name["sparse_take_one_device/step"]
    assert one.mesh.devices.size == 1 and one.fn is by_name["sparse_take/step"].fn
    # the programs lower on this CPU mesh as they are
    for p in programs:
        with jax.set_mesh(p.mesh):
            p.fn.lower(*p.args)


def test_nestpipe_programs_take_the_runs_arrays():
    """Every stage program's abstract arguments equal the arrays one real sync / dbp+fwp /
    sync_accum step hands it (routing, owner buffers, unique rows, batch)."""
    from jaxflow.nestpipe import NestPipeSystem
    from jaxflow.nestpipe.host_io import HostShards
    from jaxflow.nestpipe.model import resolve_meshes
    from jaxflow.nestpipe.stages import load_batch, to_device

    overrides = ["vocab_sizes=60,40,25", "multi_hot=3", "embed_dim=8", "bottom=16", "top=16",
                 "batch_size=64", "micro_batches=2", "pipelines=sync,dbp+fwp,sync_accum"]
    config, _, programs = _programs("nestpipe", overrides)
    by_name = {p.name: p for p in programs}
    assert list(by_name) == ["N1-per_micro_batch/route", "N1-per_micro_batch/exchange",
                             "N1-per_micro_batch/compute", "N2-per_micro_batch/route",
                             "N2-per_micro_batch/frozen", "N2-per_micro_batch/patch",
                             "N2-window/route", "N2-window/exchange", "N2-window/compute"]
    state = NestPipeSystem().init(config, resolve_meshes(config))
    gen, tables, dense, parts_for = state.runtime.gen, state.tables, state.dense, state.runtime.parts
    for pipeline, prefix in (("sync", "N1-per_micro_batch"), ("dbp+fwp", "N2-per_micro_batch"),
                             ("sync_accum", "N2-window")):
        st = parts_for(pipeline, tables).stages
        dev = to_device(load_batch(gen, 0, config.batch_size), st.shard)
        routed = st.route(dev.ids)
        shards = HostShards(st, tables)
        try:
            buf = shards.retrieve(routed)
        finally:
            shards.close()
        assert _like(by_name[f"{prefix}/route"].args) == _like((dev.ids,))
        if st.separate_exchange:
            args = (buf.rows, routed.owner_inverse, routed.routing)
            assert _like(by_name[f"{prefix}/exchange"].args) == _like(args)
            unique = st.exchange(buf, routed)
            real = (dense, buf.rows, buf.opt, routed.owner_inverse, routed.routing, unique,
                    dev.ids, dev.dense, dev.label)
            assert _like(by_name[f"{prefix}/compute"].args) == _like(real)
        else:
            real = (dense, buf.rows, buf.opt, routed.owner_inverse, routed.routing, dev.ids,
                    dev.dense, dev.label)
            assert _like(by_name[f"{prefix}/frozen"].args) == _like(real)
            slots = st.shard(np.zeros((st.num_shards, st.owner_capacity), np.int32))
            patch = (buf.rows, buf.opt, buf.rows, buf.opt, slots, slots)
            assert _like(by_name[f"{prefix}/patch"].args) == _like(patch)
    trains = [p for p in programs if p.kind == "train"]
    assert [p.name.split("/")[1] for p in trains] == ["compute", "frozen", "compute"]
    assert all(p.model_flops > 0 and p.tokens == config.batch_size for p in trains)
