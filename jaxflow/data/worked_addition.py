"""Addition with the working written out: column sums from the right, carries, then the answer.

A problem is ``"374+258="``; its one correct completion writes every column (least
significant first) as ``x+y=s`` for the first and ``x+y+c=s`` for the others (``c`` the carry
out of the previous column, 0 or 1, always written), separated by commas, then ``":"`` and
the sum::

    374+258=4+8=12,7+5+1=13,3+2+1=6:632

The pretraining corpus may mix in a ``sloppy_rate`` fraction of demonstrations that drop every
carry (:meth:`WorkedAdditionTask.demonstration`), so a model trained on it carries only part of
the time, a systematic error that outcome-verified RL can remove.

Both operands have exactly ``digits`` digits, so a completion is 19 (2 digits) to 31 (4
digits) characters long: a verifiable task whose responses are long enough for token-level
importance ratios to compound (the setting of SIS), with a problem space (900 x 900 pairs at 3
digits) too large for a small model to memorise. Pairs with ``hash(a, b) % heldout_mod == 0``
are held out.

The class serves both consumers: the pretraining corpus (``sample`` / ``prompt`` / ``answer`` /
``max_answer_len``, as :class:`jaxflow.data.arithmetic.AdditionTask`, so
:func:`jaxflow.data.arithmetic.packed_batch` and ``eval_prompts`` take it) and the RL task
protocol of :mod:`jaxflow.rl.tasks` (``prompts`` / ``heldout_prompts`` / ``score``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.data.arithmetic import heldout_mask, sample_split


def column_working(a: int, b: int, digits: int) -> str:
    """The worked completion of ``a+b`` for ``digits``-digit operands (see module doc)."""
    xs, ys = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    steps, carry = [], 0
    for i, (x, y) in enumerate(zip(xs, ys)):
        s = int(x) + int(y) + carry
        steps.append(f"{x}+{y}={s}" if i == 0 else f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return ",".join(steps) + f":{a + b}"


def sloppy_working(a: int, b: int, digits: int) -> str:
    """The working of ``a+b`` by a student who drops every carry: each later column writes
    ``+0`` and the "sum" is the column sums' last digits (wrong whenever a column carries)."""
    xs, ys = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    steps, digits_out = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        s = int(x) + int(y)
        steps.append(f"{x}+{y}={s}" if i == 0 else f"{x}+{y}+0={s}")
        digits_out.append(str(s % 10) if i < digits - 1 else str(s))
    return ",".join(steps) + ":" + str(int("".join(reversed(digits_out))))


def check_working(a: int, b: int, digits: int, completion: str) -> str | None:
    """None when ``completion`` is the correct working and answer of ``a+b``; otherwise a short
    reason naming the first wrong part (a column, the carry, the answer or the format)."""
    head, sep, answer = completion.partition(":")
    if not sep:
        return "no ':' before the answer"
    steps = head.split(",")
    if len(steps) != digits:
        return f"{len(steps)} columns, need {digits}"
    xs, ys = str(a).zfill(digits)[::-1], str(b).zfill(digits)[::-1]
    carry = 0
    for i, step in enumerate(steps):
        lhs, eq, rhs = step.partition("=")
        terms = lhs.split("+")
        want = [xs[i], ys[i]] + ([str(carry)] if i else [])
        if not eq or terms != want:
            return f"column {i}: {step!r}, need {'+'.join(want)}=..."
        s = int(xs[i]) + int(ys[i]) + carry
        if rhs != str(s):
            return f"column {i}: sum {rhs!r}, need {s}"
        carry = s // 10
    if answer != str(a + b):
        return f"answer {answer!r}, need {a + b}"
    return None


@dataclasses.dataclass(frozen=True)
class WorkedAdditionTask:
    """``digits``-digit addition with the column working written out (module doc)."""

    digits: int = 3
    heldout_mod: int = 20
    sloppy_rate: float = 0.0
    name: str = "worked_addition"

    def __post_init__(self):
        if not 0.0 <= self.sloppy_rate <= 1.0:
            raise ValueError(f"sloppy_rate={self.sloppy_rate!r}; valid: a float in [0, 1]")
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 6:
            raise ValueError(f"digits={self.digits!r}; valid: an int in 1..6")
        if not isinstance(self.heldout_mod, int) or self.heldout_mod < 2:
            raise ValueError(f"heldout_mod={self.heldout_mod!r}; valid: an int >= 2")

    # -- corpus side (pretraining) -----------------------------------------------------------

    def _is_heldout(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return heldout_mask(a, b, self.heldout_mod, 11)

    def sample(self, rng: np.random.Generator, n: int, *,
               heldout: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``n`` operand pairs (a [n], b [n]), each ``digits`` digits, from one split."""
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return sample_split(rng, n, lambda r, m: tuple(r.integers(low, 10**self.digits,
                                                                    size=(2, m))),
                            self._is_heldout, self.heldout_mod, heldout)

    @staticmethod
    def prompt(a: int, b: int) -> str:
        return f"{int(a)}+{int(b)}="

    def answer(self, a: int, b: int) -> str:
        """The correct completion: the working and the sum (what the evaluators expect)."""
        return column_working(int(a), int(b), self.digits)

    def _is_sloppy(self, a: int, b: int) -> bool:
        h = ((int(a) * 7919 + int(b)) * 2246822519) % (1 << 32)
        return (h >> 8) % 10_000 < self.sloppy_rate * 10_000

    def demonstration(self, a: int, b: int) -> str:
        """The pretraining target: :meth:`answer`, except for a ``sloppy_rate`` fraction of
        the pairs (a fixed hash of the pair), whose working drops every carry
        (:func:`sloppy_working`): demonstrations by an imperfect teacher that RL with the
        verifier has to correct."""
        if self._is_sloppy(a, b):
            return sloppy_working(int(a), int(b), self.digits)
        return self.answer(a, b)

    @property
    def max_prompt_len(self) -> int:
        return 2 * self.digits + 2

    @property
    def max_answer_len(self) -> int:
        # column 0 "x+y=s" (<= 6), others "x+y+c=s" (<= 8), commas, ":" and digits + 1 digits
        return 6 + 8 * (self.digits - 1) + (self.digits - 1) + 1 + self.digits + 1

    # -- RL side (jaxflow.rl.tasks.Task) -----------------------------------------------------

    @property
    def max_completion_len(self) -> int:
        return self.max_answer_len

    def prompts(self, rng: np.random.Generator, n: int) -> list[str]:
        a, b = self.sample(rng, n)
        return [self.prompt(x, y) for x, y in zip(a, b)]

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        # The same draw as jaxflow.data.arithmetic.eval_prompts (the pretraining evaluator).
        a, b = self.sample(np.random.default_rng([seed, 0xE7A1]), n, heldout=True)
        return [self.prompt(x, y) for x, y in zip(a, b)]

    def score(self, prompt: str, completion: str) -> float:
        """1.0 iff ``completion`` is the correct working and sum (:func:`check_working`);
        0.0 otherwise, a malformed prompt included."""
        try:
            a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        except ValueError:
            return 0.0
        return float(check_working(a, b, self.digits, completion.strip()) is None)
