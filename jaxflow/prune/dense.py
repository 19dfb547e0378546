"""The dense capability model: the foundation LM trained on the capability mixture, cached.

The cache entry ``<cache_root>/calibration_dense-<hash>`` (hash of model, training recipe and
world seed) holds an orbax checkpoint of the params and ``summary.json``; it is built in a
temporary sibling and renamed into place, so a killed build never leaves half an entry and
repeated experiment runs reuse it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.cache import build_once, cache_entry, config_hash
from jaxflow.checkpoint import Checkpointer
from jaxflow.distributed import global_batch
from jaxflow.prune.capabilities import World, make_tokenizer, mixture_batch
from jaxflow.train.lm_state import LMFunctions, init_train_state, make_optimizer, make_train_step
from jaxflow.train.loop import mean_rows, run_steps

#: Share of each document source in the training mixture.
MIXTURE = {"math": 0.3, "code": 0.25, "general": 0.2, "commonsense": 0.15, "text": 0.1}


def dense_cache_dir(cache_root: str | pathlib.Path, recipe: Any) -> pathlib.Path:
    return cache_entry(cache_root, "calibration_dense", recipe)


def train_dense(fns: LMFunctions, model_cfg, optim_cfg, train_cfg, world: World, *, seed: int,
                log: Callable[[int, dict], None] | None = None) -> Any:
    """Trains the LM on the capability mixture (``jaxflow.train.loop.run_steps``); returns the
    params (pure dict). ``log(step, {"loss", "token_accuracy"})``: the means over every
    ``train_cfg.log_every`` steps and the last."""
    mesh = jax.tree.leaves(fns.param_shardings)[0].mesh
    tx = make_optimizer(optim_cfg, train_cfg.steps)
    state, shardings = init_train_state(fns, model_cfg, tx, jax.random.key(seed))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data" if "data" in mesh.shape else None))
    train_step = make_train_step(fns, tx, shardings, batch_sharding)
    tokenizer = make_tokenizer()

    def step_fn(state, step):
        host = mixture_batch(world, tokenizer, seed=seed, step=step, rows=train_cfg.batch_size,
                             seq_len=train_cfg.seq_len, weights=MIXTURE)
        return train_step(state, global_batch(host, batch_sharding))

    def summarize(window):
        return {k: v for k, v in mean_rows(window).items() if k in ("loss", "token_accuracy")}

    hooks = () if log is None else (lambda done, state, row: log(done, row),)
    result = run_steps(step_fn, state, steps=train_cfg.steps, summarize=summarize,
                       log_every=train_cfg.log_every if log is not None else train_cfg.steps,
                       hooks=hooks)
    return result.state.params


def load_or_train_dense(fns: LMFunctions, recipe: Any, cache_root: str | pathlib.Path, *,
                        train: Callable[[], Any], info: Callable[[str], None] = print) -> tuple[Any, pathlib.Path]:
    """(params, cache entry): restored from the cache, or ``train()``-ed and saved there."""
    target = dense_cache_dir(cache_root, recipe)
    trained = {}

    def build(tmp: pathlib.Path) -> None:
        info(f"dense model: training into {target} (cached for later runs)")
        trained["params"] = train()
        ckpt = Checkpointer(tmp / "checkpoints", async_save=False)
        ckpt.save(1, trained["params"], force=True)
        ckpt.close()
        (tmp / "summary.json").write_text(json.dumps({"recipe_hash": config_hash(recipe)}))

    if not build_once(target, build):
        info(f"dense model: reusing cache {target}")
        ckpt = Checkpointer(target / "checkpoints", async_save=False)
        params = ckpt.restore(ckpt.latest_step(), fns.abstract_params())
        ckpt.close()
        return params, target
    return trained["params"], target
