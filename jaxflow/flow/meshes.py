"""FlowTrain's meshes: the monolithic mesh and, per allocator candidate, the encoder / backbone
sub-meshes (disjoint on several devices, shared on one).

  split_meshes       the encoder and backbone sub-meshes of one split E+B
  split_candidates   the (encoder, backbone) splits the allocator may profile
  resolve_meshes     every mesh a run builds (``--dry-run``, ``--compile-only``)
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import Mesh

from jaxflow.flow.allocator import ParallelConfig, candidates
from jaxflow.mesh import MeshError, experiment_devices, make_mesh, process_role_meshes


def split_meshes(encoder: int, backbone: int, model: int = 1,
                 devices: Sequence | None = None) -> dict[str, Mesh]:
    """Disjoint sub-meshes ``{"encoder": Mesh, "backbone": Mesh}``: encoder data-parallel
    (``data=encoder``); backbone data x model (tensor) parallel (``data=backbone // model``,
    ``model``). On a single device both sides share it (colocated).

    Across processes (:func:`jaxflow.mesh.process_role_meshes`) each process gives
    ``encoder / P`` of its devices to the encoder and ``backbone / P`` to the backbone, so both
    sub-meshes span every process alike: each process launches every program of both sides in
    the same order, the hand-offs (encoder output to the host, d loss / d embeddings back) are
    gathers on the side's own devices followed by host-to-device puts, and tensor-parallel
    groups stay within a process when ``model`` divides ``backbone / P``. (A side on one
    process's devices would need MPMD, programs launched by only some processes, and a
    cross-process activation transfer, which JAX's CPU and GPU runtimes do not do between
    different device sets.) One process: the first ``encoder`` devices, then ``backbone``.

    Raises:
      MeshError: across P processes, ``encoder`` or ``backbone`` is not a multiple of P.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) == 1:
        mesh = make_mesh({"data": 1}, devices)
        return {"encoder": mesh, "backbone": mesh}
    return process_role_meshes({"encoder": encoder, "backbone": backbone},
                               axes={"encoder": {"data": encoder},
                                     "backbone": {"data": backbone // model, "model": model}},
                               devices=devices)


def split_candidates(config, n_dev: int, processes: int = 1
                     ) -> tuple[list[ParallelConfig], list[ParallelConfig]]:
    """(encoder, backbone) allocator candidates on ``n_dev`` devices: the configured encoder
    counts that leave the backbone a device; on one device the single colocated pair. Across
    ``processes`` processes only the counts that both sides split evenly over them
    (:func:`split_meshes`).

    Raises:
      MeshError: no configured encoder count fits ``n_dev`` devices (and ``processes``).
    """
    if n_dev == 1 and not config.flow.encoder_devices:
        return [ParallelConfig(1)], [ParallelConfig(1)]

    def even(e: int) -> bool:
        return e % processes == 0 and (n_dev - e) % processes == 0

    if config.flow.encoder_devices:
        e = config.flow.encoder_devices
        if not even(e):
            raise MeshError(f"flow.encoder_devices={e} across {processes} processes x "
                            f"{n_dev // processes} devices; valid: a multiple of {processes} "
                            f"in 1..{n_dev - 1}")
        return candidates(n_dev, [e], (1,))
    fit = [e for e in config.allocator.encoder_candidates if 1 <= e < n_dev and even(e)]
    if not fit:
        per = f" split evenly over {processes} processes" if processes > 1 else ""
        raise MeshError(f"allocator.encoder_candidates={config.allocator.encoder_candidates}: none "
                        f"leaves the backbone a device of {n_dev}{per}; valid: counts in "
                        f"1..{n_dev - 1}" + (f" that are multiples of {processes}" if per else ""))
    return candidates(n_dev, fit, config.allocator.backbone_model_degrees)


def candidate_splits(config, n_dev: int, processes: int = 1
                     ) -> list[tuple[ParallelConfig, ParallelConfig]]:
    """The (encoder, backbone) pairs of :func:`split_candidates` that together use the
    ``n_dev`` devices (on one device: the colocated pair)."""
    enc_c, bb_c = split_candidates(config, n_dev, processes)
    return [(e, b) for e in enc_c for b in bb_c if n_dev == 1 or b.devices == n_dev - e.devices]


def resolve_meshes(config, devices: Sequence | None = None) -> dict[str, Mesh]:
    """Every mesh the experiment builds on ``devices`` (default ``jax.devices()``; the first
    ``config.devices`` when set): ``monolithic`` (``config.mesh``) and, per allocator candidate
    split ``E+B`` (``B`` = data x model), ``encoder/E+B`` and ``backbone/E+B``."""
    have = experiment_devices(config.devices, devices)
    out = {"monolithic": config.mesh.make(have)}
    for e, b in candidate_splits(config, len(have)):
        meshes = split_meshes(e.devices, b.devices, b.model, have)
        out[f"encoder/{e}+{b}"] = meshes["encoder"]
        out[f"backbone/{e}+{b}"] = meshes["backbone"]
    return out
