"""Build-once cache entries: a directory made in a temporary sibling and renamed into place.

A killed build never leaves half an entry, and two processes building the same entry at once
both end with one complete copy (the loser's rename fails and its copy is removed). Entries are
named by a hash of the recipe that built them, so a changed recipe builds a new one.

    entry = cache_entry(root, "lm_pretrain", config)
    build_once(entry, lambda tmp: train_into(tmp))
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from typing import Any, Callable


def config_hash(config: Any) -> str:
    """12 hex digits of sha256 over the config's canonical JSON."""
    from jaxflow.experiment import to_jsonable

    text = json.dumps(to_jsonable(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_entry(cache_root: str | pathlib.Path, kind: str, recipe: Any) -> pathlib.Path:
    """``<cache_root>/<kind>-<config_hash(recipe)>``."""
    return pathlib.Path(cache_root) / f"{kind}-{config_hash(recipe)}"


def build_once(target: pathlib.Path, build: Callable[[pathlib.Path], None], *,
               marker: str = "summary.json") -> bool:
    """Runs ``build(tmp)`` unless ``target/marker`` exists, then renames ``tmp`` to ``target``.

    ``build`` must write ``marker`` last. Returns True when this call built the entry.
    """
    target = pathlib.Path(target)
    if (target / marker).exists():
        return False
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    if not (tmp / marker).exists():
        raise RuntimeError(f"cache build of {target} wrote no {marker}")
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
    return True
