"""Built-in verifiable corpus: multi-digit addition, with a deterministic held-out split.

A problem is ``"a+b="`` -> ``"c"`` with ``c = a + b``; operands have 1..``max_digits`` digits
(the digit count is drawn uniformly first, so short and long problems are equally common).
Pairs with ``hash(a, b) % heldout_mod == 0`` are held out: never in training batches, used for
exact-match evaluation. Training batches are a pure function of ``(seed, step)`` so a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.data.tokenizer import CharTokenizer


def heldout_mask(a: np.ndarray, b: np.ndarray, mod: int, shift: int) -> np.ndarray:
    """bool [n]: the pairs (a, b) in the held-out split, ``hash(a, b) >> shift`` divisible by
    ``mod`` (a task picks its own ``shift``, so two tasks' splits are independent)."""
    h = (a.astype(np.uint64) * np.uint64(1_000_003) + b.astype(np.uint64)) * np.uint64(2654435761)
    return (h >> np.uint64(shift)) % np.uint64(mod) == 0


def sample_split(rng: np.random.Generator, n: int, draw, is_heldout, heldout_mod: int,
                 heldout: bool) -> tuple[np.ndarray, np.ndarray]:
    """``n`` operand pairs from one split by rejection: ``draw(rng, m)`` -> (a [m], b [m]),
    ``is_heldout(a, b)`` -> bool [m]; draws ``heldout_mod`` times more for the held-out split
    (about 1 / heldout_mod of all pairs)."""
    out_a, out_b, have = [], [], 0
    while have < n:
        m = max(2 * (n - have), 16) * (heldout_mod if heldout else 1)
        a, b = draw(rng, m)
        keep = is_heldout(a, b) == heldout
        out_a.append(a[keep]), out_b.append(b[keep])
        have += int(keep.sum())
    return np.concatenate(out_a)[:n], np.concatenate(out_b)[:n]


@dataclasses.dataclass(frozen=True)
class AdditionTask:
    """Multi-digit addition as a verifiable task (prompt source + ``score``)."""

    max_digits: int = 3
    heldout_mod: int = 20

    def __post_init__(self):
        if not 1 <= self.max_digits <= 9:
            raise ValueError(f"max_digits={self.max_digits!r}; valid: 1..9")
        if self.heldout_mod < 2:
            raise ValueError(f"heldout_mod={self.heldout_mod!r}; valid: >= 2")

    def _is_heldout(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return heldout_mask(a, b, self.heldout_mod, 7)

    def _operands(self, rng: np.random.Generator, n: int) -> np.ndarray:
        digits = rng.integers(1, self.max_digits + 1, size=n)
        low = np.where(digits == 1, 0, 10 ** (digits - 1))
        return rng.integers(low, 10**digits)

    def sample(self, rng: np.random.Generator, n: int, *, heldout: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``n`` operand pairs (a [n], b [n]) from the training or the held-out split."""
        return sample_split(rng, n, lambda r, m: (self._operands(r, m), self._operands(r, m)),
                            self._is_heldout, self.heldout_mod, heldout)

    @staticmethod
    def prompt(a: int, b: int) -> str:
        """The prompt text of ``a + b``: ``"a+b="``."""
        return f"{int(a)}+{int(b)}="

    @staticmethod
    def answer(a: int, b: int) -> str:
        """The answer text of ``a + b``: the decimal sum."""
        return str(int(a) + int(b))

    def score(self, prompt: str, completion: str) -> float:
        """1.0 when ``completion`` (text after '=') is exactly the sum, else 0.0."""
        lhs = prompt.rstrip("=")
        try:
            a, b = (int(x) for x in lhs.split("+"))
        except ValueError:
            return 0.0
        return float(completion.strip() == self.answer(a, b))

    @property
    def max_prompt_len(self) -> int:
        """Characters of the longest prompt (two ``max_digits`` operands, ``+`` and ``=``)."""
        return 2 * self.max_digits + 2

    @property
    def max_answer_len(self) -> int:
        """Characters of the longest answer (``max_digits + 1``)."""
        return self.max_digits + 1


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A packed LM batch; every array is [B, L].

    tokens: int32 inputs; targets: int32 next tokens; loss_mask: float32 (1 where the target
    is scored); segment_ids: int32 (0 = padding); positions: int32 per-segment positions.
    """

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


def packed_batch(
    task: AdditionTask,
    tokenizer: CharTokenizer,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    loss_on: str = "answer",
) -> PackedBatch:
    """Training batch ``step``: problems packed greedily into rows of ``seq_len`` tokens.

    Each problem is ``[BOS] a+b= c [EOS]`` (``c`` = ``task.demonstration(a, b)`` when the task
    has one, e.g. worked addition, else ``task.answer(a, b)``); inputs/targets are the sequence shifted by one.
    ``loss_on="answer"`` scores only the answer digits and EOS, ``"all"`` every target.
    """
    if loss_on not in ("answer", "all"):
        raise ValueError(f"loss_on={loss_on!r}; valid: 'answer', 'all'")
    rng = np.random.default_rng([seed, step, 0x5EED])
    shape = (batch_size, seq_len)
    tokens = np.full(shape, tokenizer.pad_id, np.int32)
    targets = np.full(shape, tokenizer.pad_id, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    per_row = seq_len // (task.max_prompt_len + task.max_answer_len + 1) + 4
    a_all, b_all = task.sample(rng, batch_size * per_row)
    k = 0
    for row in range(batch_size):
        col, seg = 0, 1
        while k < len(a_all):
            a, b = a_all[k], b_all[k]
            prompt = tokenizer.encode(task.prompt(a, b), bos=True)
            target = (task.demonstration(a, b) if hasattr(task, "demonstration")
                      else task.answer(a, b))
            seq = prompt + tokenizer.encode(target, eos=True)
            n = len(seq) - 1
            if col + n > seq_len:
                break
            k += 1
            sl = slice(col, col + n)
            tokens[row, sl] = seq[:-1]
            targets[row, sl] = seq[1:]
            scored = np.arange(1, len(seq)) >= (len(prompt) if loss_on == "answer" else 1)
            loss_mask[row, sl] = scored
            segment_ids[row, sl] = seg
            positions[row, sl] = np.arange(n)
            col += n
            seg += 1
    return PackedBatch(tokens, targets, loss_mask, segment_ids, positions)


def eval_prompts(
    task: AdditionTask, tokenizer: CharTokenizer, *, n: int, seed: int = 1234
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``n`` held-out problems: (prompts [n, P] right-padded, prompt_lengths [n], answers)."""
    rng = np.random.default_rng([seed, 0xE7A1])
    a, b = task.sample(rng, n, heldout=True)
    seqs = [tokenizer.encode(task.prompt(x, y), bos=True) for x, y in zip(a, b)]
    prompts, lengths = tokenizer.pad_batch(seqs, task.max_prompt_len + 1)
    return prompts, lengths, [task.answer(x, y) for x, y in zip(a, b)]
