"""oxygenrec: instruction-following generative recommendation (OxygenREC, 2025) vs TIGER-style
semantic-ID generation, a SASRec-style next-item transformer and popularity, with ablations.

    python -m jaxflow.run --exp=oxygenrec --variant=quick     # ~2 min on 2 CPU cores, synthetic
    python -m jaxflow.run --exp=oxygenrec --variant=default   # all systems, 3 seeds, synthetic
    python -m jaxflow.run --exp=oxygenrec --variant=quick \\
        --set data.path=/tmp/recbole/dataset_example/ml-100k/ml-100k.inter   # RecBole's copy
    python -m jaxflow.run --exp=oxygenrec --variant=default --set data.path=/data/ml-100k/u.data
    python -m jaxflow.run --exp=oxygenrec --variant=default \\
        --set data.path=/data/ml-1m/ratings.dat --set data.items_path=/data/ml-1m/movies.dat

Real MovieLens-100k: ``pip download --no-deps recbole==1.2.1 -d /tmp/recbole`` and unzip the
wheel; ``recbole/dataset_example/ml-100k/ml-100k.inter`` holds the ratings and the
``ml-100k.item`` beside it the titles, years and genres (found automatically: ``<stem>.item``
beside the ratings file). MovieLens has its own terms: never commit the files.

Systems (``systems``): ``oxygenrec`` (instructions + IGR + Q2I + SA-GCPO RL), ablations
``oxygenrec_no_rl`` (its SFT model before RL), ``oxygenrec_no_igr`` (latest m items),
``oxygenrec_no_q2i``, ``oxygenrec_per_scenario`` (one model per scenario, the same total
steps), baselines ``tiger`` (semantic IDs, no instruction, no IGR, no Q2I),
``tiger_instruction`` (the same TIGER model fed the instruction tokens: ``tiger`` ->
``tiger_instruction`` is the instruction effect, ``tiger_instruction`` -> ``oxygenrec_no_rl``
the effect of IGR + Q2I), ``sasrec`` and ``popularity``. Summary keys: ``recall_at_10`` /
``ndcg_at_10`` maps system -> mean over seeds and scenarios' requests, ``per_scenario`` (metric
-> system -> scenario -> value), ``*_std`` over seeds, ``rl`` (before / after),
``semantic_ids`` (reconstruction error per level, utilisation, collision rate, k-means and
de-duplication levels, largest prefix group; seed 0) and ``semantic_ids_per_seed``.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, SEED, Real, domains
from jaxflow.genrec.data.synthetic import SyntheticGenRecConfig
from jaxflow.genrec.rl import RLConfig
from jaxflow.genrec.sasrec import SASRecConfig
from jaxflow.genrec.semantic_ids import DEDUP_MODES
from jaxflow.genrec.train import SFTConfig

DESCRIPTION = "OxygenREC instruction-following generative recommendation vs TIGER / SASRec / popularity"
ENTRY = "jaxflow.main.oxygenrec:main"
HEADLINES = "jaxflow.study.headlines_rl:oxygenrec"
SYSTEMS = ("oxygenrec", "oxygenrec_no_rl", "oxygenrec_no_igr", "oxygenrec_no_q2i",
           "oxygenrec_per_scenario", "tiger", "tiger_instruction", "sasrec", "popularity")


@domains(max_history=COUNT, max_train_per_user=COUNT, new_fraction=Real(0.0, 1.0, high_open=True))
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``path`` empty: the synthetic generator; else a MovieLens ratings file (u.data, RecBole
    .inter, ratings.dat) with ``items_path`` (default: ``<stem>.item``, u.item or movies.dat
    beside it; none found: co-occurrence embeddings)."""

    path: str = ""
    items_path: str = ""
    embeddings_path: str = ""
    max_history: int = 50
    max_train_per_user: int = 20
    new_fraction: float = 0.1
    synthetic: SyntheticGenRecConfig = SyntheticGenRecConfig()


@domains(levels=COUNT, width=COUNT, kmeans_iters=COUNT, d_model=COUNT, n_heads=COUNT, d_ff=COUNT,
         encoder_layers=COUNT, decoder_layers=COUNT, max_history=COUNT)
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """``levels`` k-means levels of ``width`` codes; ``dedup`` how items sharing codes get
    unique IDs (``auto``: collision-resolving last level, plus appended de-duplication codes
    only when a prefix group overflows it; ``tiger``: always one or more appended codes;
    ``off``: an overflow is an error). The model decodes levels + dedup levels codes."""

    levels: int = 3
    width: int = 32
    dedup: str = "auto"
    kmeans_iters: int = 25
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 128
    encoder_layers: int = 2
    decoder_layers: int = 2
    max_history: int = 8  # m: history slots in the encoder (IGR keeps m)


@domains(seed=SEED, seeds=COUNT, k=COUNT, beam_size=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    seeds: int = 1
    systems: tuple[str, ...] = ("oxygenrec", "tiger", "tiger_instruction", "popularity")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig(steps=300, batch_size=64)
    rl: RLConfig = RLConfig()
    sasrec: SASRecConfig = SASRecConfig()
    k: int = 10
    beam_size: int = 10

    def __post_init__(self):
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"systems {bad or '()'}; valid: {', '.join(SYSTEMS)}")
        if self.beam_size < self.k:
            raise ValueError(f"beam_size={self.beam_size} must be >= k={self.k}")
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds}: need >= 1")
        if self.model.dedup not in DEDUP_MODES:
            raise ValueError(f"model.dedup={self.model.dedup!r}: must be one of {DEDUP_MODES}")


def _default() -> Config:
    return Config(seeds=3, systems=SYSTEMS,
                  data=DataConfig(synthetic=SyntheticGenRecConfig(n_users=1500,
                                                                  test_users=400)),
                  sft=SFTConfig(steps=1500, batch_size=64),
                  rl=RLConfig(steps=150),
                  sasrec=SASRecConfig(steps=1500, max_len=51))


get_config = Variants(quick=Config, default=_default)
VARIANTS = get_config.variants
