"""Generative recommendation over semantic IDs: RQ-KMeans IDs, a prefix trie for constrained
decoding, an encoder-decoder from the LM's blocks with Instruction-Guided Retrieval and the
Q2I loss (OxygenREC, 2025; TIGER, 2023), and an SA-GCPO RL stage.

Modules (one idea each):
  semantic_ids  RQ-KMeans semantic IDs with de-duplication codes
  trie          the prefix trie of the IDs; beam: constrained beam search / sampling / log-probs
  model, igr    the encoder-decoder GenRec and Instruction-Guided Retrieval
  losses        generation and Q2I losses; metrics: Recall / NDCG at k, popularity
  train         model inputs, the SFT step, ``fit``, constrained ``recommend``
  rl            the unified reward mapping and the SA-GCPO sample / update functions
  sasrec        the SASRec-style next-item baseline
  data          request layout, the synthetic generator, MovieLens
  setup         one seed's shared data, semantic IDs, trie and mesh (``GenRecSetup``)
  system        ``OxygenRECSystem``: one arm (SFT, then RL) as a ``jaxflow.system.System``
  study         the ``oxygenrec`` study: every system on one seed, the summary over seeds"""

from jaxflow.genrec.beam import beam_search, constrained_logp, constrained_sample
from jaxflow.genrec.losses import generation_loss, q2i_loss
from jaxflow.genrec.metrics import popularity_ranking, recall_ndcg_at_k
from jaxflow.genrec.model import GenRec, GenRecConfig
from jaxflow.genrec.rl import RLConfig, make_rl_fns, unified_reward
from jaxflow.genrec.sasrec import SASRecConfig, fit_sasrec, recommend_sasrec
from jaxflow.genrec.semantic_ids import SemanticIds, kmeans, rq_kmeans
from jaxflow.genrec.setup import GenRecSetup, build_setup, load_data, load_source, semantic_id_report
from jaxflow.genrec.study import SeedCell, run_seed, seed_cells, seed_record, summarize_seeds
from jaxflow.genrec.system import (
    ARMS,
    Arm,
    OxygenRECState,
    OxygenRECSystem,
    RLBatch,
    model_config,
    rl_batches,
    rl_step_fn,
    score,
    sft_batches,
    train_stage,
)
from jaxflow.genrec.train import SFTConfig, make_recommender, make_sft_step
from jaxflow.genrec.trie import Trie, build_trie

__all__ = [
    "SemanticIds", "kmeans", "rq_kmeans",
    "Trie", "build_trie", "beam_search", "constrained_logp", "constrained_sample",
    "GenRec", "GenRecConfig", "generation_loss", "q2i_loss",
    "SFTConfig", "make_sft_step", "make_recommender",
    "RLConfig", "make_rl_fns", "unified_reward",
    "GenRecSetup", "build_setup", "load_data", "load_source", "semantic_id_report",
    "Arm", "ARMS", "OxygenRECSystem", "OxygenRECState", "RLBatch", "model_config", "score",
    "sft_batches", "rl_batches", "rl_step_fn", "train_stage",
    "run_seed", "SeedCell", "seed_cells", "seed_record", "summarize_seeds",
    "SASRecConfig", "fit_sasrec", "recommend_sasrec",
    "popularity_ranking", "recall_ndcg_at_k",
]
