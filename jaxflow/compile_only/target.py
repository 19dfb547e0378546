"""``--target=T``: the abstract chips a ``--compile-only`` run compiles for.

Forms (chips from :data:`pallas_kernels.targets.CHIPS`):

  tpu-CHIP:TOPOLOGY   a TPU slice as libtpu names it: ``tpu-v5e:2x2``, ``tpu-v5p:4x4x4``,
                      ``tpu-v6e:4x4`` (CHIP one of ``targets.TPU_CHIPS``; the topology goes to
                      libtpu as ``CHIP:TOPOLOGY``, so any layout it accepts works)
  gpu-CHIPxN          N GPUs of one host: ``gpu-h100x8``, ``gpu-h200x8`` (CHIP one of
                      ``targets.GPU_CHIPS``; the XLA:GPU topology ``1x1xN``)

Parsing needs no compiler; :meth:`Target.devices` does (libtpu / the CUDA PJRT plugin).
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxflow.errors import UserError
from pallas_kernels import targets

_TPU = re.compile(r"tpu-(?P<chip>[a-z0-9]+):(?P<topology>[A-Za-z0-9x_\-]+)")
_GPU = re.compile(r"gpu-(?P<chip>[a-z0-9]+?)x(?P<n>[0-9]+)")
_DIMS = re.compile(r"[0-9]+(x[0-9]+)*")


class TargetError(UserError, ValueError):
    """A ``--target`` the runner cannot compile for; the message names the valid forms."""


def valid_forms() -> str:
    """The accepted ``--target`` forms, with examples, as one phrase."""
    tpu = ", ".join(f"tpu-{c}:TOPOLOGY" for c in targets.TPU_CHIPS)
    gpu = ", ".join(f"gpu-{c}xN" for c in targets.GPU_CHIPS)
    return (f"{tpu} (a topology libtpu accepts, e.g. tpu-v5e:2x2, tpu-v5p:4x4x4, tpu-v6e:4x4), "
            f"{gpu} (N GPUs of one host, e.g. gpu-h100x8)")


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed ``--target``.

    text: as given; chip: its :class:`pallas_kernels.targets.Chip`; topology: what the compiler
    is asked for (TPU "v5p:4x4x4", GPU "1x1x8"); n_devices: the chips that topology names (the
    product of its dimensions; None for a TPU topology given by another kind of name, known
    once :meth:`devices` has asked libtpu)."""

    text: str
    chip: targets.Chip
    topology: str
    n_devices: int | None

    @property
    def host_block(self) -> int:
        """What :func:`jaxflow.mesh.host_block` finds on :meth:`devices`, without the compiler:
        on a TPU slice of several hosts (libtpu's deviceless hosts hold 2 x 2 chips of the
        first two dimensions) the first dimension times 2 (v5p:4x4x4: 8, v6e:16x16: 32); 1 on
        one host, on a GPU target, or for a topology given by name."""
        shape = self.topology.partition(":")[2]  # TPU "v5p:4x4x4"; GPU "1x1xN" has no chip
        if self.platform != "tpu" or not _DIMS.fullmatch(shape):
            return 1
        dims = [int(d) for d in shape.split("x")]
        return dims[0] * 2 if math.prod(dims) > 4 and len(dims) > 1 else 1

    @property
    def platform(self) -> str:
        """ "tpu" or "gpu"."""
        return self.chip.platform

    def devices(self) -> list:
        """The target's abstract devices (``targets.devices``) in id order, as ``jax.devices()``
        lists a real slice's: a sub-mesh of the first k devices (a role's, an engine's) is the
        one a run on the slice builds, ids 0 .. k-1. (libtpu's topology order differs, and its
        deviceless compile refuses some of its prefixes: on v6e:16x16 the first 8, ids 0, 1,
        16, 17, 2, 3, 18, 19, fail with "RET_CHECK failure ... Unexpected device_id 16"; every
        id-ordered block of 8-128 compiles.) Nothing runs on them.

        Raises:
          targets.CompilerMissing: the platform's compiler is not installed here.
          TargetError: the compiler refuses the topology (its first line quoted) or gives
            another number of devices than the topology names.
        """
        targets.require(self.platform)
        try:
            devices = targets.devices(self.chip.name, self.topology)
        except Exception as err:  # noqa: BLE001 - libtpu / XLA:GPU refusing the topology
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise TargetError(f"--target {self.text!r}: the {self.platform.upper()} compiler "
                              f"does not accept topology {self.topology!r} ({first[:200]}); "
                              f"valid: {valid_forms()}") from None
        if self.n_devices is not None and len(devices) != self.n_devices:
            raise TargetError(f"--target {self.text!r}: topology {self.topology!r} gave "
                              f"{len(devices)} devices, not {self.n_devices}")
        return sorted(devices, key=lambda d: d.id)


def parse_target(text: str) -> Target:
    """The :class:`Target` ``text`` names (see the module docstring for the forms).

    Raises:
      TargetError: an unknown form or chip, or a GPU count < 1, naming the valid forms.
    """
    if (m := _TPU.fullmatch(text)) is not None:
        name, topology = m["chip"], m["topology"]
        if name not in targets.TPU_CHIPS:
            raise TargetError(f"--target {text!r}: unknown TPU chip {name!r}; valid chips: "
                              f"{', '.join(targets.TPU_CHIPS)}; valid forms: {valid_forms()}")
        n = math.prod(int(d) for d in topology.split("x")) if _DIMS.fullmatch(topology) else None
        if n == 0:
            raise TargetError(f"--target {text!r}: topology {topology!r} has no chips; "
                              f"valid: {valid_forms()}")
        return Target(text, targets.CHIPS[name], f"{name}:{topology}", n)
    if (m := _GPU.fullmatch(text)) is not None:
        name, n = m["chip"], int(m["n"])
        if name not in targets.GPU_CHIPS:
            raise TargetError(f"--target {text!r}: unknown GPU chip {name!r}; valid chips: "
                              f"{', '.join(targets.GPU_CHIPS)}; valid forms: {valid_forms()}")
        if n < 1:
            raise TargetError(f"--target {text!r}: {n} GPUs; valid: gpu-{name}xN with N >= 1")
        return Target(text, targets.CHIPS[name], f"1x1x{n}", n)
    raise TargetError(f"--target {text!r}; valid: {valid_forms()}")
