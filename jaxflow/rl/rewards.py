"""Batched rewards for RL on your own data: built-ins and your own function, validated.

A reward is a plain batched function ``fn(prompts, completions, **columns) -> list[float]``:
``prompts`` and ``completions`` are lists of B strings, each column a list of B values aligned
with them (the data row's columns; ``answer`` is the gold answer). :func:`make_reward` builds one
from a spec string, :func:`score_rewards` calls it and checks what comes back.

Specs:
  ``math_verify``     1.0 when math-verify finds the completion's answer equal to the gold
                      ``answer`` (parsed as ``\\boxed{answer}``, as verl does), else 0.0.
  ``reasoning_gym``   the dataset's own ``score_answer`` on the completion (the text inside its
                      last ``<answer>...</answer>`` when it has one, else the stripped text).
  ``exact_match``     1.0 when the stripped completion equals the stripped ``answer`` (any item
                      of it when the answer is a list, as verl's ``ground_truth`` may be).
  ``regex:PATTERN``   without a capture group: 1.0 when ``re.search(PATTERN, completion)``
                      matches. With one: 1.0 when the first group of the *last* match, stripped,
                      equals the stripped ``answer`` (the answer a reasoning model states last).
  ``module:function`` / ``path/file.py:function``  your own batched function.

Example::

    fn = make_reward("math_verify")
    score_rewards(fn, ["1/2 as a decimal?"], ["\\\\boxed{0.5}"], {"answer": ["1/2"]})  # array([1.])
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import re
import signal
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxflow.data.sources import reasoning_gym_dataset, require_module
from jaxflow.errors import UserError

#: A batched reward: ``fn(prompts, completions, **columns) -> list[float]`` (B values).
RewardFn = Callable[..., "list[float]"]

#: The built-in reward names (besides ``regex:PATTERN``).
BUILTIN_REWARDS = ("math_verify", "reasoning_gym", "exact_match")
#: Seconds math-verify may spend on one completion before it scores 0.0 (jaxflow's own deadline).
MATH_VERIFY_DEADLINE_S = 5.0
_SPEC_FORMS = "math_verify, reasoning_gym, exact_match, regex:PATTERN, module:function, path/file.py:function"
_RANGE_WARNED: set[str] = set()


class RewardError(UserError, ValueError):
    """A reward that cannot be built, raises, or returns the wrong number of values or a NaN;
    the message names the reward and the row at fault."""


def reward_name(fn: Callable) -> str:
    """The name a reward's messages use: its ``reward_name`` attribute (set by
    :func:`make_reward` to the spec), else its ``__name__``."""
    return str(getattr(fn, "reward_name", getattr(fn, "__name__", repr(fn))))


def _named(fn: Callable, name: str, reward_range: tuple[float, float] | None = (0.0, 1.0)) -> RewardFn:
    fn.reward_name = name  # type: ignore[attr-defined]
    if reward_range is not None:
        fn.reward_range = reward_range  # type: ignore[attr-defined]
    return fn


def _answers(name: str, columns: Mapping[str, Sequence]) -> Sequence:
    if "answer" not in columns:
        raise RewardError(f"reward {name!r} needs an 'answer' column; columns given: {sorted(columns)}")
    return columns["answer"]


def _as_list(answer: Any) -> list[str]:
    if isinstance(answer, (list, tuple, np.ndarray)):
        return [str(a) for a in answer]
    return [str(answer)]


# ----------------------------------------------------------------------------- built-ins


def exact_match(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence) -> list[float]:
    """1.0 where the stripped completion equals the stripped ``answer`` (any item of a list)."""
    answers = _answers("exact_match", columns)
    return [float(c.strip() in {a.strip() for a in _as_list(ans)}) for c, ans in zip(completions, answers)]


def regex_reward(pattern: str) -> RewardFn:
    """The ``regex:PATTERN`` reward (see the module docstring); RewardError naming the pattern
    when it does not compile."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise RewardError(f"reward 'regex:{pattern}': the pattern does not compile ({e})") from None

    def regex(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence) -> list[float]:
        if compiled.groups == 0:
            return [float(compiled.search(c) is not None) for c in completions]
        answers = _answers(f"regex:{pattern}", columns)
        out = []
        for c, ans in zip(completions, answers):
            matches = list(compiled.finditer(c))
            found = (matches[-1].group(1) or "").strip() if matches else None
            out.append(float(found is not None and found in {a.strip() for a in _as_list(ans)}))
        return out

    return _named(regex, f"regex:{pattern}")


class _Deadline(BaseException):
    """Raised by the SIGALRM handler; a BaseException so math-verify's ``except Exception``
    clauses cannot swallow it."""


def _with_deadline(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()`` stopped after ``seconds`` (raises _Deadline) by SIGALRM in the main thread; other
    threads cannot receive signals, so there it runs to completion."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()

    def on_alarm(signum, frame):
        raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def math_verify_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence) -> list[float]:
    """1.0 where math-verify finds the completion's answer equal to the gold ``answer``.

    math-verify's own SIGALRM timeouts are off (they raise outside the main thread); jaxflow's
    deadline :data:`MATH_VERIFY_DEADLINE_S` per completion applies in the main thread instead,
    and a completion that runs past it scores 0.0, as math-verify's own timeout does.
    """
    mv = require_module("math_verify", "reward='math_verify'")
    # jaxflow enforces the deadline, so math-verify's "timeout is disabled" notices do not apply.
    for module in ("math_verify.parser", "math_verify.grader"):
        importlib.import_module(module).TIMEOUT_WARNING_SHOWN = True
    answers = _answers("math_verify", columns)

    def one(completion: str, answer: Any) -> float:
        pred = mv.parse(completion, parsing_timeout=None)
        for gold_text in _as_list(answer):
            gold = mv.parse(f"\\boxed{{{gold_text}}}", parsing_timeout=None) or mv.parse(
                gold_text, parsing_timeout=None)
            if gold and pred and mv.verify(gold, pred, timeout_seconds=None):
                return 1.0
        return 0.0

    out = []
    for completion, answer in zip(completions, answers):
        try:
            out.append(float(_with_deadline(lambda: one(completion, answer), MATH_VERIFY_DEADLINE_S)))
        except _Deadline:
            out.append(0.0)
    return out


def _rg_entry(i: int, prompt: str, columns: Mapping[str, Sequence]) -> tuple[Callable, dict]:
    """(scorer, entry) of row ``i``: rebuilt from ``_rg_*`` columns when present (rows of
    :func:`jaxflow.data.sources.reasoning_gym_rows`), else from ``metadata.source_dataset``."""
    if "_rg_dataset" in columns:
        ds = reasoning_gym_dataset(str(columns["_rg_dataset"][i]), int(columns["_rg_size"][i]),
                                   int(columns["_rg_seed"][i]))
        return ds.score_answer, ds[int(columns["_rg_index"][i])]
    metadata = columns.get("metadata", [None] * (i + 1))[i]
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        raise RewardError(f"reward 'reasoning_gym' row {i}: no _rg_dataset column and no metadata with "
                          "source_dataset; valid: rows of reasoning_gym_rows() or reasoning-gym entries")
    question = columns["question"][i] if "question" in columns else prompt
    entry = {"question": question, "answer": str(_answers("reasoning_gym", columns)[i]), "metadata": metadata}
    return _rg_default_scorer(str(metadata["source_dataset"])), entry


@functools.lru_cache(maxsize=32)
def _rg_default_scorer(name: str) -> Callable:
    """``score_answer`` of reasoning-gym's dataset ``name`` in its default configuration (cached:
    some datasets load files when built)."""
    import reasoning_gym

    try:
        return reasoning_gym.get_score_answer_fn(name)
    except ValueError:
        raise RewardError(f"reward 'reasoning_gym': metadata.source_dataset {name!r} is not a reasoning-gym "
                          "dataset (reasoning_gym.factory.DATASETS)") from None


def reasoning_gym_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Sequence) -> list[float]:
    """reasoning-gym's own ``score_answer`` of each row's dataset on the completion (the text in
    its last ``<answer>...</answer>`` when present, else the stripped completion)."""
    require_module("reasoning_gym", "reward='reasoning_gym'")
    from reasoning_gym.utils import extract_answer

    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        score, entry = _rg_entry(i, prompt, columns)
        tagged = extract_answer(completion) if "<answer>" in completion else None
        out.append(float(score(answer=tagged if tagged is not None else completion.strip(), entry=entry)))
    return out


_BUILTINS: dict[str, RewardFn] = {
    "math_verify": _named(math_verify_reward, "math_verify"),
    "reasoning_gym": _named(reasoning_gym_reward, "reasoning_gym"),
    "exact_match": _named(exact_match, "exact_match"),
}


# ----------------------------------------------------------------------------- user functions


def _load_user_function(spec: str, where: str, attr: str) -> RewardFn:
    if where.endswith(".py") or os.sep in where or "/" in where:
        if not os.path.isfile(where):
            raise RewardError(f"reward {spec!r}: file {where!r} does not exist; valid: {_SPEC_FORMS}")
        module_name = "jaxflow_user_reward_" + re.sub(r"\W", "_", os.path.abspath(where))
        try:
            module_spec = importlib.util.spec_from_file_location(module_name, where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: importing {where!r} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: cannot import module {where!r} ({type(e).__name__}: {e}); "
                              f"valid: {_SPEC_FORMS}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"reward {spec!r}: {where!r} has no function {attr!r}; functions there: "
                          f"{', '.join(found[:12]) or 'none'}")
    return fn


def make_reward(spec: str) -> RewardFn:
    """The batched reward of ``spec`` (see the module docstring for the forms).

    A user function keeps its own attributes; give it ``reward_range = (lo, hi)`` to declare a
    range other than [0, 1] for :func:`score_rewards`' warning.

    Raises:
      RewardError: an unknown spec, a regex that does not compile, a module or file that
        cannot be imported, or no such function in it (one line naming the spec).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward spec {spec!r} is empty; valid: {_SPEC_FORMS}")
    spec = spec.strip()
    if spec in _BUILTINS:
        return _BUILTINS[spec]
    if spec.startswith("regex:"):
        return regex_reward(spec[len("regex:"):])
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise RewardError(f"reward spec {spec!r} is not one of: {_SPEC_FORMS}")
    return _load_user_function(spec, where, attr)


# ----------------------------------------------------------------------------- validation


def _short(text: Any, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def score_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                  columns: Mapping[str, Sequence] | None = None) -> np.ndarray:
    """``fn(prompts, completions, **columns)`` checked: rewards [B] float32.

    Raises:
      RewardError: ``fn`` raised (names the exception and, found by calling ``fn`` on one row
        at a time, the first row that raises), returned a number of values other than B
        (names both), a value that is not a number, or a NaN / inf (names the first bad row and
        its prompt).

    Values outside [0, 1] (or ``fn.reward_range``) are legal; they warn once per reward per
    process (``warnings.warn``).
    """
    name = reward_name(fn)
    prompts, completions = list(prompts), list(completions)
    columns = {k: list(v) for k, v in (columns or {}).items()}
    n = len(prompts)
    if len(completions) != n or any(len(v) != n for v in columns.values()):
        bad = {k: len(v) for k, v in columns.items() if len(v) != n}
        raise RewardError(f"reward {name!r}: {n} prompts but {len(completions)} completions and "
                          f"columns of lengths {bad or 'as prompts'}; all must be aligned")
    try:
        values = fn(prompts, completions, **columns)
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {_short(e, 120)[1:-1]}"
                          f"{_failing_row(fn, prompts, completions, columns)}") from None
    try:
        length = len(values)
    except TypeError:
        raise RewardError(f"reward {name!r} returned a {type(values).__name__}, not a list of {n} "
                          "floats") from None
    if length != n:
        raise RewardError(f"reward {name!r} returned {length} values for {n} rows; expected {n} "
                          "(one per completion)")
    out = np.empty(n, np.float64)
    for i, v in enumerate(values):
        try:
            out[i] = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} returned {v!r:.40} at row {i} (prompt {_short(prompts[i])}); "
                              "expected a float") from None
        if not math.isfinite(out[i]):
            raise RewardError(f"reward {name!r} returned {out[i]} at row {i} (prompt {_short(prompts[i])}); "
                              "rewards must be finite")
    lo, hi = getattr(fn, "reward_range", (0.0, 1.0))
    if name not in _RANGE_WARNED and n and (out.min() < lo or out.max() > hi):
        _RANGE_WARNED.add(name)
        i = int(np.argmax((out < lo) | (out > hi)))
        warnings.warn(f"reward {name!r} returned {out[i]:g} at row {i}, outside [{lo:g}, {hi:g}] (warned once; "
                      "declare fn.reward_range = (lo, hi) if intended)", stacklevel=2)
    return out.astype(np.float32)


def _failing_row(fn: RewardFn, prompts: list, completions: list, columns: dict) -> str:
    """`` at row i (prompt ...)`` for the first row on which ``fn`` alone raises, else ''."""
    for i in range(len(prompts)):
        try:
            fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
        except Exception:
            return f" at row {i} (prompt {_short(prompts[i])})"
    return ""
