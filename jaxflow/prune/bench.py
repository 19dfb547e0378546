"""SparseGPT against llmcompressor's ``sparsify_weight`` (the ``bench_sparsegpt`` experiment's measurement).

Both prune the same weights with the same calibration activations (each side accumulates its
own Hessian from them; the damping is relative to mean(diag H), so the normalisation of H does
not matter). Timed: the pruning call (Cholesky of the inverse + blocked OBS), measured side by
side A B A B after a warm-up that includes compilation, ``pairs`` pairs per layer; speedup =
torch time / jaxflow time. Error: ||W X - W_pruned X||_F^2 / ||W X||_F^2 on HELD-OUT activations.

The reference is the optional ``bench`` extra (torch==2.13.0 + llmcompressor 0.14). Only its
``sgpt_sparsify.py`` is loaded (by file path: it needs torch, transformers and loguru, not the
package's heavy top level). Missing extra -> ``ReferenceUnavailable`` with the install line.

Known difference: llmcompressor prunes ``int(size * s) + 1`` weights per unstructured block
(``score <= sorted[int(size * s)]``); jaxflow prunes exactly ``round(size * s)``. So the error
comparison (``rel_error_vs_torch``) also runs jaxflow at the fraction that prunes the reference's
count (same algorithm, same number of zeros); the as-configured comparison is reported too
(``rel_error_vs_torch_own_count``). N:M counts agree exactly.
"""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.experiment import MissingExtraError
from jaxflow.prune.sparsegpt import reconstruction_error, sparsegpt_prune

__all__ = ["INSTALL_HINT", "ReferenceUnavailable", "layer_data", "load_reference", "measure_cell",
           "reference_prune"]

INSTALL_HINT = ("bench_sparsegpt compares against llmcompressor's SparseGPT, an optional extra: "
                "pip install -e '.[bench]'  (torch==2.13.0, llmcompressor==0.14.*)")


class ReferenceUnavailable(MissingExtraError):
    """The optional ``bench`` extra is missing (the message has the install command)."""


def load_reference():
    """(torch, sgpt_sparsify module) from the installed llmcompressor wheel."""
    try:
        import torch
    except ImportError as e:
        raise ReferenceUnavailable(f"{INSTALL_HINT}; torch is not installed ({e})") from None
    spec = importlib.util.find_spec("llmcompressor")
    if spec is None or not spec.submodule_search_locations:
        raise ReferenceUnavailable(f"{INSTALL_HINT}; llmcompressor is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "modifiers/pruning/sparsegpt/sgpt_sparsify.py"
    if not path.exists():
        raise ReferenceUnavailable(f"{INSTALL_HINT}; {path} is missing (llmcompressor version?)")
    module_spec = importlib.util.spec_from_file_location("_llmcompressor_sgpt_sparsify", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ImportError as e:
        raise ReferenceUnavailable(f"{INSTALL_HINT}; loading {path} failed: {e}") from None
    return torch, module


def layer_data(rows: int, cols: int, tokens: int, *, seed: int):
    """Weights [rows, cols] and calibration / held-out inputs [tokens, cols] with correlated,
    unevenly scaled features (a few outlier channels, like LLM activations)."""
    rng = np.random.default_rng([seed, rows, cols])
    scales = np.exp(rng.normal(0.0, 1.0, cols))
    mix = rng.normal(size=(cols, cols)) / np.sqrt(cols)
    base = np.eye(cols) * 0.5 + mix

    def inputs(n):
        return ((rng.normal(size=(n, cols)) @ base) * scales).astype(np.float32)

    weight = (rng.normal(size=(rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return weight, inputs(tokens), inputs(tokens)


def reference_prune(torch, ref, weight, x, pattern, block_size: int, damp: float):
    """A no-argument callable running llmcompressor's ``sparsify_weight`` on ``weight`` [rows,
    cols] with the Hessian of ``x`` [tokens, cols] (accumulated once, cloned per call); it
    returns the pruned torch weight [rows, cols]."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight))
    h = ref.make_empty_hessian(layer)
    with torch.no_grad():
        h, _ = ref.accumulate_hessian(torch.from_numpy(x).reshape(-1, 128, x.shape[1]), layer, h, 0)

    def run():
        with torch.no_grad():
            _, w = ref.sparsify_weight(layer, {layer: h.clone()}, pattern.fraction, pattern.n, pattern.m,
                                       block_size, damp, False)
        return w.detach()

    return run


def measure_cell(torch, ref, weight, x_cal, x_held, h, pattern, *, block_size: int, damp: float,
                 warmup: int, pairs: int) -> tuple[dict, list[float]]:
    """One layer at one sparsity: times jaxflow's and the reference's pruning A B A B (``pairs``
    pairs after ``warmup`` rounds) and compares their held-out reconstruction errors.

    weight [rows, cols]; x_cal / x_held [tokens, cols]; h = :func:`hessian_from_inputs` (x_cal).
    Returns (the report row, the per-pair speedups torch / jaxflow)."""
    rows, cols = weight.shape

    def ours():
        return jax.block_until_ready(sparsegpt_prune(jnp.asarray(weight), h, pattern,
                                                     block_size=block_size, damp=damp)[0])

    theirs = reference_prune(torch, ref, weight, x_cal, pattern, block_size, damp)
    for _ in range(warmup):
        ours(), theirs()
    t_ours, t_ref = [], []
    for _ in range(pairs):
        start = time.perf_counter()
        ours()
        t_ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs()
        t_ref.append(time.perf_counter() - start)
    ratios = [b / a for a, b in zip(t_ours, t_ref)]
    err_own = reconstruction_error(weight, ours(), x_held)
    err_ref = reconstruction_error(weight, theirs().numpy(), x_held)
    err_ours = err_own
    if not pattern.is_nm:  # prune the reference's int(size * s) + 1 per block
        size = rows * min(block_size, cols)
        matched = (int(size * pattern.fraction) + 1) / size
        err_ours = reconstruction_error(weight, sparsegpt_prune(
            jnp.asarray(weight), h, matched, block_size=block_size, damp=damp)[0], x_held)
    rel = abs(err_ours - err_ref) / err_ref
    rel_own = abs(err_own - err_ref) / err_ref
    row = {"sparsity": str(pattern), "jaxflow_s": statistics.median(t_ours),
           "torch_s": statistics.median(t_ref), "speedup": statistics.median(ratios),
           "speedup_min": min(ratios), "speedup_max": max(ratios),
           "error_jaxflow": err_ours, "error_torch": err_ref, "rel_error": rel,
           "error_jaxflow_own_count": err_own, "rel_error_own_count": rel_own}
    return row, ratios
