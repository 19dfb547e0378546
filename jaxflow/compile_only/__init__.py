"""Ahead-of-time compilation of an experiment for abstract chips (``--compile-only``).

* :mod:`~jaxflow.compile_only.program`: :class:`Program`, what a driver's
  ``compile_programs(config, meshes)`` returns, and the analytic FLOP counts;
* :mod:`~jaxflow.compile_only.target`: ``--target`` parsing and the target's devices;
* :mod:`~jaxflow.compile_only.resolve`: the layout rule (mesh, roles, model-parallel widths,
  gradient accumulation) of a model and global batch on a target, and its HBM estimate;
* :mod:`~jaxflow.compile_only.variants`: that rule applied to a ``full`` variant's config;
* :mod:`~jaxflow.compile_only.compile`: compiling the programs (two at a time, the persistent
  cache);
* :mod:`~jaxflow.compile_only.hlo`: collectives and kernels read from the compiled HLO;
* :mod:`~jaxflow.compile_only.report`: memory, cost, roofline, efficiency, compile seconds,
  kernel fall-backs, the table;
* :mod:`~jaxflow.compile_only.efficiency`: the roofline MFU bound and the MFU estimate
  (collectives against the chip's interconnect) of a train step, beside MaxText's published MFU;
* :mod:`~jaxflow.compile_only.cli`: the runner's ``--compile-only`` branch.
"""

from jaxflow.compile_only import resolve, variants
from jaxflow.compile_only.program import KINDS, Program, count_params, transformer_train_flops

__all__ = ["KINDS", "Program", "count_params", "efficiency", "resolve", "transformer_train_flops",
           "variants"]
