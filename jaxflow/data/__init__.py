"""Built-in data generators (no network): character tokenizer, arithmetic corpus."""

from jaxflow.data.arithmetic import AdditionTask, PackedBatch, eval_prompts, packed_batch
from jaxflow.data.tokenizer import ARITHMETIC_ALPHABET, CharTokenizer

__all__ = ["AdditionTask", "PackedBatch", "eval_prompts", "packed_batch", "ARITHMETIC_ALPHABET", "CharTokenizer"]
