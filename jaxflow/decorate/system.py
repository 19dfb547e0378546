"""DecorateLM's distilled student as a :class:`jaxflow.system.System`.

:class:`DecorateStudentSystem` is the multi-task rate / tag / edit student of
:mod:`jaxflow.decorate.student` (one shared trunk, three heads): ``init`` draws fresh
parameters and an AdamW state (:func:`~jaxflow.decorate.student.init_student_state`); ``step``
is one distillation step on a batch of teacher labels (the jitted, donating
:func:`~jaxflow.decorate.student.make_student_train_step`); ``programs`` are that step and the
student's ``predict`` (what decorating a corpus runs); ``evaluate`` is the student-teacher
agreement on held-out annotated texts (:class:`StudentHeldout`). Its state
(:class:`DecorateStudentState`) is the :class:`~jaxflow.train.state.TrainState` with the
student's functions and jitted programs as static fields.

The student's trunk is sized by ``config.student`` over ``config.corpus.max_chars`` characters of
the character tokenizer, tagged on :func:`~jaxflow.decorate.tagging.default_hierarchy`; it lives
on ``meshes["mesh"]`` (parameters replicated, batches over "data").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.compile_only.program import Program
from jaxflow.decorate.corpus import text_tokenizer
from jaxflow.decorate.rating import CRITERIA
from jaxflow.decorate.student import (
    StudentFunctions,
    agreement,
    init_student,
    init_student_state,
    make_predict,
    make_student_train_step,
    predict_in_batches,
    student_functions,
    student_optimizer,
)
from jaxflow.decorate.tagging import default_hierarchy
from jaxflow.models.transformer import TransformerConfig
from jaxflow.system import static_field, system_state
from jaxflow.train.state import TrainState


def student_trunk(config) -> TransformerConfig:
    """The student's (bidirectional) trunk: ``config.student``'s sizes over the character
    tokenizer's vocabulary and ``config.corpus.max_chars`` positions."""
    sc = config.student
    return TransformerConfig(vocab_size=text_tokenizer().vocab_size, d_model=sc.d_model,
                             n_layers=sc.n_layers, n_heads=sc.n_heads, n_kv_heads=sc.n_heads,
                             d_ff=sc.d_ff, max_seq_len=config.corpus.max_chars)


@dataclasses.dataclass(frozen=True)
class StudentBatches:
    """Distillation data: ``tokens`` [N, T] int32, ``valid`` [N, T] bool, ``ratings`` [N, K]
    f32 (the teacher's scores z-scored over these N texts: the targets), ``tags`` [N, 3],
    ``ops`` [N, T] edit-op targets."""

    tokens: np.ndarray
    valid: np.ndarray
    ratings: np.ndarray
    tags: np.ndarray
    ops: np.ndarray

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The step batch of rows ``idx`` [B] (what ``DecorateStudentSystem.step`` takes)."""
        return {"tokens": self.tokens[idx], "valid": self.valid[idx], "ratings": self.ratings[idx],
                "tags": self.tags[idx].astype(np.int32), "ops": self.ops[idx].astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class StudentHeldout:
    """Held-out annotated texts ``evaluate`` scores the student on: ``tokens`` / ``valid``
    [N, T], the teacher's raw ``ratings`` [N, K] and ``tags`` [N, 3], the ``texts`` and the
    teacher's ``edits`` of them; predicted ``batch_size`` texts at a time."""

    tokens: np.ndarray
    valid: np.ndarray
    ratings: np.ndarray
    tags: np.ndarray
    texts: Sequence[str]
    edits: Sequence[str]
    batch_size: int


@system_state
class DecorateStudentState:
    """``train``: the student's :class:`TrainState` (params a pure dict, replicated); static:
    its functions ``fns`` (graph definition, shardings), the jitted ``train_step`` and
    ``predict``."""

    train: TrainState
    fns: StudentFunctions = static_field()
    train_step: Callable = static_field()
    predict: Callable = static_field()


@dataclasses.dataclass(frozen=True)
class DecorateStudentSystem:
    """The distilled rate / tag / edit student (module docstring); ``heldout``: what
    ``evaluate`` scores it on (None: ``evaluate`` reports nothing)."""

    heldout: StudentHeldout | None = None

    def init(self, config, meshes: Mapping[str, Mesh], key: jax.Array) -> DecorateStudentState:
        """Fresh parameters from ``key`` and the optimizer of ``config.student`` (``lr`` over
        ``steps``), on ``meshes["mesh"]``."""
        sc = config.student
        fns = student_functions(student_trunk(config), default_hierarchy(), meshes["mesh"])
        state = init_student_state(fns, student_optimizer(sc.lr, sc.steps), key)
        step = make_student_train_step(fns, edit_nonkeep_weight=sc.edit_nonkeep_weight)
        return DecorateStudentState(state, fns, step, make_predict(fns))

    def step(self, state: DecorateStudentState, batch: Mapping[str, np.ndarray], *,
             key: jax.Array | None = None) -> tuple[DecorateStudentState, dict[str, Any]]:
        """One distillation step on ``batch`` (:meth:`StudentBatches.batch`; ``key`` unused:
        the batch is given). Metrics (device scalars): loss, rating_mse, tag_ce, edit_ce."""
        train, metrics = state.train_step(state.train, dict(batch))
        return dataclasses.replace(state, train=train), metrics

    def programs(self, config, meshes: Mapping[str, Mesh]) -> list[Program]:
        """``student/step`` (a ``student.batch_size`` batch) and ``student/predict`` (a
        ``decorate.batch_size`` batch) on ``meshes["mesh"]``, with abstract arguments."""
        mesh, sc, T = meshes["mesh"], config.student, config.corpus.max_chars
        fns = student_functions(student_trunk(config), default_hierarchy(), mesh)
        replicated = NamedSharding(mesh, PartitionSpec())
        tx = student_optimizer(sc.lr, sc.steps)
        state = jax.eval_shape(lambda: TrainState.create(tx, init_student(fns, jax.random.key(0))))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                             state)

        def rows(b: int, width: int | None, dtype) -> jax.ShapeDtypeStruct:
            shape = (b, width) if width is not None else (b,)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=fns.batch_sharding)

        B, D = sc.batch_size, config.decorate.batch_size
        batch = {"tokens": rows(B, T, np.int32), "valid": rows(B, T, bool),
                 "ratings": rows(B, len(CRITERIA), np.float32),
                 "tags": rows(B, 3, np.int32), "ops": rows(B, T, np.int32)}
        note = f"student replicated, batch over {dict(mesh.shape)}"
        return [
            Program("student/step", make_student_train_step(
                fns, edit_nonkeep_weight=sc.edit_nonkeep_weight), (state, batch), mesh, "train",
                tokens=B * T, note=f"{note}; {B} texts of {T} characters"),
            Program("student/predict", make_predict(fns),
                    (state.params, rows(D, T, np.int32), rows(D, T, bool)), mesh, "forward",
                    tokens=D * T, note=f"{note}; {D} texts of {T} characters")]

    def agreement(self, state: DecorateStudentState) -> dict[str, Any]:
        """Student-teacher agreement on ``heldout``
        (:func:`jaxflow.decorate.student.agreement`'s nested dict); ``{}`` without it."""
        h = self.heldout
        if h is None:
            return {}
        pred = predict_in_batches(state.predict, state.train.params, h.tokens, h.valid,
                                  h.batch_size)
        return agreement(pred, h.ratings, h.tags, list(h.texts), list(h.edits))

    def evaluate(self, state: DecorateStudentState) -> dict[str, float]:
        """:meth:`agreement` flattened to ``{"spearman/ethics": rho, ...}`` floats."""
        flat: dict[str, float] = {}

        def walk(prefix: str, value) -> None:
            if isinstance(value, Mapping):
                for k, v in value.items():
                    walk(f"{prefix}/{k}" if prefix else str(k), v)
            else:
                flat[prefix] = float(value)

        walk("", self.agreement(state))
        return flat

