"""Data for generative recommendation: the request layout, a synthetic multi-scenario
generator with known intents, and MovieLens readers for user-given files."""

from jaxflow.genrec.data.movielens import load_movielens, read_items, read_ratings
from jaxflow.genrec.data.requests import SCENARIOS, RecData, Requests, instruction_tokens, pad_histories
from jaxflow.genrec.data.synthetic import SyntheticGenRecConfig, generate

__all__ = [
    "SCENARIOS", "RecData", "Requests", "instruction_tokens", "pad_histories",
    "SyntheticGenRecConfig", "generate",
    "load_movielens", "read_items", "read_ratings",
]
