"""What the runner may read of an experiment: the config and driver contract as Protocols.

``python -m jaxflow.run`` knows an experiment by its config module (``configs/NAME.py``: a
``get_config(variant)``, ``VARIANTS``, ``DESCRIPTION``, ``ENTRY``) and its driver (the module
``ENTRY`` names). Beyond ``ENTRY(config, run) -> summary``, each of these is optional and
declared here; the runner asks ``isinstance(x, Protocol)`` rather than poking at attributes,
and ``tests/test_layout.py`` checks every registered experiment against them.

Config (a frozen dataclass) may provide:

- :class:`WithSeed` ``seed: int`` — the run's base seed (``RunContext.seed``);
- :class:`WithDevices` ``devices: int | None`` — fake CPU devices a single-process run wants
  (``None``: every device present, :data:`jaxflow.mesh.CPU_FAKE_DEVICES` on a CPU);
- :class:`WithMesh` ``mesh`` — a :class:`jaxflow.mesh.MeshConfig`-like with ``make(devices)``;
- :class:`WithRoles` ``roles`` — a trainer / rollout split (``colocate`` and the sizes), built by
  :func:`jaxflow.mesh.trainer_rollout_meshes`.

A driver module may provide :class:`MeshResolver` ``resolve_meshes(config, devices) ->
{name: Mesh}`` when its meshes are not the config's ``mesh`` / ``roles`` (``--dry-run`` and the
start-up check build them without running anything), and :class:`CompilesAhead`
``compile_programs(config, meshes) -> [jaxflow.compile_only.Program]`` for ``--compile-only``
(every jitted program the run would execute, with abstract arguments on ``meshes``).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


class Entry(Protocol):
    """A driver's entry: ``(config, run: RunContext) -> summary`` (a JSON-able mapping or
    None); it may raise ``ConfigError`` / ``MeshError`` / ``CheckpointError`` for user errors
    and ``signals.RunStopped`` on a stop signal."""

    def __call__(self, config: Any, run: Any) -> Mapping[str, Any] | None: ...


@runtime_checkable
class MakesMesh(Protocol):
    """A mesh description: ``make(devices=None) -> jax.sharding.Mesh``."""

    def make(self, devices: Sequence | None = None) -> Any: ...


@runtime_checkable
class WithSeed(Protocol):
    seed: int


@runtime_checkable
class WithDevices(Protocol):
    devices: int | None


@runtime_checkable
class WithMesh(Protocol):
    mesh: MakesMesh


@runtime_checkable
class WithRoles(Protocol):
    roles: Any  # jaxflow.mesh.RolesConfig: colocate / trainer / rollout sizes


@runtime_checkable
class MeshResolver(Protocol):
    """A driver module that builds its own meshes."""

    def resolve_meshes(self, config: Any, devices: Sequence | None = None) -> Mapping[str, Any]: ...


@runtime_checkable
class CompilesAhead(Protocol):
    """A driver module whose programs ``--compile-only --target=...`` can compile."""

    def compile_programs(self, config: Any, meshes: Mapping[str, Any]) -> Sequence[Any]: ...


def config_seed(config: Any) -> int:
    """The config's ``seed`` (0 without one)."""
    return int(config.seed) if isinstance(config, WithSeed) else 0


def config_mesh(config: Any) -> MakesMesh | None:
    """The config's ``mesh`` when it is a mesh description, else None."""
    if isinstance(config, WithMesh) and isinstance(config.mesh, MakesMesh):
        return config.mesh
    return None


def config_roles(config: Any) -> Any:
    """The config's ``roles`` (a trainer / rollout split) when it has one, else None."""
    if isinstance(config, WithRoles) and hasattr(config.roles, "colocate"):
        return config.roles
    return None


def check_experiment(spec: Any) -> list[str]:
    """What breaks the contract in the registered experiment ``spec`` (``config.ExperimentSpec``),
    each as a sentence; ``[]`` when it keeps it. Imports the driver and builds every variant."""
    import dataclasses
    import importlib
    import inspect

    problems = []
    module_name, _, fn_name = spec.entry.partition(":")
    driver = importlib.import_module(module_name)
    entry = getattr(driver, fn_name, None)
    if not callable(entry):
        return [f"{spec.name}: ENTRY {spec.entry!r} is not a function"]
    if len(inspect.signature(entry).parameters) != 2:
        problems.append(f"{spec.name}: {spec.entry} must take (config, run)")
    hook = getattr(driver, "resolve_meshes", None)
    if hook is not None and not isinstance(driver, MeshResolver):
        problems.append(f"{spec.name}: {module_name}.resolve_meshes is not a function")
    for variant in spec.variants:
        config = spec.get_config(variant)
        where = f"{spec.name}[{variant}]"
        params = getattr(config, "__dataclass_params__", None)
        if not (dataclasses.is_dataclass(config) and params is not None and params.frozen):
            problems.append(f"{where}: the config is not a frozen dataclass")
        if hasattr(config, "seed") and not isinstance(config.seed, int):
            problems.append(f"{where}: seed={config.seed!r} is not an int")
        if hasattr(config, "devices"):
            d = config.devices
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
                problems.append(f"{where}: devices={d!r}; valid: None or an int >= 1")
        if hasattr(config, "mesh") and config_mesh(config) is None and config.mesh is not None:
            problems.append(f"{where}: mesh={type(config.mesh).__name__} has no make(devices)")
        if hasattr(config, "roles") and config_roles(config) is None and config.roles is not None:
            problems.append(f"{where}: roles={type(config.roles).__name__} is not a trainer / "
                            "rollout split (no colocate)")
    return problems
