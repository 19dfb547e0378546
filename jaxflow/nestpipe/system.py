"""NestPipe as a :class:`jaxflow.system.System`: the dense DLRM's ``TrainState`` and the
host-resident tables, trained by the pipeline the system selects.

``NestPipeSystem(pipeline)`` runs one of ``pipelines.PIPELINES``: ``sync`` (the stages one after
another), ``sparse_dist`` (TorchRec's input prefetch), ``dbp`` (the dual buffer: batch t+1's
stages 1-4 during batch t, the intersection patched), ``semi_sync`` (dbp without the patch, one
step stale), ``fwp`` / ``dbp+fwp`` (the paper's frozen window: N micro-batches routed and
exchanged one by one against frozen rows), ``sync_accum`` (the whole window routed once).
Every pipeline trains the same :class:`NestPipeState`, so states compare across pipelines.

The state is pure data plus static parts: :meth:`NestPipeSystem.train` copies the host tables
before it updates them (the input state is never modified), and the batch of step t is
``generator.batch(t)`` with t the dense state's step count, so a state says where it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.compile_only.program import Program
from jaxflow.distributed import connect_collectives
from jaxflow.embeddings.host import HostTable
from jaxflow.embeddings.spec import TableSpec
from jaxflow.errors import UserError
from jaxflow.nestpipe.model import (
    dense_model,
    dense_optimizer,
    generator,
    host_tables,
    make_stages,
    pipeline_order,
    sparse_optimizer,
    stage_key,
    table_specs,
)
from jaxflow.nestpipe.pipelines import PIPELINES, Parts, run_pipeline
from jaxflow.nestpipe.sharded import MeshStages
from jaxflow.nestpipe.stages import clone_tables
from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.models import dense_model_flops
from jaxflow.recsys.synthetic import SyntheticConfig
from jaxflow.system import static_field, system_state
from jaxflow.train.state import TrainState

__all__ = ["NestPipeRuntime", "NestPipeState", "NestPipeSystem", "UnknownPipelineError", "check_pipeline"]


class UnknownPipelineError(UserError, ValueError):
    """A pipeline name that ``pipelines.PIPELINES`` does not hold, or whose stage programs the
    state was not built with."""


class NestPipeRuntime:
    """The non-array parts of a NestPipe state, built once by :meth:`NestPipeSystem.init`: the
    config, the data generator, the tables' specs, the DLRM's ``apply`` and the ``MeshStages``
    of every pipeline of ``config.pipelines`` (one per :func:`model.stage_key`, in the order
    the pipelines first need them). Never changed after construction (a static pytree field,
    compared by identity)."""

    def __init__(self, config, mesh, gen, specs: list[TableSpec], apply, stages: dict):
        self.config, self.mesh, self.gen, self.specs, self.apply = config, mesh, gen, specs, apply
        self._stages = dict(stages)

    @property
    def stages(self) -> dict[tuple[int, str], MeshStages]:
        """The stage programs by (micro-batches, frozen_exchange) (a copy)."""
        return dict(self._stages)

    def stages_for(self, pipeline: str) -> MeshStages:
        """The ``MeshStages`` ``pipeline`` runs.

        Raises:
          UnknownPipelineError: no pipeline of the config (nor sync) runs ``pipeline``'s stage
            programs.
        """
        key = stage_key(self.config, check_pipeline(pipeline))
        if key not in self._stages:
            have = [p for p in PIPELINES if stage_key(self.config, p) in self._stages]
            raise UnknownPipelineError(f"pipeline={pipeline!r}: this state was built for "
                                       f"pipelines={self.config.pipelines}, without its stage "
                                       f"programs; valid: {', '.join(have)}")
        return self._stages[key]

    def parts(self, pipeline: str, tables: dict[str, HostTable] | None) -> Parts:
        """What ``run_pipeline`` needs to run ``pipeline`` over ``tables`` (updated in place)."""
        config = self.config
        return Parts(self.gen, self.specs, tables, self.stages_for(pipeline), config.batch_size,
                     cluster=PIPELINES[pipeline][1] == "frozen" and config.cluster,
                     cluster_method=config.cluster_method)


def check_pipeline(pipeline: str) -> str:
    """``pipeline`` if ``pipelines.PIPELINES`` names it, else :class:`UnknownPipelineError`."""
    if pipeline not in PIPELINES:
        raise UnknownPipelineError(f"pipeline={pipeline!r}; valid: {', '.join(PIPELINES)}")
    return pipeline


@system_state
class NestPipeState:
    """A NestPipe model: ``dense`` the DLRM's ``TrainState`` (replicated over the mesh; its
    ``step`` is the next batch's index), ``tables`` the host-resident tables by name (values
    f32[vocab_size, embed_dim] and row-wise optimizer state, in host memory), ``runtime`` the
    static parts (:class:`NestPipeRuntime`)."""

    dense: TrainState
    tables: dict[str, HostTable]
    runtime: NestPipeRuntime = static_field()


@dataclasses.dataclass(frozen=True)
class NestPipeSystem:
    """NestPipe's trainer with the schedule ``pipeline`` (a key of ``pipelines.PIPELINES``; see
    the module docstring). ``init`` / ``programs`` read the experiment's config
    (``configs/nestpipe.py``)."""

    pipeline: str = "sync"

    def __post_init__(self):
        check_pipeline(self.pipeline)

    def init(self, config, meshes: Mapping[str, object], key: jax.Array | None = None) -> NestPipeState:
        """The initial state on ``meshes["data"]``: host tables from ``config.seed``
        (:func:`model.host_tables`), the DLRM's params from ``config.seed`` replicated with a
        fresh Adam state, the stage programs of every pipeline in ``config.pipelines``. ``key``
        is not used: every pipeline starts from the same seeded state so that they compare."""
        del key
        mesh = meshes["data"]
        gen, specs, opt = generator(config), table_specs(config), sparse_optimizer(config)
        tables = host_tables(config, specs, opt)
        params, apply = dense_model(config, gen.config.num_dense)
        connect_collectives(mesh)  # across processes: gloo's groups meet before any long compile
        replicated = NamedSharding(mesh, PartitionSpec())
        dense = TrainState.create(dense_optimizer(config.dense_lr), params,
                                  jax.tree.map(lambda _: replicated, params))
        stages: dict[tuple[int, str], MeshStages] = {}
        for p in pipeline_order(config):
            if stage_key(config, p) not in stages:
                stages[stage_key(config, p)] = make_stages(config, specs, mesh, opt, apply, p)
        return NestPipeState(dense, tables, NestPipeRuntime(config, mesh, gen, specs, apply, stages))

    def train(self, state: NestPipeState, steps: int) -> tuple[NestPipeState, dict]:
        """``steps`` steps of this system's pipeline from ``state`` (batches ``t .. t+steps-1``,
        t = ``state.dense.step``), the pipeline's overlap spanning them; ``state`` is left as
        it was (the tables are copied first, not timed). Returns (state, stats) with the stats
        of ``pipelines.run_pipeline`` (losses, stage / exposed / step seconds, patched and
        owner rows)."""
        tables = clone_tables(state.tables)
        parts = state.runtime.parts(self.pipeline, tables)
        start = int(jax.device_get(state.dense.step))
        dense, stats = run_pipeline(PIPELINES[self.pipeline][0], parts, state.dense, steps,
                                    start=start)
        return dataclasses.replace(state, dense=dense, tables=tables), stats

    def step(self, state: NestPipeState, batch=None, *, key: jax.Array | None = None
             ) -> tuple[NestPipeState, dict]:
        """One step (:meth:`train` with ``steps=1``): ``(state, {"loss": float})``. ``batch``
        and ``key`` are not used: the batch is the generator's batch at the state's step."""
        del batch, key
        state, stats = self.train(state, 1)
        return state, {"loss": stats["losses"][0]}

    def evaluate(self, state: NestPipeState) -> dict[str, float]:
        """``{"auc", "logloss"}`` over ``config.eval_batches`` held-out batches of
        ``config.batch_size`` (rows read from the host tables, sum-pooled, the DLRM on one
        device set)."""
        rt = state.runtime
        labels, probs = [], []
        for i in range(rt.config.eval_batches):
            b = rt.gen.eval_batch(i, rt.config.batch_size)
            emb = []
            for s in rt.specs:
                ids = np.where(b["sparse"][s.name] >= 0, b["sparse"][s.name], 0)
                uniq, inv = np.unique(ids, return_inverse=True)
                vals = state.tables[s.name].read_rows(uniq)[0][inv.reshape(ids.shape)]
                emb.append((vals * (b["sparse"][s.name] >= 0)[..., None]).sum(1))
            logits = rt.apply(state.dense.params, jnp.asarray(b["dense"]),
                              jnp.asarray(np.stack(emb, 1)))
            probs.append(np.asarray(jax.nn.sigmoid(logits)))
            labels.append(b["label"])
        y, p = np.concatenate(labels), np.concatenate(probs)
        return {"auc": roc_auc(y, p), "logloss": log_loss(y, p)}

    def programs(self, config, meshes: Mapping[str, object]) -> list[Program]:
        """Every device program the pipelines of ``config.pipelines`` run, with abstract
        arguments on ``meshes["data"]``: for each distinct (micro-batches, frozen_exchange) of
        :func:`model.stage_key`, the ``MeshStages`` a run builds and its ``abstract_calls``:
        ``route`` (dedup, All2All of keys, owner dedup), ``exchange`` + ``compute`` (one routed
        unit) or ``frozen`` (the frozen window: row All2Alls inside), and ``patch`` where a dbp
        schedule uses it. Named ``N{n}-{exchange}/{stage}``. The host tables are not part of
        any program (stage 4 is host threads); the dense state is an abstract replicated
        ``TrainState``. Nothing is allocated."""
        mesh = meshes["data"]
        specs, opt = table_specs(config), sparse_optimizer(config)
        num_dense = SyntheticConfig(vocab_sizes=tuple(config.vocab_sizes)).num_dense
        params, apply = dense_model(config, num_dense, abstract=True)
        replicated = NamedSharding(mesh, PartitionSpec())
        dense = TrainState.abstract(dense_optimizer(config.dense_lr), params,
                                    jax.tree.map(lambda _: replicated, params))
        users: dict[tuple[int, str], list[str]] = {}
        stages = {}
        for p in pipeline_order(config):
            key = stage_key(config, p)
            if key not in stages:
                stages[key] = make_stages(config, specs, mesh, opt, apply, p)
            users.setdefault(key, []).append(p)
        b = config.batch_size
        flops = dense_model_flops("dlrm", params, b, len(specs), config.embed_dim, train=True)
        out = []
        for key, st in stages.items():
            calls = st.abstract_calls(dense, multi_hot=config.multi_hot, num_dense=num_dense)
            if not any(PIPELINES[p][0] == "dbp" for p in users[key]):
                del calls["patch"]
            note = (f"{', '.join(users[key])}: {len(specs)} host tables row-wise over "
                    f"data={st.num_shards} ({sum(s.vocab_size for s in specs):,} rows), owner "
                    f"buffers of {st.owner_capacity} rows split over data; batch {b} split over "
                    f"data ({key[0]} micro-batch(es), {key[1]}); capacity {st.capacity}, per "
                    f"owner {st.bucket_capacity}; DLRM replicated; pooling {config.pooling_backend}; "
                    f"owner update {st.update_backend}")
            for stage, (fn, args) in calls.items():
                train = stage in ("compute", "frozen")
                out.append(Program(f"N{key[0]}-{key[1]}/{stage}", fn, args, mesh,
                                   kind="train" if train else "embedding",
                                   model_flops=flops if train else None, tokens=b, note=note))
        return out
