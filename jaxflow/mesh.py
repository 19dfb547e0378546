"""Meshes, disjoint role sub-meshes, and logical-axis sharding rules.

Parameters and activations are annotated with *logical* axis names ("embed", "mlp", "batch");
a small table of rules maps each logical name to a mesh axis (or None = replicated). Rules are
checked: a logical name given two mesh axes, or one mesh axis used twice in one array, is an
error, never silently resolved.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxflow.config_domains import COUNT, Int, domains
from jaxflow.errors import UserError

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

#: The LM's rules (the one table; mesh axes a mesh lacks, or has at size 1, drop out): the batch
#: over "data" and "fsdp"; the MLP hidden and vocab dimensions of the weights over "fsdp" and
#: "model" together (ZeRO-3 and tensor parallelism), heads and kv heads over "model"; the
#: attention projections' model dimension (``attn_embed``) over "fsdp", since their heads go
#: over "model" only (without it Llama-3-70B's 12B attention parameters, with their moments,
#: sat whole on every chip: 217 GiB per v6e chip); the MLP and vocab weights' contracted
#: embed dimension stays whole. A weight sharded on its output dimension is
#: all-gathered before its matmul, while one sharded on the contracted dimension lets XLA move
#: the activations instead, which for the LM head means reducing full-batch logits (measured:
#: 1.2 TiB of temporaries per chip for Llama-3-8B on 64 v5p chips with the embed dimension over
#: "fsdp"). A dimension the axes do not divide stays replicated. On a ("data", "model") mesh:
#: data parallel over "data", tensor parallel over "model".
DEFAULT_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("fsdp", "model")),
    ("mlp", ("fsdp", "model")),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("embed", None),
    ("attn_embed", "fsdp"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
)


class MeshError(UserError, ValueError):
    """A mesh that cannot be built from the devices at hand, or conflicting sharding rules."""


#: Fake CPU devices the runner creates for an experiment whose config declares ``devices=None``
#: ("every device present"): on a CPU-only machine its multi-device meshes still have 8 devices.
CPU_FAKE_DEVICES = 8


def experiment_devices(wanted: int | None,
                       devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices an experiment's meshes span: every one of ``devices`` (default
    ``jax.devices()``) when ``wanted`` is None, else the first ``wanted``.

    Raises:
      MeshError: ``wanted`` is not a positive int or exceeds the devices present.
    """
    have = list(jax.devices() if devices is None else devices)
    if wanted is None:
        return have
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise MeshError(f"devices={wanted!r}; valid: an integer >= 1, or none (every device)")
    if wanted > len(have):
        platform = have[0].platform if have else "no"
        raise MeshError(f"devices={wanted}, but {len(have)} {platform} device(s) are available; "
                        f"valid: 1..{len(have)} or devices=none (every device present)")
    return have[:wanted]


def require_divisible(name: str, value: int, n_devices: int, factor: int = 1,
                      factor_name: str = "") -> None:
    """Raises MeshError unless ``value`` (a config field such as ``batch_size``) is divisible by
    ``n_devices * factor``, naming the resolved device count and the valid values."""
    step = n_devices * factor
    if value % step:
        by = f"{n_devices} devices" + (f" x {factor_name}={factor}" if factor_name else "")
        raise MeshError(f"{name}={value} is not divisible by {by} = {step}; valid: a multiple of "
                        f"{step} (e.g. --set {name}={max(step, value // step * step)}), or fewer "
                        "devices (--set devices=N)")


def resolve_axis_sizes(axes: Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Fills in at most one ``-1`` axis size so the product equals ``n_devices``.

    Raises:
      MeshError: when the sizes do not multiply to ``n_devices`` (naming both).
    """
    sizes = dict(axes)
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise MeshError(f"at most one mesh axis may be -1, got {free}")
    for k, v in sizes.items():
        if v != -1 and (not isinstance(v, int) or v < 1):
            raise MeshError(f"mesh axis {k!r} has size {v!r}; sizes are positive ints or -1")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n_devices % fixed:
            raise MeshError(
                f"{n_devices} devices cannot be split into mesh {dict(axes)}: "
                f"{n_devices} is not divisible by {fixed}"
            )
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise MeshError(
            f"mesh {dict(axes)} needs {math.prod(sizes.values())} devices but "
            f"{n_devices} are available; use sizes whose product is {n_devices} (or -1 for one axis)"
        )
    return sizes


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with named axes, e.g. ``make_mesh({"data": -1, "model": 2})``.

    Works on any backend and across processes (``devices`` defaults to ``jax.devices()``, the
    global device list). Axis types are the classic Auto ones so jit + NamedSharding behave as
    usual. Device order follows ``jax.experimental.mesh_utils`` when it applies.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(axes, len(devices))
    shape = tuple(sizes.values())
    try:
        from jax.experimental import mesh_utils

        if len(devices) == len(jax.devices()):
            arr = mesh_utils.create_device_mesh(shape, devices=devices)
        else:
            arr = np.asarray(devices, dtype=object).reshape(shape)
    except Exception:  # noqa: BLE001 - topology helpers are best-effort; plain order is valid
        arr = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(arr, tuple(sizes.keys()))


def host_block(devices: Sequence[jax.Device]) -> int:
    """The fewest leading ``devices`` (in the given order) that are whole hosts filling a box
    of the slice's chip coordinates, when ``devices`` span several hosts (``process_index``)
    but one process drives them all (an abstract pod slice compiled with ``--compile-only``);
    1 otherwise (one host, devices without ``coords``, or a real multi-process run, where
    :func:`process_role_meshes` spreads every role over every process).

    A sub-mesh of leading devices a multiple of this long is what libtpu compiles for: on
    v5p:4x4x4 (hosts of 2x2x1 chips) the block is 8 ids (a 4x2x1 box), on v6e:16x16 (hosts of
    2x2) 32 ids (16x2); a 12-chip v5p sub-mesh (4x3x1) is refused with "chips: 4,3,1 does not
    evenly divide into chips_per_hosts: 2,2,1".
    """
    devices = list(devices)
    hosts: dict[int, set] = {}
    for d in devices:
        hosts.setdefault(d.process_index, set()).add(d.id)
    if len(hosts) < 2 or jax.process_count() > 1 or \
            not all(hasattr(d, "coords") for d in devices):
        return 1
    seen: set = set()
    low = high = np.asarray(devices[0].coords)
    for k, d in enumerate(devices, 1):  # the box grows with the prefix: one pass
        seen.add(d.id)
        low, high = np.minimum(low, d.coords), np.maximum(high, d.coords)
        if int(np.prod(high - low + 1)) == k and \
                all(hosts[p] <= seen for p in {x.process_index for x in devices[:k]}):
            return k
    return len(devices)


def role_meshes(
    roles: Mapping[str, int],
    axes: Mapping[str, Mapping[str, int]] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> dict[str, Mesh]:
    """Disjoint sub-meshes of one device set, one per role (tunix ``role_to_mesh``).

    Args:
      roles: devices per role, e.g. ``{"trainer": 6, "rollout": 2}``; in order, consecutive
        device blocks. One role may be -1 (the rest).
      axes: per role, its mesh axis sizes (default ``{"data": -1}``).
    Returns:
      ``{role: Mesh}``; no device is in two meshes.
    """
    devices = list(jax.devices() if devices is None else devices)
    counts = resolve_axis_sizes(dict(roles), len(devices)) if -1 in roles.values() else dict(roles)
    total = sum(counts.values())
    if total > len(devices):
        raise MeshError(
            f"roles {dict(roles)} need {total} devices but only {len(devices)} are available"
        )
    out, start = {}, 0
    for role, count in counts.items():
        role_axes = (axes or {}).get(role, {"data": -1})
        out[role] = make_mesh(role_axes, devices[start : start + count])
        start += count
    return out


def process_role_meshes(
    roles: Mapping[str, int],
    axes: Mapping[str, Mapping[str, int]] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> dict[str, Mesh]:
    """:func:`role_meshes` that spans every process alike (multi-controller JAX).

    Every process runs each program whose mesh holds one of its devices, and only those; a
    role on one process's devices would leave the others out of its programs, and JAX moves
    arrays across processes only between shardings of one device set. So across P processes
    each process gives ``count / P`` of its own devices to each role, in ``roles`` order
    (process 0's block, then process 1's, ... within a role's mesh): every role spans every
    process and host data placed on it arrives on every process's own devices; each mesh's
    cross-process collectives are connected at once (:func:`jaxflow.distributed.connect_collectives`,
    so every process must build the same meshes in the same order). One process: exactly
    :func:`role_meshes`.

    Raises:
      MeshError: a role's count is not a multiple of the process count, or a process has too
        few devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if jax.process_count() == 1:
        return role_meshes(roles, axes, devices)
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    n_proc = len(groups)
    counts = resolve_axis_sizes(dict(roles), len(devices)) if -1 in roles.values() else dict(roles)
    bad = {r: c for r, c in counts.items() if c % n_proc}
    if bad:
        raise MeshError(f"roles {bad} across {n_proc} processes: each role needs a multiple of "
                        f"{n_proc} devices (the same count on every process)")
    need = sum(counts.values()) // n_proc
    if any(len(g) < need for g in groups.values()):
        raise MeshError(f"roles {dict(counts)} need {need} devices per process; processes have "
                        f"{[len(g) for g in groups.values()]}")
    out, start = {}, 0
    for role, count in counts.items():
        k = count // n_proc
        out[role] = make_mesh((axes or {}).get(role, {"data": -1}),
                              [d for g in groups.values() for d in g[start:start + k]])
        start += k
    from jaxflow.distributed import connect_collectives

    for mesh in out.values():
        connect_collectives(mesh)
    return out


@domains(rollout_devices=COUNT, trainer_model=COUNT, rollout_model=COUNT)
@dataclasses.dataclass(frozen=True)
class RolesConfig:
    """Devices per RL role (the RL experiments' ``roles``): ``rollout_devices`` for the
    sampler, the rest for the trainer; ``colocate`` (or a single device) puts both roles on
    every device (:func:`trainer_rollout_meshes`)."""

    rollout_devices: int = 1
    colocate: bool = False
    # Tensor parallelism per role: a "model" axis of this size (heads / mlp / vocab sharded,
    # DEFAULT_RULES) beside "data"; 1 = data parallel only (no "model" axis).
    trainer_model: int = 1
    rollout_model: int = 1

    def __post_init__(self):
        for name in ("rollout_devices", "trainer_model", "rollout_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"roles.{name}={value!r}; valid: an integer >= 1")

    def axes(self, role: str) -> dict[str, int]:
        """Mesh axes of ``role`` ("trainer" / "rollout"): {"data": -1} plus "model" when TP."""
        tp = self.trainer_model if role == "trainer" else self.rollout_model
        return {"data": -1} if tp == 1 else {"data": -1, "model": tp}


def trainer_rollout_meshes(roles, devices: Sequence[jax.Device] | None = None
                           ) -> tuple[dict, str]:
    """{"trainer", "rollout"} meshes and a description. Disjoint when there are >= 2 devices
    and ``roles.colocate`` is off; otherwise both roles use every device.

    Args:
      roles: any object with ``colocate: bool`` and ``rollout_devices: int`` (a
        :class:`RolesConfig`); the trainer gets the remaining devices.
      devices: the devices to split (default ``jax.devices()``).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    axes = getattr(roles, "axes", None)
    trainer_axes = axes("trainer") if axes else {"data": -1}
    if roles.colocate or n < 2:
        mesh = make_mesh(trainer_axes, devices)
        return {"trainer": mesh, "rollout": mesh}, f"colocated on {n} device(s)"
    r = roles.rollout_devices
    if not 1 <= r < n:
        raise ValueError(f"roles.rollout_devices={r} must be in [1, {n - 1}] with {n} devices "
                         "(or set roles.colocate=true)")
    per_role = {"trainer": trainer_axes, "rollout": axes("rollout") if axes else {"data": -1}}
    meshes = role_meshes({"trainer": n - r, "rollout": r}, per_role, devices=devices)
    text = f"disjoint: trainer {n - r} device(s), rollout {r} device(s)"
    if any(len(a) > 1 for a in per_role.values()):
        text += "; " + ", ".join(f"{k} {dict(m.shape)}" for k, m in meshes.items())
    return meshes, text


def check_rules(rules: LogicalRules) -> dict[str, tuple[str, ...]]:
    """Validates rules and returns ``{logical: mesh axes}``; conflicting rules raise MeshError."""
    table: dict[str, tuple[str, ...]] = {}
    for logical, target in rules:
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        if logical in table and table[logical] != axes:
            raise MeshError(
                f"conflicting sharding rules for logical axis {logical!r}: "
                f"{table[logical] or None} vs {axes or None}"
            )
        table[logical] = axes
    return table


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: LogicalRules, mesh: Mesh | None = None
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have the given logical names.

    A logical name with no rule is replicated. Mesh axes absent from ``mesh`` are dropped (so
    the LM's rules work on a data-only mesh). Using one mesh axis for two dimensions raises.
    """
    table = check_rules(rules)
    used: dict[str, str | None] = {}
    spec = []
    for name in logical_axes:
        axes = table.get(name, ()) if name is not None else ()
        if mesh is not None:
            axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        for a in axes:
            if a in used:
                raise MeshError(
                    f"mesh axis {a!r} would shard both logical axes {used[a]!r} and {name!r} "
                    f"of array with logical axes {tuple(logical_axes)}"
                )
            used[a] = name
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _fits(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drops sharding on dimensions the mesh axis size does not divide (they stay replicated)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        size = math.prod(mesh.shape[a] for a in axes)
        out.append(entry if axes and dim % size == 0 else None)
    return PartitionSpec(*out)


def shardings_from_logical(
    abstract_tree: Any, logical_tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES
) -> Any:
    """NamedShardings for a pytree of (abstract) arrays given their logical axis names.

    Args:
      abstract_tree: arrays or ShapeDtypeStructs (e.g. from ``jax.eval_shape``).
      logical_tree: same structure, each leaf a tuple of logical names (len == ndim).
    """

    def one(x, names):
        if len(names) != len(x.shape):
            raise MeshError(f"logical axes {names} do not match array shape {x.shape}")
        return NamedSharding(mesh, _fits(x.shape, logical_to_spec(names, rules, mesh), mesh))

    return jax.tree.map(one, abstract_tree, logical_tree, is_leaf=lambda t: isinstance(t, tuple))


def assert_params_sufficiently_sharded(
    params: Any, mesh: Mesh, *, min_size: int = 2**16, axes: Sequence[str] = ("model",)
) -> None:
    """Raises AssertionError naming every parameter of >= ``min_size`` elements that is not
    sharded over any of ``axes`` (only axes present in ``mesh`` with size > 1 count).

    (MaxText's ``assert_params_sufficiently_sharded``.) With no such axis there is nothing to
    check and the call returns.
    """
    active = [a for a in axes if a in mesh.shape and mesh.shape[a] > 1]
    if not active:
        return
    bad = []
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if np.size(x) < min_size:
            continue
        spec = getattr(getattr(x, "sharding", None), "spec", PartitionSpec())
        used = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
        if not used & set(active):
            bad.append(f"{jax.tree_util.keystr(path)} {tuple(np.shape(x))} spec={spec}")
    if bad:
        raise AssertionError(
            f"{len(bad)} large parameter(s) not sharded over {active}: " + "; ".join(bad)
        )


@domains(shape=Int(-1))
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axes of an experiment, overridable as ``--set mesh.shape=4,2``.

    ``shape`` may hold one -1 (all remaining devices).
    """

    axes: tuple[str, ...] = ("data", "model")
    shape: tuple[int, ...] = (-1, 1)

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"mesh axes {self.axes} and shape {self.shape} differ in length")
        repeated = sorted({a for a in self.axes if self.axes.count(a) > 1})
        if repeated:
            raise ValueError(f"mesh.axes={self.axes!r} names {', '.join(repeated)} twice; valid: "
                             "distinct axis names")
        if 0 in self.shape or self.shape.count(-1) > 1:
            raise ValueError(f"mesh.shape={self.shape!r}; valid: sizes >= 1 and at most one -1")

    def sizes(self, n_devices: int) -> dict[str, int]:
        """Axis sizes for ``n_devices``; MeshError when they cannot be formed."""
        return resolve_axis_sizes(dict(zip(self.axes, self.shape)), n_devices)

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        return make_mesh(dict(zip(self.axes, self.shape)), devices)


class MeshJit:
    """A jitted function whose every trace runs under ``jax.set_mesh(mesh)``.

    Kernel dispatch (``pallas_kernels.dispatch.partition_context``) reads the mesh context: under
    it, the Pallas kernels of the step (splash attention, fused log-probs) run per shard inside
    a ``shard_map`` over ``mesh`` instead of being left to the automatic partitioner (which
    Mosaic TPU refuses, so ``auto`` would fall back to XLA on every multi-device step), and a
    one-device role mesh on a multi-device host counts as one device. Calls, ``lower`` and
    ``trace`` all enter the context, so a compile-only caller sees the program a run executes.

    Attributes: ``mesh``; ``jitted`` (the ``jax.jit`` object)."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted = jitted
        self.mesh = mesh

    def _context(self):
        # jax.set_mesh is refused inside a trace (a MeshJit called from another jitted
        # function); there the abstract mesh alone is what kernel dispatch reads.
        from jax._src import core

        if not isinstance(core.trace_ctx.trace, core.EvalTrace):
            return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)
        return jax.set_mesh(self.mesh)

    def __call__(self, *args, **kwargs):
        with self._context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self._context():
            return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with self._context():
            return self.jitted.trace(*args, **kwargs)

    def __repr__(self):
        return f"MeshJit({self.jitted!r}, mesh={dict(self.mesh.shape)})"


def jit_on(mesh: Mesh, fun, **jit_kwargs) -> MeshJit:
    """``jax.jit(fun, **jit_kwargs)`` traced and run under ``jax.set_mesh(mesh)`` (see
    :class:`MeshJit`): how every jaxflow step that may use a Pallas kernel is built."""
    return MeshJit(jax.jit(fun, **jit_kwargs), mesh)
