"""Verifiable tasks for RL: a prompt source plus ``score(prompt, completion) -> reward``.

A task hands out prompt *strings* (training split from an RNG, a fixed held-out set) and
scores a completion string (the text the model wrote after the prompt, EOS excluded). The
tokenizer side lives in :func:`encode_prompts` / :func:`score_completions` so a user task
only deals with text. Built in:

  addition   ``"a+b="`` -> ``"c"``: wraps :class:`jaxflow.data.arithmetic.AdditionTask`, with the
             exact prompt format and held-out split of ``lm_pretrain`` (so its checkpoints are
             a warm start).
  countdown  ``"3,5,7:22="`` -> any expression over a sub-multiset of the numbers with
             ``+ - * / ( )`` that evaluates to the target, e.g. ``"3*5+7"``.
  worked_addition  ``"374+258="`` -> ``"4+8=12,7+5+1=13,3+2+1=6:632"``: the column working
             and the sum (:class:`jaxflow.data.worked_addition.WorkedAdditionTask`, 25-31
             characters at 3 digits); reward 1 only when every column and the sum are right.

Example::

    task = make_task("countdown")
    prompts = task.prompts(np.random.default_rng(0), 4)
    task.score(prompts[0], "3*5+7")
"""

from __future__ import annotations

import dataclasses
import fractions
import zlib
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from jaxflow.data.arithmetic import AdditionTask
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.data.worked_addition import WorkedAdditionTask


@runtime_checkable
class Task(Protocol):
    """What the GRPO trainer needs from a verifiable task (all text, no tokens)."""

    name: str

    @property
    def max_prompt_len(self) -> int:  # characters, BOS excluded
        """Characters of the longest prompt, BOS excluded."""
        ...

    @property
    def max_completion_len(self) -> int:  # characters of a correct answer, EOS excluded
        """Characters of the longest correct answer, EOS excluded."""
        ...

    def prompts(self, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` training prompts drawn with ``rng`` (never from the held-out set)."""
        ...

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        """A fixed list of ``n`` held-out prompts (a pure function of ``seed``)."""
        ...

    def score(self, prompt: str, completion: str) -> float:
        """Reward in [0, 1] of ``completion`` (text after the prompt, EOS excluded)."""
        ...


# ----------------------------------------------------------------------------- addition


@dataclasses.dataclass(frozen=True)
class AdditionRLTask:
    """Multi-digit addition; same prompts, answers and held-out split as ``lm_pretrain``."""

    max_digits: int = 2
    heldout_mod: int = 20
    name: str = "addition"

    def __post_init__(self):
        self._base  # noqa: B018  (AdditionTask checks max_digits 1..9 and heldout_mod >= 2)

    @property
    def _base(self) -> AdditionTask:
        return AdditionTask(max_digits=self.max_digits, heldout_mod=self.heldout_mod)

    @property
    def max_prompt_len(self) -> int:
        """Characters of the longest prompt."""
        return self._base.max_prompt_len

    @property
    def max_completion_len(self) -> int:
        """Characters of the longest correct answer."""
        return self._base.max_answer_len

    def prompts(self, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` training prompts drawn with ``rng``."""
        a, b = self._base.sample(rng, n)
        return [AdditionTask.prompt(x, y) for x, y in zip(a, b)]

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        # The same draw as jaxflow.data.arithmetic.eval_prompts (lm_pretrain's evaluator).
        """``n`` held-out prompts (the draw of ``jaxflow.data.arithmetic.eval_prompts``)."""
        a, b = self._base.sample(np.random.default_rng([seed, 0xE7A1]), n, heldout=True)
        return [AdditionTask.prompt(x, y) for x, y in zip(a, b)]

    def score(self, prompt: str, completion: str) -> float:
        """1.0 for the exact sum, else 0.0."""
        return self._base.score(prompt, completion)


# ----------------------------------------------------------------------------- countdown


class _ExprError(ValueError):
    pass


def evaluate_expression(text: str) -> tuple[fractions.Fraction, list[int]]:
    """Value and operand list of an arithmetic expression over non-negative integers.

    Grammar: ``expr = term (('+'|'-') term)*; term = factor (('*'|'/') factor)*;
    factor = number | '(' expr ')'``. Exact rational arithmetic; raises ValueError on a
    syntax error or a division by zero. Never calls ``eval``.
    """
    pos = 0
    numbers: list[int] = []

    def peek():
        return text[pos] if pos < len(text) else ""

    def factor():
        nonlocal pos
        if peek() == "(":
            pos += 1
            value = expr()
            if peek() != ")":
                raise _ExprError(f"expected ')' at {pos} in {text!r}")
            pos += 1
            return value
        start = pos
        while peek().isdigit():
            pos += 1
        if start == pos:
            raise _ExprError(f"expected a number at {pos} in {text!r}")
        numbers.append(int(text[start:pos]))
        return fractions.Fraction(numbers[-1])

    def term():
        nonlocal pos
        value = factor()
        while peek() in ("*", "/") and peek():
            op = peek()
            pos += 1
            rhs = factor()
            if op == "/" and rhs == 0:
                raise _ExprError(f"division by zero in {text!r}")
            value = value * rhs if op == "*" else value / rhs
        return value

    def expr():
        nonlocal pos
        value = term()
        while peek() in ("+", "-") and peek():
            op = peek()
            pos += 1
            rhs = term()
            value = value + rhs if op == "+" else value - rhs
        return value

    value = expr()
    if pos != len(text):
        raise _ExprError(f"unexpected {text[pos]!r} at {pos} in {text!r}")
    return value, numbers


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """Countdown-style arithmetic: reach ``target`` using each given number at most once.

    Prompts are ``"n1,n2,...:target="`` with ``num_count`` numbers in [1, max_number]; the
    target is made by a random expression over all of them (+, -, *), kept when it lies in
    [0, max_target]. Held out: prompts whose crc32 is divisible by ``heldout_mod``.
    """

    num_count: int = 3
    max_number: int = 9
    max_target: int = 99
    heldout_mod: int = 10
    name: str = "countdown"

    def __post_init__(self):
        if not 2 <= self.num_count <= 4:
            raise ValueError(f"num_count={self.num_count!r}; valid: 2..4")
        if not 1 <= self.max_number <= 99:
            raise ValueError(f"max_number={self.max_number!r}; valid: 1..99")
        if self.heldout_mod < 2:
            raise ValueError(f"heldout_mod={self.heldout_mod!r}; valid: >= 2")

    @property
    def max_prompt_len(self) -> int:
        """Characters of the longest prompt (the numbers and the target)."""
        n = len(str(self.max_number))
        return self.num_count * (n + 1) + len(str(self.max_target)) + 1

    @property
    def max_completion_len(self) -> int:
        # numbers, operators and one pair of parentheses around each operator
        """Characters of the longest expression using every number once."""
        return self.num_count * len(str(self.max_number)) + 3 * (self.num_count - 1)

    def _is_heldout(self, prompt: str) -> bool:
        return zlib.crc32(prompt.encode()) % self.heldout_mod == 0

    def _draw(self, rng: np.random.Generator) -> str:
        while True:
            nums = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.num_count)]
            order = [nums[i] for i in rng.permutation(self.num_count)]
            value = order[0]
            for x in order[1:]:
                op = int(rng.integers(3))
                value = value + x if op == 0 else value - x if op == 1 else value * x
            if 0 <= value <= self.max_target:
                return ",".join(map(str, nums)) + f":{value}="

    def _sample(self, rng: np.random.Generator, n: int, heldout: bool) -> list[str]:
        out = []
        while len(out) < n:
            prompt = self._draw(rng)
            if self._is_heldout(prompt) == heldout:
                out.append(prompt)
        return out

    def prompts(self, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` training prompts drawn with ``rng``."""
        return self._sample(rng, n, heldout=False)

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        """``n`` held-out prompts (a fixed seed, disjoint from training)."""
        return self._sample(np.random.default_rng([seed, 0xC0DE]), n, heldout=True)

    def score(self, prompt: str, completion: str) -> float:
        """1.0 iff ``completion`` is an expression over a sub-multiset of the numbers whose
        value is the target; 0.0 otherwise (malformed prompt or expression included)."""
        try:
            head, target = prompt.rstrip("=").split(":")
            given = [int(x) for x in head.split(",")]
            value, used = evaluate_expression(completion.strip())
        except ValueError:
            return 0.0
        pool = list(given)
        for x in used:
            if x not in pool:
                return 0.0
            pool.remove(x)
        return float(value == int(target))


TASKS = ("addition", "countdown", "worked_addition")


def make_task(name: str, **kwargs) -> Task:
    """A built-in task by name (``TASKS``); kwargs go to its dataclass."""
    if name == "addition":
        return AdditionRLTask(**kwargs)
    if name == "countdown":
        return CountdownTask(**kwargs)
    if name == "worked_addition":
        return WorkedAdditionTask(**kwargs)
    raise ValueError(f"unknown task {name!r}; valid: {TASKS}")


# ----------------------------------------------------------------------------- tokens


def encode_prompts(tokenizer: CharTokenizer, prompts: Sequence[str],
                   length: int) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] prompt`` token rows right-padded to ``length``: (tokens [B, length] int32,
    lengths [B] int32)."""
    return tokenizer.pad_batch([tokenizer.encode(p, bos=True) for p in prompts], length)


def completion_text(tokenizer: CharTokenizer, tokens: Sequence[int]) -> str | None:
    """The completion's text up to its first EOS, or None when it never emitted EOS."""
    ids = [int(t) for t in tokens]
    if tokenizer.eos_id not in ids:
        return None
    return tokenizer.decode(ids)


def score_completions(task: Task, tokenizer: CharTokenizer, prompts: Sequence[str],
                      tokens: np.ndarray) -> np.ndarray:
    """Rewards [B] float32: ``task.score`` of each completion; 0 without an EOS (truncated)."""
    rewards = np.zeros(len(prompts), np.float32)
    for i, (prompt, row) in enumerate(zip(prompts, tokens)):
        text = completion_text(tokenizer, row)
        if text is not None:
            rewards[i] = task.score(prompt, text)
    return rewards
