"""calibration_tradeoffs: capability-decomposed retention of SparseGPT under 10 calibration sources.

    python -m jaxflow.run --exp=calibration_tradeoffs --variant=quick
    python -m jaxflow.run --exp=calibration_tradeoffs --variant=default
    python -m jaxflow.run --exp=calibration_tradeoffs --variant=quick --set draws=2

The dense capability model is trained on the fly and cached under ``cache_root``
(runs/_cache/calibration_dense-<hash>); later runs with the same recipe reuse it.
quick: small model, 6 sources, sparsity 0.6 only, ONE calibration draw (no spread), 1-digit math.
default: three model sizes (``sizes``: xs, s, default) x all 10 sources x {0.5, 0.6, 0.7, 2:4}
x 3 draws, Spearman intervals by bootstrap over sources and the sign stability across sizes
and sparsities.

A user's checkpoint, tasks and corpora (formats in ``jaxflow.prune.task_files``)::

    python -m jaxflow.run --exp=calibration_tradeoffs --variant=quick \
        --set model.hf_path=DIR --set eval_files=math.jsonl,qa.jsonl \
        --set calibration_files=web.txt,code.txt --set sources=web,code,mix,random
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jaxflow.config import Variants, require_positive
from jaxflow.config_domains import COUNT, SEED, domains
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.prune.calibration import FILE_MODE_SOURCES, SOURCES, CalibrationConfig
from jaxflow.prune.masks import parse_sparsity
from jaxflow.prune.sequential import METHODS
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = "SparseGPT calibration sources x sparsity: per-capability retention and perplexity correlation"
ENTRY = "jaxflow.main.calibration_tradeoffs:main"
HEADLINES = "jaxflow.study.headlines_rl:calibration_tradeoffs"
#: Keys of fields only some experiments read (jaxflow.config_reads) that this one reads.
READS = ("model.hf_path",)


@domains(steps=COUNT, batch_size=COUNT, seq_len=COUNT, log_every=COUNT)
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 32
    seq_len: int = 128
    log_every: int = 50

    def __post_init__(self):
        require_positive(self, "steps", "batch_size", "seq_len", "log_every")


_DEFAULT_MODEL = TransformerConfig(
    vocab_size=60, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, d_ff=384, max_seq_len=128)
#: The study's model sizes, smallest to the default one (``sizes`` names them).
MODEL_SIZES = {
    "xs": dataclasses.replace(_DEFAULT_MODEL, d_model=64, n_layers=2, d_ff=192),
    "s": dataclasses.replace(_DEFAULT_MODEL, d_model=96, n_layers=2, d_ff=256),
    "default": _DEFAULT_MODEL,
    "l": dataclasses.replace(_DEFAULT_MODEL, d_model=192, n_layers=6, d_ff=512),  # full only
}


@domains(seed=SEED, world_seed=SEED, math_digits=COUNT, draws=COUNT, block_size=COUNT, calib_batch_rows=COUNT,
         eval_examples=COUNT, bootstrap=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    world_seed: int = 0
    math_digits: int = 2
    model: TransformerConfig = _DEFAULT_MODEL
    # Model sizes of the study (names in MODEL_SIZES); () studies ``model`` alone.
    sizes: tuple[str, ...] = ()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=100)
    mesh: MeshConfig = MeshConfig()
    calibration: CalibrationConfig = CalibrationConfig(rows=32, seq_len=128)
    sources: tuple[str, ...] = SOURCES
    sparsities: tuple[str, ...] = ("0.5", "0.6", "0.7", "2:4")
    draws: int = 3
    method: str = "sparsegpt"
    block_size: int = 128
    calib_batch_rows: int = 16
    eval_examples: int = 128
    cache_root: str = "runs/_cache"
    bootstrap: int = 2000  # bootstrap replicates (over sources) of each Spearman interval
    # User-given files (jaxflow.prune.task_files): evaluation tasks (JSONL) replacing the
    # synthetic capabilities, calibration corpora (.txt / .jsonl) whose stems become sources.
    eval_files: tuple[str, ...] = ()
    calibration_files: tuple[str, ...] = ()

    def __post_init__(self):
        if self.calibration_files:
            stems = tuple(pathlib.Path(p).stem for p in self.calibration_files)
            valid = (*stems, *(s for s in FILE_MODE_SOURCES if s not in stems))
        else:
            valid = SOURCES
        for s in self.sources:
            if s not in valid:
                raise ValueError(f"sources: {s!r} is not a calibration source; valid: {', '.join(valid)}")
        for path in (*self.eval_files, *self.calibration_files):
            if not os.path.isfile(path):
                raise ValueError(f"{path!r}: no such file (eval_files / calibration_files)")
        for name in self.sizes:
            if name not in MODEL_SIZES:
                raise ValueError(f"sizes: {name!r}; valid: {', '.join(MODEL_SIZES)}")
        if self.sizes and self.model.hf_path:
            raise ValueError(f"sizes={','.join(self.sizes)} with model.hf_path: a checkpoint "
                             "has one size; set sizes= (empty)")
        if self.bootstrap < 100:
            raise ValueError(f"bootstrap={self.bootstrap}: must be >= 100")
        for s in self.sparsities:
            parse_sparsity(s)
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; valid: {', '.join(METHODS)}")
        if self.draws < 1:
            raise ValueError(f"draws={self.draws}: must be >= 1")

    def size_models(self) -> list[tuple[str, TransformerConfig]]:
        """[(size name, model config)] smallest first; [("model", model)] without sizes."""
        if not self.sizes:
            return [("model", self.model)]
        return [(name, MODEL_SIZES[name]) for name in self.sizes]


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        model=TransformerConfig(vocab_size=60, d_model=96, n_layers=2, n_heads=4, n_kv_heads=4,
                                d_ff=256, max_seq_len=128),
        train=TrainConfig(steps=500, batch_size=32, seq_len=96, log_every=50),
        calibration=CalibrationConfig(rows=16, seq_len=96, igsp_pool_factor=2),
        sources=("math", "code", "text", "random", "mix", "igsp"),
        sparsities=("0.6",), draws=1, eval_examples=64, math_digits=1)


def _full() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        model=MODEL_SIZES["l"], sizes=tuple(MODEL_SIZES),
        train=dataclasses.replace(base.train, steps=4000),
        calibration=CalibrationConfig(rows=64, seq_len=128), draws=5, eval_examples=256)


def _default() -> Config:
    return Config(sizes=("xs", "s", "default"))


get_config = Variants(quick=_quick, default=_default, full=_full)
VARIANTS = get_config.variants
