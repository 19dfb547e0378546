"""Warm start for RL: an ``lm_pretrain`` checkpoint, trained on the fly and cached.

The cache key is a hash of the whole ``lm_pretrain`` config, so any change to the pretraining
recipe (model, data, steps, seed) builds a new entry; a clean clone builds it once. The entry
is the ordinary ``lm_pretrain`` run directory (``config.json``, ``metrics.jsonl``,
``summary.json``, ``checkpoints/``), written to a temporary sibling and renamed into place so
a killed build never leaves a half-written cache entry.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from jaxflow.cache import build_once, cache_entry, config_hash  # noqa: F401  (config_hash: API)
from jaxflow.checkpoint import Checkpointer
from jaxflow.experiment import RunContext
from jaxflow.train.lm_state import LMFunctions, make_optimizer
from jaxflow.train.state import TrainState

#: The cache entries' format: v2 holds a ``jaxflow.train.state.TrainState`` checkpoint (v1, a
#: ``{"params", "opt_state", "step"}`` dict, is not read: such entries are rebuilt).
CACHE_KIND = "lm_pretrain-v2"


def cache_dir(pretrain_config: Any, cache_root: str | pathlib.Path, *,
              devices: int | None = None) -> pathlib.Path:
    """The entry for ``pretrain_config`` pretrained on ``devices`` (default: every device
    present). The resolved mesh is part of the recipe: the data-parallel gradient sums run in
    another order on another mesh, so the same config trains other params on 1 and on 2
    devices, and an entry must not serve a run whose mesh would not have built it."""
    import jax

    n = jax.device_count() if devices is None else int(devices)
    mesh = pretrain_config.mesh.sizes(n)
    return cache_entry(cache_root, CACHE_KIND, {"config": pretrain_config, "mesh": mesh})


def build_pretrain_cache(pretrain_config: Any, cache_root: str | pathlib.Path,
                         *, log=print) -> pathlib.Path:
    """Runs ``lm_pretrain`` with ``pretrain_config`` unless its cache entry exists; returns
    the entry's directory."""
    from jaxflow.models.decode_kernel import DecodeKernel
    from jaxflow.rollout.paged_attention import paged_attention
    from jaxflow.train.pretrain import pretrain

    target = cache_dir(pretrain_config, cache_root)

    def build(tmp: pathlib.Path) -> None:
        log(f"warm start: training lm_pretrain into {target} (cached for later runs)")
        ctx = RunContext(name="lm_pretrain", variant="warm_start", out_dir=tmp)
        try:
            ctx.write_json("config.json", {"experiment": "lm_pretrain", "variant": "warm_start",
                                           "config": pretrain_config})
            summary = pretrain(pretrain_config, ctx, decode_kernel=DecodeKernel(paged_attention))
        finally:
            ctx.close()
        ctx.write_json("summary.json", summary)

    build_once(target, build)
    return target


def load_pretrained_params(pretrain_config: Any, cache_root: str | pathlib.Path,
                           fns: LMFunctions, *, log=print) -> tuple[Any, dict]:
    """(params laid out with ``fns.param_shardings``, the pretraining summary), building the
    cache entry first when needed. ``fns`` must describe ``pretrain_config.model``."""
    entry = build_pretrain_cache(pretrain_config, cache_root, log=log)
    summary = json.loads((entry / "summary.json").read_text())
    ckpt = Checkpointer(entry / "checkpoints", async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"warm-start cache {entry} has no checkpoint; delete it to rebuild")
    tx = make_optimizer(pretrain_config.optim, pretrain_config.train.steps)
    state = ckpt.restore(step, TrainState.abstract(tx, fns.abstract_params(), fns.param_shardings))
    ckpt.close()
    log(f"warm start: {entry.name} step {step}, held-out accuracy "
        f"{summary.get('heldout_accuracy')}")
    return state.params, summary
