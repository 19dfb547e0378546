"""sync_cost_model: projected full vs sparse weight-sync wire time for 8B / 70B / 671B models at
400 Gb/s, 25 Gb/s and 1 Gb/s from the ratios a sparse_sync run measured.

    python -m jaxflow.run --exp=sparse_sync --variant=quick          # the measurement first
    python -m jaxflow.run --exp=sync_cost_model --variant=quick      # seconds
    python -m jaxflow.run --exp=sync_cost_model --set source=runs/sparse_sync/<run>
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import SEED, domains

DESCRIPTION = "Projected sync wire time (8B/70B/671B x 400/25/1 Gb/s) from measured ratios"
ENTRY = "jaxflow.main.sync_cost_model:main"
HEADLINES = "jaxflow.study.headlines_rl:sync_cost_model"


@domains(seed=SEED)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    source: str = ""  # a sparse_sync run dir or summary.json; "" = newest under runs_root
    runs_root: str = "runs"
    codecs: tuple[str, ...] = ("coo", "gap", "entropy", "auto")
    models: tuple = (("8B", 8e9), ("70B", 70e9), ("671B", 671e9))
    networks: tuple = (("400Gbps", 400.0), ("25Gbps", 25.0), ("1Gbps", 1.0))


# every variant is the same study (it reads a run, or lowers at fixed sizes)
get_config = Variants(quick=Config, default=Config, full=Config)
VARIANTS = get_config.variants
