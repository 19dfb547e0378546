"""FlowTrain as a :class:`jaxflow.system.System`: the decoupled encoder / backbone trainer, with
the monolithic baselines (padded and packed rows) as arms of the same system.

One :class:`FlowTrainSystem` per arm (``mode``; the decoupled arm also names its allocator
``split`` ``"E+B"``, e.g. ``"2(2x1)+6(6x1)"``). Its state (:class:`FlowTrainState`) is the
encoder's and the backbone's :class:`~jaxflow.train.state.TrainState` plus, as static fields,
the run's config and the :class:`~jaxflow.flow.steps.Sides` both live on. A ``step`` trains one
block ``[(step, samples), ...]``: the monolithic arms with
:class:`~jaxflow.flow.monolithic.MonolithicTrainer`, the decoupled arm with a
:class:`~jaxflow.flow.decoupled.DecoupledTrainer` whose pool, producer thread and counters
live for that call only (the state between calls is the two train states). Every arm starts
from the same parameters, drawn on the monolithic mesh (:meth:`FlowTrainSystem.init`, or
:meth:`FlowTrainSystem.start` from one host copy).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxflow.compile_only.program import Program
from jaxflow.distributed import put, to_host
from jaxflow.flow.batching import eval_layout
from jaxflow.flow.decoupled import DecoupledTrainer, put_rows
from jaxflow.flow.digits_data import Sample, heldout_samples, step_samples
from jaxflow.flow.monolithic import MonolithicTrainer
from jaxflow.flow.packing import CostModel
from jaxflow.flow.programs import monolithic_programs, split_programs
from jaxflow.flow.steps import Sides, build_sides, make_eval_step
from jaxflow.flow.vlm import AttentionBackend, resolve_backend
from jaxflow.system import static_field, system_state
from jaxflow.train.state import TrainState

#: The arms of a flowtrain run, in the order the first round runs them.
MODES = ("monolithic_padded", "monolithic_packed", "decoupled")

Block = Sequence[tuple[int, Sequence[Sample]]]


def run_total_steps(config) -> int:
    """Optimizer steps of every mode in a run (the schedules' horizon)."""
    return (config.train.warmup_rounds + config.train.rounds) * config.train.block_steps


def cost_model(config) -> CostModel:
    """The packing cost model of the run's backbone width."""
    return CostModel.for_width(config.model.d_model, config.packing.encoder_cost_per_patch)


def run_samples(config) -> list[tuple[int, list[Sample]]]:
    """``[(step, samples), ...]`` of every step of a run (the same samples for every mode)."""
    return [(k, step_samples(config.data, seed=config.seed, step=k,
                             batch_size=config.train.batch_size))
            for k in range(run_total_steps(config))]


def make_sides(config, enc_mesh: Mesh, bb_mesh: Mesh, backend: AttentionBackend) -> Sides:
    """The run's :class:`Sides` on these meshes (monolithic: the same mesh twice). One object
    per (models, optimizer, horizon, meshes, backend), so every arm, the profiler and the
    evaluation on the same meshes share its compiled steps."""
    return _shared_sides(config.vit, config.model, config.optim, run_total_steps(config),
                         enc_mesh, bb_mesh, backend)


@functools.lru_cache(maxsize=16)
def _shared_sides(vit, lm, optim, total_steps: int, enc_mesh: Mesh, bb_mesh: Mesh,
                  backend: AttentionBackend) -> Sides:
    return build_sides(vit, lm, enc_mesh, bb_mesh, optim, total_steps, backend)


def host_copy(state: TrainState) -> TrainState:
    """Numpy copy of a (possibly multi-process) device state, the same on every process."""
    return jax.tree.map(lambda x: np.array(to_host(x)), state)


def heldout_accuracy(sides: Sides, enc_params, bb_params, samples: Sequence[Sample],
                     cost: CostModel) -> float:
    """Fraction of held-out samples whose every answer token is the argmax (teacher forcing),
    evaluated on ``sides``' backbone mesh (the parameters may live on other meshes)."""
    mesh = sides.bb.mesh
    patches, lay = eval_layout(samples, sides.vit, mesh.shape["data"], cost)
    fn = make_eval_step(sides)
    # parameters via the host: they may live on another mesh (a decoupled sub-mesh)
    enc_params, bb_params = (jax.tree.map(to_host, p) for p in (enc_params, bb_params))
    correct = to_host(fn(put(enc_params, sides.enc.param_shardings),
                         put(bb_params, sides.bb.param_shardings),
                         put_rows(patches.arrays(), mesh), put_rows(lay.rows, mesh)))
    need = lay.rows["loss_mask"].sum(axis=1)
    got = correct.sum(axis=1)
    return float(np.mean(got[:len(samples)] == need[:len(samples)]))


@system_state
class FlowTrainState:
    """One arm's state: ``enc`` / ``bb`` the encoder's and backbone's train states (on
    ``sides``' meshes); static: the run's ``config``, the arm's ``mode``, its ``sides`` and the
    monolithic ``eval_sides`` held-out accuracy is measured on."""

    enc: TrainState
    bb: TrainState
    config: Any = static_field()
    mode: str = static_field()
    sides: Sides = static_field()
    eval_sides: Sides = static_field()


@dataclasses.dataclass(frozen=True)
class FlowTrainSystem:
    """One arm of FlowTrain (module docstring): ``mode`` in :data:`MODES`; ``split`` the
    decoupled arm's ``"E+B"`` (keys ``encoder/E+B`` and ``backbone/E+B`` of the meshes)."""

    mode: str = "decoupled"
    split: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"FlowTrainSystem mode={self.mode!r}; valid: {', '.join(MODES)}")
        if (self.mode == "decoupled") != (self.split is not None):
            raise ValueError(f"FlowTrainSystem mode={self.mode!r} split={self.split!r}: the "
                             f"decoupled arm, and only it, names a split 'E+B'")

    def sides(self, config, meshes: Mapping[str, Mesh]) -> Sides:
        """This arm's :class:`Sides`: the ``monolithic`` mesh twice, or the split's two."""
        backend = resolve_backend(config.flow.attention)
        if self.split is None:
            mono = meshes["monolithic"]
            return make_sides(config, mono, mono, backend)
        enc, bb = f"encoder/{self.split}", f"backbone/{self.split}"
        if enc not in meshes or bb not in meshes:
            have = sorted(k[len("encoder/"):] for k in meshes if k.startswith("encoder/"))
            raise ValueError(f"split={self.split!r} has no meshes; valid: {', '.join(have)}")
        return make_sides(config, meshes[enc], meshes[bb], backend)

    def init(self, config, meshes: Mapping[str, Mesh], key: jax.Array) -> FlowTrainState:
        """Fresh parameters drawn on the ``monolithic`` mesh from ``key`` (the same for every
        arm), placed on this arm's sides."""
        mono = FlowTrainSystem("monolithic_padded").sides(config, meshes)
        enc, bb = mono.init(key)
        return self.start(config, meshes, host_copy(enc), host_copy(bb))

    def start(self, config, meshes: Mapping[str, Mesh], enc: TrainState,
              bb: TrainState) -> FlowTrainState:
        """The state of this arm from (host or device) encoder / backbone states: fresh device
        copies in this arm's shardings and optimizers."""
        sides = self.sides(config, meshes)
        enc_state, bb_state = sides.place(enc, bb)
        return FlowTrainState(enc_state, bb_state, config, self.mode, sides,
                              FlowTrainSystem("monolithic_padded").sides(config, meshes))

    def _trainer(self, state: FlowTrainState):
        config, cost = state.config, cost_model(state.config)
        if state.mode == "decoupled":
            return DecoupledTrainer(state.sides, state.enc, state.bb, packing=config.packing,
                                    cost=cost, run_ahead=config.flow.run_ahead,
                                    pool_capacity=config.flow.pool_capacity)
        return MonolithicTrainer(state.sides, state.enc, state.bb,
                                 layout=state.mode[len("monolithic_"):],
                                 packing=config.packing, cost=cost)

    def warm(self, state: FlowTrainState, steps: Block) -> int:
        """Compiles every program these steps will run (on zeros and throwaway copies of the
        state; ``state`` is left as it is). Returns the number of shape buckets."""
        return self._trainer(state).warm(steps)

    def step(self, state: FlowTrainState, batch: Block, *, key: jax.Array | None = None
             ) -> tuple[FlowTrainState, dict[str, Any]]:
        """Trains on the block ``batch = [(step, samples), ...]`` (the data is given: ``key``
        draws nothing). Metrics: ``results``, one dict per step (``metrics`` the step's device
        scalars, ``layout`` its :class:`~jaxflow.flow.batching.Layout`, ``staleness``), and for
        the decoupled arm ``pool`` (:meth:`EmbeddingPool.stats` of this call) and ``timers``."""
        trainer = self._trainer(state)
        results = trainer.run(batch)
        metrics: dict[str, Any] = {"results": results, "timers": dict(trainer.timers)}
        if isinstance(trainer, DecoupledTrainer):
            metrics["pool"] = trainer.pool.stats()
        return dataclasses.replace(state, enc=trainer.enc_state, bb=trainer.bb_state), metrics

    def programs(self, config, meshes: Mapping[str, Mesh]) -> list[Program]:
        """Every jitted program of a flowtrain run (all arms) on ``meshes`` (what
        :func:`jaxflow.flow.meshes.resolve_meshes` builds), with abstract arguments in the run's
        shardings and the shapes of step 0's samples (held-out samples for eval): on the
        monolithic mesh :func:`jaxflow.flow.programs.monolithic_programs`, per candidate split
        ``E+B`` :func:`jaxflow.flow.programs.split_programs`."""
        mono = meshes["monolithic"]
        with jax.set_mesh(mono):  # the target's platform decides which names are valid
            backend = resolve_backend(config.flow.attention)
        cost = cost_model(config)
        samples = step_samples(config.data, seed=config.seed, step=0,
                               batch_size=config.train.batch_size)
        held = heldout_samples(config.data, seed=config.seed, n=config.train.eval_examples)
        programs = monolithic_programs(make_sides(config, mono, mono, backend), samples, held,
                                       config.packing, cost)
        for name in [k for k in meshes if k.startswith("encoder/")]:
            split = name[len("encoder/"):]
            sides = make_sides(config, meshes[name], meshes[f"backbone/{split}"], backend)
            programs += split_programs(sides, split, samples, config.packing, cost)
        return programs

    def evaluate(self, state: FlowTrainState) -> dict[str, float]:
        """``{"heldout_accuracy": fraction}``: teacher-forced exact match of the answer on
        ``train.eval_examples`` held-out samples, on the monolithic mesh."""
        config = state.config
        held = heldout_samples(config.data, seed=config.seed, n=config.train.eval_examples)
        return {"heldout_accuracy": heldout_accuracy(state.eval_sides, state.enc.params,
                                                     state.bb.params, held, cost_model(config))}
