"""An RL task over rows of your own data: prompts from a column, a batched reward over the rest.

:class:`DatasetTask` implements :class:`jaxflow.rl.tasks.Task` (and its optional
``score_batch`` / ``prompts_at``) over rows from :mod:`jaxflow.data.sources`. Each row's prompt
(``prompt_key``: a string, or a list of chat messages) is rendered to text, through the
checkpoint's :class:`jaxflow.data.chat_template.ChatTemplate` when one is given (a string prompt
becomes one user turn). The trainer only sees that text; when it scores completions the task
finds each prompt's row again by its rendered text and hands the reward every column of that
row (``prompt_key`` excepted) as aligned lists, with ``answer`` set to the ``answer_key`` value.

Example::

    rows = load_rows("train.jsonl")
    train, heldout = heldout_split(rows, 32, seed=0)
    task = DatasetTask(train, "math_verify", heldout=heldout, template=ChatTemplate.from_pretrained(P))
    prompts = task.prompts_at(0, 8, seed=0)
    rewards = task.score_batch(prompts, completions, truncated=np.zeros(8, bool))   # [8] float32
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from jaxflow.data.chat_template import ChatTemplate
from jaxflow.data.sources import PROMPT_KEY, check_columns, find_answer_key, get_column
from jaxflow.errors import UserError
from jaxflow.rl.rewards import RewardFn, make_reward, score_rewards


class DatasetTask:
    """A verifiable task over data rows (all text; see the module docstring).

    Args:
      rows: training rows (dicts), e.g. from :func:`jaxflow.data.sources.load_rows`.
      reward: a batched :data:`jaxflow.rl.rewards.RewardFn` or a spec for
        :func:`jaxflow.rl.rewards.make_reward` (``"math_verify"``, ``"my_file.py:score"``, ...).
      prompt_key: the prompt column (verl's ``prompt``); a dotted key reads a nested column.
      answer_key: the gold-answer column, given to the reward as ``answer``; None takes the first
        of ``jaxflow.data.sources.ANSWER_KEYS`` every row holds (none: no ``answer`` column).
      template: renders prompts (needed when a prompt is a list of chat messages).
      system: a system turn put before string prompts (needs ``template``).
      heldout: evaluation rows (``data.eval``), never issued by :meth:`prompts` / :meth:`prompts_at`.
      tokenizer: anything with ``encode(text) -> list[int]``; gives :attr:`max_prompt_tokens`.
      max_completion_len: the Task protocol's completion budget (the trainer generates
        ``GRPOConfig.max_new_tokens`` tokens; this is its character-level counterpart).
      name: the task's name in logs.
      drop_template_bos: drop the template's leading ``bos_token`` text from rendered prompts
        (Llama-3's template writes it): the trainer prepends the tokenizer's BOS id itself
        (:func:`jaxflow.rl.tasks.encode_prompts`), and both come from ``tokenizer_config.json``'s
        ``bos_token``, so keeping it would give the model two BOS tokens.

    A rendered prompt text maps to one row. When two rows render to the same text with
    different columns, the row of the latest issuance (:meth:`prompts`, :meth:`prompts_at`,
    :meth:`heldout_prompts`) is the one scored; before any issuance, the later row in
    ``rows + heldout`` wins.

    Raises:
      UserError: no rows, a row without ``prompt_key`` / ``answer_key`` (names the columns
        present), a prompt that is neither a string nor a message list, or message prompts
        without a template.
    """

    def __init__(self, rows: Sequence[dict], reward: RewardFn | str, *, prompt_key: str = PROMPT_KEY,
                 answer_key: str | None = None, template: ChatTemplate | None = None,
                 system: str | None = None, heldout: Sequence[dict] | None = None, tokenizer: Any = None,
                 max_completion_len: int = 256, name: str = "dataset", drop_template_bos: bool = True):
        rows, heldout_rows = list(rows), list(heldout or [])
        if not rows:
            raise UserError(f"task {name!r} has no training rows; valid: a non-empty list of dicts")
        if system is not None and template is None:
            raise UserError(f"task {name!r}: a system prompt needs a chat template (data.chat_template=true)")
        if answer_key is None:
            answer_key = find_answer_key(rows + heldout_rows)
        for what, part in (("training", rows), ("held-out", heldout_rows)):
            check_columns(part, [k for k in (prompt_key, answer_key) if k is not None], f"{name} {what} rows")
        self.name, self.prompt_key, self.answer_key = name, prompt_key, answer_key
        self.template, self.system, self.tokenizer = template, system, tokenizer
        bos = template.special_tokens.get("bos_token") if template is not None and drop_template_bos else None
        self._bos_text: str | None = bos or None
        if not isinstance(reward, str) and not callable(reward):
            raise UserError(f"task {name!r}: reward {reward!r:.60} is neither a spec string nor a "
                            "function fn(prompts, completions, **columns) -> list[float]")
        self.reward: RewardFn = make_reward(reward) if isinstance(reward, str) else reward
        self._max_completion_len = int(max_completion_len)
        self.rows, self.heldout_rows = rows, heldout_rows
        self._train_text = [self._render(r, i, "training") for i, r in enumerate(rows)]
        self._heldout_text = [self._render(r, i, "held-out") for i, r in enumerate(heldout_rows)]
        # Rendered prompt -> the row its completions are scored against (latest issuance wins).
        self._row_of: dict[str, dict] = dict(zip(self._train_text + self._heldout_text, rows + heldout_rows))
        keys = dict.fromkeys(k for r in rows + heldout_rows for k in r if k != prompt_key)
        self.column_names: tuple[str, ...] = tuple(keys) + (("answer",) if answer_key and "answer" not in keys else ())

    def _render(self, row: dict, i: int, what: str) -> str:
        prompt = get_column(row, self.prompt_key)
        if isinstance(prompt, str) and self.template is None:
            return prompt
        if isinstance(prompt, str):
            text = self.template.prompt(prompt, system=self.system)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
            if self.template is None:
                raise UserError(f"task {self.name!r} {what} row {i}: the prompt is a list of chat messages "
                                "and no chat template was given (data.chat_template=true, or a ChatTemplate)")
            text = self.template.render(prompt, add_generation_prompt=True)
        else:
            raise UserError(f"task {self.name!r} {what} row {i}: prompt {prompt!r:.60} is a "
                            f"{type(prompt).__name__}; valid: a string or a list of {{'role', 'content'}} dicts")
        return text[len(self._bos_text):] if self._bos_text and text.startswith(self._bos_text) else text

    # --------------------------------------------------------------------- Task protocol

    @functools.cached_property
    def max_prompt_len(self) -> int:
        """Characters of the longest rendered prompt (training and held-out)."""
        return max(len(t) for t in self._train_text + self._heldout_text)

    @property
    def max_completion_len(self) -> int:
        """The completion budget given as ``max_completion_len`` (characters)."""
        return self._max_completion_len

    @functools.cached_property
    def max_prompt_tokens(self) -> int | None:
        """Tokens (``tokenizer.encode``) of the longest rendered prompt; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return max(len(self.tokenizer.encode(t)) for t in self._train_text + self._heldout_text)

    def _issue(self, texts: list[str], rows: list[dict], idx: np.ndarray) -> list[str]:
        out = []
        for i in idx.tolist():
            self._row_of[texts[i]] = rows[i]
            out.append(texts[i])
        return out

    def prompts(self, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` training prompts drawn uniformly with replacement by ``rng``."""
        return self._issue(self._train_text, self.rows, rng.integers(0, len(self.rows), size=n))

    def prompts_at(self, start: int, n: int, seed: int) -> list[str]:
        """The training prompts at positions ``[start, start + n)`` of a seeded epoch stream:
        position p is row ``permutation(seed, p // N)[p % N]`` (N rows; each epoch a fresh
        permutation seeded by ``(seed, epoch)``), so a run resumed at ``start`` continues
        mid-epoch exactly."""
        if start < 0 or n < 0:
            raise UserError(f"prompts_at(start={start}, n={n}): both must be >= 0")
        count = len(self.rows)
        positions = np.arange(start, start + n, dtype=np.int64)
        epochs = positions // count
        perms = {int(e): np.random.default_rng([seed, int(e)]).permutation(count) for e in np.unique(epochs)}
        idx = np.array([perms[int(e)][p % count] for p, e in zip(positions, epochs)], dtype=np.int64)
        return self._issue(self._train_text, self.rows, idx)

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        """``min(n, H)`` held-out prompts: the first of a permutation of the H held-out rows
        seeded by ``seed``. UserError when the task has no held-out rows."""
        if not self.heldout_rows:
            raise UserError(f"task {self.name!r} has no held-out rows; pass heldout= (data.eval) or "
                            "split some off with jaxflow.data.sources.heldout_split")
        idx = np.random.default_rng([seed, 0xE7A1]).permutation(len(self.heldout_rows))[:n]
        return self._issue(self._heldout_text, self.heldout_rows, idx)

    def columns(self, prompts: Sequence[str]) -> dict[str, list]:
        """The reward's columns for ``prompts`` (rendered texts this task issued): every column
        of each prompt's row but the prompt (None where a row lacks it), ``answer`` the
        ``answer_key`` value."""
        rows = []
        for p in prompts:
            if p not in self._row_of:
                raise UserError(f"task {self.name!r} never issued the prompt {p[:60]!r}; valid: texts "
                                "returned by prompts / prompts_at / heldout_prompts")
            rows.append(self._row_of[p])
        out = {k: [r.get(k) for r in rows] for k in self.column_names if k != "answer"}
        if self.answer_key is not None:
            out["answer"] = [get_column(r, self.answer_key) for r in rows]
        return out

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    truncated: np.ndarray) -> np.ndarray:
        """Rewards [B] float32 of one generation batch: the reward called once on all B rows,
        validated by :func:`jaxflow.rl.rewards.score_rewards`. ``truncated`` [B] bool marks
        completions that hit the token budget; every row is scored here (zeroing truncated rows
        under ``GRPOConfig.truncated_reward="zero"`` is the trainer's)."""
        if len(truncated) != len(prompts):
            raise UserError(f"score_batch: {len(prompts)} prompts but {len(truncated)} truncated flags")
        return score_rewards(self.reward, prompts, completions, self.columns(prompts))

    def score(self, prompt: str, completion: str) -> float:
        """The reward of one completion (:meth:`score_batch` on one row)."""
        return float(self.score_batch([prompt], [completion], np.zeros(1, bool))[0])

