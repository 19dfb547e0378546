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
from jaxflow.data.tokenizer import Tokenizer, pad_token_lists
from jaxflow.data.worked_addition import WorkedAdditionTask
from jaxflow.errors import DataError


@runtime_checkable
class Task(Protocol):
    """What the GRPO trainer needs from a verifiable task (all text, no tokens).

    Lengths: ``max_prompt_len`` / ``max_completion_len`` are in characters, which are tokens
    for the character tokenizer; a task over a subword tokenizer also exposes
    ``max_prompt_tokens`` (and ``max_completion_tokens`` for held-out greedy decoding), which
    the rollout worker then uses instead (:func:`prompt_tokens`).

    Two optional methods (not part of the protocol's check; used when present):

    ``score_batch(prompts, completions, truncated) -> np.ndarray [B] float32``
      scores one generation batch at once (``truncated`` [B] bool: the completion hit
      ``max_new_tokens`` without an EOS); used instead of per-sample ``score``.
    ``prompts_at(start, n, seed) -> list[str]``
      the prompts at positions ``[start, start + n)`` of a seeded epoch-ordered stream; the
      trainer then draws rollout r's prompts at ``start = r * prompts_per_gen_batch``, so the
      position lives in the checkpointed rollout counter (resume continues mid-epoch).
    """

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


def check_task(task: object) -> Task:
    """``task`` itself when it satisfies :class:`Task`; else a one-line TypeError naming the
    missing members."""
    if isinstance(task, Task):
        return task
    members = ("name", "max_prompt_len", "max_completion_len", "prompts", "heldout_prompts", "score")
    missing = [m for m in members if not hasattr(task, m)]
    raise TypeError(f"task {type(task).__name__} is not a jaxflow.rl.tasks.Task (missing: "
                    f"{', '.join(missing) or '?'}); valid: an object with name, max_prompt_len, "
                    "max_completion_len, prompts(rng, n), heldout_prompts(n) and score(prompt, "
                    "completion), e.g. make_task('addition') or jaxflow.rl.dataset_task.DatasetTask")


def prompt_tokens(task: Task) -> int:
    """The longest prompt in tokens, BOS excluded: ``task.max_prompt_tokens`` when the task has
    it, else ``max_prompt_len`` (characters = tokens of the character tokenizer)."""
    return int(getattr(task, "max_prompt_tokens", None) or task.max_prompt_len)


def completion_tokens(task: Task) -> int:
    """The longest correct answer in tokens, EOS excluded: ``task.max_completion_tokens`` when
    the task has it, else ``max_completion_len``."""
    return int(getattr(task, "max_completion_tokens", None) or task.max_completion_len)


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

TRUNCATED_REWARDS = ("zero", "score")


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str],
                   length: int) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] prompt`` token rows (no BOS when ``tokenizer.bos_id`` is None) right-padded with
    ``pad_id`` to ``length``: (tokens [B, length] int32, lengths [B] int32). A prompt longer
    than ``length`` tokens is a DataError naming it."""
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    rows = [head + list(tokenizer.encode(p)) for p in prompts]
    for text, row in zip(prompts, rows):
        if len(row) > length:
            raise DataError(f"prompt {text[:60]!r} is {len(row)} tokens (BOS included); valid: at "
                            f"most {length} (the task's max_prompt_tokens + BOS)")
    return pad_token_lists(rows, tokenizer.pad_id, length)


def stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Every id that ends a response: ``tokenizer.eos_ids`` (``(eos_id,)`` for a tokenizer that
    predates the :class:`jaxflow.data.tokenizer.Tokenizer` protocol)."""
    ids = getattr(tokenizer, "eos_ids", None)
    return tuple(int(i) for i in ids) if ids else (int(tokenizer.eos_id),)


def split_completion(tokenizer: Tokenizer, tokens: Sequence[int]) -> tuple[list[int], bool]:
    """(the ids before the first id of ``tokenizer.eos_ids``, True when there is none, i.e. the
    response hit ``max_new_tokens`` and was truncated)."""
    ids = [int(t) for t in tokens]
    stops = set(stop_ids(tokenizer))
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i], False
    return ids, True


def completion_text(tokenizer: Tokenizer, tokens: Sequence[int]) -> str | None:
    """The completion's text up to its first EOS (any of ``eos_ids``), or None when it never
    emitted one."""
    ids, truncated = split_completion(tokenizer, tokens)
    return None if truncated else tokenizer.decode(ids)


def score_completions(task: Task, tokenizer: Tokenizer, prompts: Sequence[str],
                      tokens: np.ndarray, *, truncated_reward: str = "zero") -> np.ndarray:
    """Rewards [B] float32 of :func:`score_with_truncation` (by default 0 for a completion
    without an EOS)."""
    return score_with_truncation(task, tokenizer, prompts, tokens,
                                 truncated_reward=truncated_reward)[0]


def score_with_truncation(task: Task, tokenizer: Tokenizer, prompts: Sequence[str],
                          tokens: np.ndarray, *, truncated_reward: str = "zero"
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Scores one batch of completions (token rows [B, N]).

    ``truncated_reward``: "zero" - a row without an EOS (it hit ``max_new_tokens``) scores 0;
    "score" - it is decoded and scored like the others (verl's behaviour). With
    ``task.score_batch`` the whole batch is scored in one call (truncated rows included, then
    zeroed under "zero"); otherwise ``task.score`` per row.

    Returns:
      (rewards [B] float32, truncated [B] bool).
    """
    if truncated_reward not in TRUNCATED_REWARDS:
        raise ValueError(f"truncated_reward={truncated_reward!r}; valid: {TRUNCATED_REWARDS}")
    split = [split_completion(tokenizer, row) for row in tokens]
    truncated = np.array([cut for _, cut in split], dtype=bool).reshape(len(prompts))
    if hasattr(task, "score_batch"):
        texts = [tokenizer.decode(ids) for ids, _ in split]
        rewards = np.asarray(task.score_batch(list(prompts), texts, truncated), np.float32)
        if rewards.shape != (len(prompts),):
            raise ValueError(f"{type(task).__name__}.score_batch returned shape {rewards.shape}; "
                             f"valid: ({len(prompts)},), one reward per completion")
        if truncated_reward == "zero":
            rewards = np.where(truncated, np.float32(0), rewards).astype(np.float32)
        return rewards, truncated
    rewards = np.zeros(len(prompts), np.float32)
    for i, (prompt, (ids, cut)) in enumerate(zip(prompts, split)):
        if not cut or truncated_reward == "score":
            rewards[i] = task.score(prompt, tokenizer.decode(ids))
    return rewards, truncated
