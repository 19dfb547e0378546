"""One face for every paper's system: a typed frozen state, ``init``, a pure ``step``,
``programs`` for ``--compile-only`` and ``evaluate``.

A *system* (NestPipe's pipelined embedding trainer, FlowTrain's decoupled encoder / backbone,
the GRPO trainer, FlexMARL's agents, DLRM, OxygenREC, DecorateLM's student, the pruning
pipeline) is an object that satisfies :class:`System`:

- ``init(config, meshes, key) -> state``: the state, a frozen dataclass registered as a pytree
  (:func:`system_state`), never a dict or a tuple. What the step needs besides arrays (the
  config, a graphdef, jitted functions) lives in the state's *static* fields, so a state alone
  says what it is;
- ``step(state, batch, *, key) -> (state, metrics)``: pure (no input is modified; the result is a
  function of the arguments). ``batch`` is the step's data (``None`` for systems that draw it
  from ``key`` themselves, e.g. an RL system's prompts and rollouts). It may run several jitted
  programs (rollout, then update) but keeps no hidden state between calls;
- ``programs(config, meshes) -> [jaxflow.compile_only.Program]``: every jitted program a run
  executes, with abstract arguments on ``meshes``, built through public signatures only (a
  driver's ``compile_programs`` is this method);
- ``evaluate(state) -> metrics``: a flat ``{name: float}``.

Drivers compose a system with :func:`jaxflow.train.loop.run_steps` and a report; studies
(seed grids, paired intervals) live in :mod:`jaxflow.study`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax

__all__ = ["System", "system_state", "static_field", "check_system"]

StateT = TypeVar("StateT")
Metrics = Mapping[str, Any]


@runtime_checkable
class System(Protocol):
    """What every paper's system provides (see the module docstring)."""

    def init(self, config: Any, meshes: Mapping[str, Any], key: jax.Array) -> Any: ...

    def step(self, state: Any, batch: Any, *, key: jax.Array) -> tuple[Any, Metrics]: ...

    def programs(self, config: Any, meshes: Mapping[str, Any]) -> list[Any]: ...

    def evaluate(self, state: Any) -> Metrics: ...


def static_field(**kwargs) -> Any:
    """A dataclass field of a :func:`system_state` class that is static pytree metadata (the
    config, a graphdef, a jitted function): not a leaf, compared by ``==`` / hash under jit."""
    metadata = dict(kwargs.pop("metadata", {}) or {}, static=True)
    return dataclasses.field(metadata=metadata, **kwargs)


def system_state(cls: type[StateT]) -> type[StateT]:
    """Class decorator: ``cls`` becomes a frozen dataclass registered as a JAX pytree whose
    fields are children except those made with :func:`static_field` (metadata).

    Usage::

        @system_state
        class NestPipeState:
            train: TrainState
            tables: dict
            config: NestPipeConfig = static_field()
    """
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def check_system(system: Any, name: str = "system") -> list[str]:
    """What keeps ``system`` from being a :class:`System`, each as a sentence (``[]`` when it
    is one): a missing or non-callable method, or a ``step`` whose ``key`` is not keyword-only."""
    import inspect

    problems = []
    for method in ("init", "step", "programs", "evaluate"):
        if not callable(getattr(system, method, None)):
            problems.append(f"{name}: no {method}() (a System has init, step, programs, evaluate)")
    step = getattr(system, "step", None)
    if callable(step):
        params = inspect.signature(step).parameters
        key = params.get("key")
        if key is None or key.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{name}: step(state, batch, *, key) must take key keyword-only")
    return problems


def is_system_state(state: Any) -> bool:
    """True when ``state`` is a frozen dataclass instance (what :func:`system_state` makes)."""
    return (dataclasses.is_dataclass(state) and not isinstance(state, type)
            and type(state).__dataclass_params__.frozen)  # type: ignore[attr-defined]
