"""One jitted program an experiment would run, described for ahead-of-time compilation.

An experiment's driver module that supports ``--compile-only`` defines ``compile_programs(config,
meshes) -> list[Program]`` (:class:`jaxflow.contract.CompilesAhead`): ``meshes`` are the
experiment's own meshes (``jaxflow.run_meshes.resolve_meshes``) built from the target's
abstract devices, and each ``Program`` holds the *same* jitted function the run executes (built
by the same builder: ``make_train_step``, ``compiled_functions``, ...) with
``jax.ShapeDtypeStruct`` arguments that carry their shardings. Nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: Program kinds: "train" steps get an MFU estimate from ``model_flops``.
KINDS = ("train", "forward", "sample", "sync", "embedding")


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted program and its abstract arguments.

    name: "trainer/update" style, unique within the experiment; fn: the jitted callable the
    run executes (``jax.jit`` or :class:`jaxflow.mesh.MeshJit`; anything with ``.lower``);
    args / kwargs: ``jax.ShapeDtypeStruct`` pytrees with shardings on ``mesh``'s devices;
    mesh: the mesh the program runs on (lowered under ``jax.set_mesh(mesh)``); kind: one of
    :data:`KINDS`; model_flops: analytic FLOPs of one call (training: 6 x params x tokens +
    attention) for the MFU estimate, since ``cost_analysis`` counts Pallas calls as ~0;
    model_bytes: analytic HBM bytes of one call over all devices (weights, KV cache read),
    for the roofline's memory term, since ``cost_analysis`` counts a Pallas call's reads as ~0
    and a loop body once; tokens: tokens (or rows) one call processes, for throughput; note: the sharding stated
    in words ("data 8 x model 8, TP over heads / mlp / vocab"); compiled / seconds / fallbacks:
    set by :func:`compile_ahead` when a later program's arguments are this one's outputs."""

    name: str
    fn: Callable
    args: tuple
    mesh: Mesh
    kind: str = "train"
    kwargs: dict = dataclasses.field(default_factory=dict)
    model_flops: float | None = None
    tokens: int | None = None
    model_bytes: float | None = None
    note: str = ""
    # FLOPs one call runs beyond model_flops (remat's recomputed forward): in the roofline's
    # compute term, not in MFU's numerator (a scanned step's compiler count sees its loop body
    # once, so only this analytic figure carries the recompute there)
    recompute_flops: float | None = None
    # an executable already compiled for the chip (:func:`compile_ahead`) and its
    # {"lower": s, "compile": s}: the compile step reuses it instead of compiling again
    compiled: Any = None
    seconds: dict | None = None
    # the kernels whose "auto" dispatch fell back to XLA while compile_ahead traced it
    fallbacks: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Program {self.name!r}: kind={self.kind!r}; valid: {KINDS}")
        if not hasattr(self.fn, "lower"):
            raise TypeError(f"Program {self.name!r}: fn must be jitted (has no .lower)")


def transformer_train_flops(n_params: float, tokens: int, *, n_layers: int, seq_len: int,
                            d_attn: int) -> float:
    """Training FLOPs of one step of a decoder: 6 x params x tokens (forward + backward of the
    weight matmuls) + causal attention 6 x layers x tokens x seq_len x d_attn (QK^T and AV,
    forward 2 x 2 x T^2 x d / 2 for the causal half, times 3 with the backward).

    d_attn: n_heads x head_dim."""
    return 6.0 * n_params * tokens + 6.0 * n_layers * tokens * seq_len * d_attn


def count_params(tree: Any) -> int:
    """Elements in a pytree of arrays / ShapeDtypeStructs."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def sds(shape, dtype, sharding) -> Any:
    """``jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)``."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def compile_ahead(program: Program, fallback: Callable[[Any], Any] | None = None
                  ) -> tuple[Program, Any]:
    """Compiles ``program`` now (under ``jax.set_mesh(program.mesh)``, as the compile step
    would) and returns it holding the executable, with its outputs as ``jax.ShapeDtypeStruct``
    in the shardings the compiler gave them: what the run's next program receives (pi_old
    statistics, gradient sums, the decode carry, vjp residuals). jax 0.10's persistent cache
    cannot read deviceless executables back, so the compile step reuses this one instead of
    compiling twice. When the compiler refuses (e.g. the program does not fit), the program
    comes back uncompiled (the compile step reports the refusal) and the outputs are
    ``fallback(eval_shape outputs)`` (default: replicated on the program's mesh)."""
    from pallas_kernels import dispatch

    start = time.perf_counter()
    try:
        with jax.set_mesh(program.mesh), dispatch.recording_fallbacks() as fallbacks:
            lowered = program.fn.lower(*program.args, **program.kwargs)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
    except Exception:  # noqa: BLE001 - compile_program reports it
        with jax.set_mesh(program.mesh):
            shapes = jax.eval_shape(program.fn, *program.args, **program.kwargs)
        rep = NamedSharding(program.mesh, PartitionSpec())
        default = jax.tree.map(lambda x: sds(x.shape, x.dtype, rep), shapes)
        return program, (default if fallback is None else fallback(shapes))
    seconds = {"lower": lowered_at - start, "compile": time.perf_counter() - lowered_at}
    outputs = jax.tree.map(lambda i, s: sds(i.shape, i.dtype, s), compiled.out_info,
                           compiled.output_shardings)
    return dataclasses.replace(program, compiled=compiled, seconds=seconds,
                               fallbacks=tuple(fallbacks)), outputs


def mesh_note(mesh: Mesh, tp: str = "TP over heads / kv heads / mlp / vocab",
              dp: str = "data parallel") -> str:
    """The sharding in words: "data 8 x model 8 (TP over ...)" / "data 8 (data parallel)"."""
    words = tp if dict(mesh.shape).get("model", 1) > 1 else dp
    return " x ".join(f"{k} {v}" for k, v in mesh.shape.items()) + f" ({words})"
