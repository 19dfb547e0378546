"""Generative recommendation over semantic IDs: RQ-KMeans IDs, a prefix trie for constrained
decoding, an encoder-decoder from the LM's blocks with Instruction-Guided Retrieval and the
Q2I loss (OxygenREC, 2025; TIGER, 2023), and an SA-GCPO RL stage."""

from jaxflow.genrec.beam import beam_search, constrained_logp, constrained_sample
from jaxflow.genrec.losses import generation_loss, q2i_loss
from jaxflow.genrec.metrics import popularity_ranking, recall_ndcg_at_k
from jaxflow.genrec.model import GenRec, GenRecConfig
from jaxflow.genrec.rl import RLConfig, rl_stage
from jaxflow.genrec.sasrec import SASRecConfig, fit_sasrec, recommend_sasrec
from jaxflow.genrec.semantic_ids import SemanticIds, kmeans, rq_kmeans
from jaxflow.genrec.train import SFTConfig, make_recommender, make_sft_step
from jaxflow.genrec.trie import Trie, build_trie

__all__ = [
    "SemanticIds", "kmeans", "rq_kmeans",
    "Trie", "build_trie", "beam_search", "constrained_logp", "constrained_sample",
    "GenRec", "GenRecConfig", "generation_loss", "q2i_loss",
    "SFTConfig", "make_sft_step", "make_recommender",
    "RLConfig", "rl_stage",
    "SASRecConfig", "fit_sasrec", "recommend_sasrec",
    "popularity_ranking", "recall_ndcg_at_k",
]
