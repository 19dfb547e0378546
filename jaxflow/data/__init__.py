"""Data without network access: built-in generators (character tokenizer, arithmetic corpus), and
your own rows for RL - local data files and reasoning-gym tasks (``sources``) and a checkpoint's
chat template rendered as transformers renders it (``chat_template``)."""

from jaxflow.data.arithmetic import AdditionTask, PackedBatch, eval_prompts, packed_batch
from jaxflow.data.chat_template import ChatTemplate
from jaxflow.data.sources import heldout_split, load_rows, reasoning_gym_rows
from jaxflow.data.tokenizer import (
    ARITHMETIC_ALPHABET,
    CharTokenizer,
    Tokenizer,
    TokenizerError,
    check_tokenizer,
)

__all__ = ["AdditionTask", "PackedBatch", "eval_prompts", "packed_batch", "ARITHMETIC_ALPHABET", "CharTokenizer",
           "ChatTemplate", "heldout_split", "load_rows", "reasoning_gym_rows",
           "Tokenizer", "TokenizerError", "check_tokenizer"]
