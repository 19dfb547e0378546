"""kernel_footprints: every Pallas kernel compiled by the real XLA:TPU (Mosaic) and XLA:GPU
(Triton) compilers for abstract TPU v5e / v5p / v6e and NVIDIA H100 / H200 chips, with the
compiler's figures per chip: compiles or not, the smallest scoped VMEM limit (TPU) or opt-in shared
memory per block (GPU) that compiles (bisected), HBM temp, and the old block-footprint estimate.

    pip install -e ".[aot]"      # libtpu + the CUDA PJRT plugin (a separate environment)
    python -m jaxflow.run --exp=kernel_footprints --variant=quick

Nothing runs on an accelerator: ``pallas_kernels.targets`` compiles for abstract devices on this
CPU host. Without the compilers the run exits 2 naming the install command.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, SEED, domains

DESCRIPTION = ("Pallas kernels compiled for TPU v5e/v5p/v6e and H100/H200: compiles, smallest "
               "VMEM / shared memory, HBM temp per chip")
ENTRY = "jaxflow.main.kernel_footprints:main"
HEADLINES = "jaxflow.study.headlines_bench:kernel_footprints"
COMPILERS = ("tpu", "gpu")  # the runner checks these are installed and sets their environment
_SIZES = ("test", "production")
_CHIPS = ("v5e", "v5p", "v6e", "h100", "h200")
_KERNELS = ("fused_logprobs_fwd", "fused_logprobs_bwd", "embedding_bag_fwd", "embedding_bag_bwd",
            "sync_diff_compact", "sync_scatter_apply")


@domains(seed=SEED, vmem_step=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    sizes: tuple[str, ...] = _SIZES
    chips: tuple[str, ...] = _CHIPS
    kernels: tuple[str, ...] = ()  # () = every kernel
    bisect: bool = True  # the smallest VMEM limit / shared memory that compiles
    vmem_step: int = 2**20  # bisection step (TPU); GPU shared memory uses step / 64

    def __post_init__(self):
        for s in self.sizes:
            if s not in _SIZES:
                raise ValueError(f"size {s!r}; valid: {', '.join(_SIZES)}")
        for c in self.chips:
            if c not in _CHIPS:
                raise ValueError(f"chip {c!r}; valid: {', '.join(_CHIPS)}")
        for k in self.kernels:
            if k not in _KERNELS:
                raise ValueError(f"kernel {k!r}; valid: {', '.join(_KERNELS)}")
        if self.vmem_step < 2**16:
            raise ValueError(f"vmem_step {self.vmem_step}; valid: >= 65536 bytes")


# quick: every kernel at its test size on every chip, the smallest VMEM limit (256 KiB steps) /
# shared memory (4 KiB steps) searched, "<=" where the search's floor already compiles; default: both sizes
# (production compiles take 5-70 s
# each on 2 cores, so the search makes it a ~30-minute run).
get_config = Variants(quick=lambda: Config(sizes=("test",), vmem_step=2**18), default=Config)
VARIANTS = get_config.variants
