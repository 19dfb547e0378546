"""decoratelm: rate, tag and edit a corpus with a distilled student, select by rating and tag
balance, train an LM on each selection (DecorateLM, Zhao et al., EMNLP 2024).

    python -m jaxflow.run --exp=decoratelm --variant=quick
    python -m jaxflow.run --exp=decoratelm --variant=default
    python -m jaxflow.run --exp=decoratelm --variant=quick --set selection.token_budget=40000

Arms, from the same token budget: random subset; rating-selected; rating + tag-balanced; the
latter with the student's edits; the latter with the teacher's own labels and edits. Held-out
perplexity on real passages never selected (pydoc_data.topics + stdlib docstrings) and on a
clean multi-topic probe set, over ``seeds`` seeds.
"""

from __future__ import annotations

import dataclasses

from jaxflow.config import Variants
from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, OPEN_UNIT, POSITIVE, SEED, Real, domains
from jaxflow.decorate.selection import DEFAULT_COEFS
from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.train.lm_state import OptimConfig

DESCRIPTION = ("DecorateLM: teacher annotations -> distilled rate/tag/edit student -> decorated "
               "corpus -> rating + tag-balanced selection; LM perplexity per selection arm")
ENTRY = "jaxflow.main.decoratelm:main"
HEADLINES = "jaxflow.study.headlines_rl:decoratelm"


@domains(max_chars=COUNT, n_real=COUNT, n_heldout_real=COUNT, n_template=COUNT, level1_skew=NON_NEGATIVE,
         n_degraded=COUNT0, noise_levels=Real(0.0, 1.0, low_open=True), n_noise=COUNT0, n_probe=COUNT0)
@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    max_chars: int = 128          # documents are chunked to at most this many characters
    n_real: int = 2400            # real passages in the training pool
    n_heldout_real: int = 300     # real passages held out for perplexity (never selectable)
    n_template: int = 2400
    level1_skew: float = 1.0      # Zipf exponent of the templated level-1 topic distribution
    n_degraded: int = 1000
    noise_levels: tuple[float, ...] = (0.15, 0.3, 0.6)
    n_noise: int = 400
    n_probe: int = 168            # clean multi-topic probe texts, uniform over categories

    def __post_init__(self):
        for name in ("n_real", "n_heldout_real", "n_template", "n_probe"):
            if getattr(self, name) < 1:
                raise ValueError(f"corpus.{name}={getattr(self, name)}: must be >= 1")
        if not all(0 < x <= 1 for x in self.noise_levels):
            raise ValueError(f"corpus.noise_levels={self.noise_levels}: each in (0, 1]")


@domains(n_annotate=COUNT, heldout_fraction=OPEN_UNIT, min_comparisons=COUNT, judge_noise=NON_NEGATIVE,
         l2=NON_NEGATIVE)
@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    n_annotate: int = 2000        # texts the teacher annotates for distillation
    heldout_fraction: float = 0.2  # of those, held out for the agreement table
    min_comparisons: int = 6
    judge_noise: float = 0.05
    l2: float = 0.1


@domains(d_model=COUNT, n_layers=COUNT, n_heads=COUNT, d_ff=COUNT, steps=COUNT, batch_size=COUNT, lr=POSITIVE,
         edit_nonkeep_weight=NON_NEGATIVE)
@dataclasses.dataclass(frozen=True)
class StudentConfig:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 192
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    edit_nonkeep_weight: float = 3.0


@domains(batch_size=COUNT, checkpoint_every=COUNT)
@dataclasses.dataclass(frozen=True)
class DecorateConfig:
    batch_size: int = 64
    checkpoint_every: int = 8


@domains(token_budget=COUNT, coefs=NON_NEGATIVE, tag_exponent=NON_NEGATIVE)
@dataclasses.dataclass(frozen=True)
class SelectionConfig:
    token_budget: int = 200_000
    coefs: tuple[float, ...] = DEFAULT_COEFS
    tag_exponent: float = 0.5


@domains(steps=COUNT, batch_size=COUNT, seq_len=COUNT, eval_batch_size=COUNT)
@dataclasses.dataclass(frozen=True)
class LMConfig:
    model: TransformerConfig = TransformerConfig(
        vocab_size=99, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=192, max_seq_len=160)
    steps: int = 600
    batch_size: int = 32
    seq_len: int = 128
    eval_batch_size: int = 64


@domains(n_items=COUNT, comparisons=COUNT, spread=POSITIVE, repeats=COUNT)
@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    n_items: int = 1000
    comparisons: tuple[int, ...] = (3, 6, 12, 24)
    spread: float = 1.0           # std of the true Bradley-Terry scores
    repeats: int = 5


@domains(seed=SEED, seeds=COUNT)
@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    seeds: int = 3
    corpus: CorpusConfig = CorpusConfig()
    teacher: TeacherConfig = TeacherConfig()
    student: StudentConfig = StudentConfig()
    decorate: DecorateConfig = DecorateConfig()
    selection: SelectionConfig = SelectionConfig()
    lm: LMConfig = LMConfig()
    optim: OptimConfig = OptimConfig(lr=3e-3, warmup_steps=50)
    recovery: RecoveryConfig = RecoveryConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds}: must be >= 1")


def _quick() -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        corpus=dataclasses.replace(base.corpus, n_real=1000, n_heldout_real=120, n_template=1000,
                                   n_degraded=400, n_noise=160, n_probe=84),
        teacher=dataclasses.replace(base.teacher, n_annotate=700),
        student=dataclasses.replace(base.student, d_model=32, d_ff=64, steps=150),
        selection=dataclasses.replace(base.selection, token_budget=40_000),
        lm=dataclasses.replace(
            base.lm, model=dataclasses.replace(base.lm.model, d_model=48, n_layers=2, d_ff=128),
            steps=120, batch_size=16, seq_len=64, eval_batch_size=64),
        optim=dataclasses.replace(base.optim, warmup_steps=10),
        recovery=dataclasses.replace(base.recovery, n_items=300, repeats=2),
    )


get_config = Variants(quick=_quick, default=Config)
VARIANTS = get_config.variants
