"""The ``rl`` experiment's data settings as rows and a task: a local file or a reasoning-gym
generator, split into training and held-out rows, wrapped in a
:class:`jaxflow.rl.dataset_task.DatasetTask` with the reward and (optionally) the checkpoint's
chat template. Usable from a notebook with any object carrying the same fields as
``configs.rl.DataConfig``.

Example::

    train, heldout = data_rows(DataConfig(source="reasoning_gym:chain_sum", size=256))
    task = make_task(data_cfg, "reasoning_gym", tokenizer, hf_path)
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxflow.data import sources
from jaxflow.errors import UserError

RG_PREFIX = "reasoning_gym:"


def generator_rows(name: str, size: int, seed: int, settings: dict[str, Any]) -> list[dict]:
    """``size`` rows of reasoning-gym's generator ``name`` built with ``settings`` (its config
    fields, e.g. ``{"max_terms": 2}``): ``prompt`` / ``question``, ``answer`` and ``metadata``
    (JSON; the ``reasoning_gym`` reward scores through its ``source_dataset``). Without settings
    these are :func:`jaxflow.data.sources.reasoning_gym_rows`."""
    if not settings:
        return sources.reasoning_gym_rows(name, size, seed)
    sources.reasoning_gym_names()  # the extra installed (MissingExtraError otherwise)
    sources.reasoning_gym_dataset(name, 1, seed)  # a known name (one line listing them otherwise)
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
    except (TypeError, ValueError, AssertionError) as e:
        raise UserError(f"data.generator={json.dumps(settings)} is not a valid setting of "
                        f"reasoning-gym's {name!r}: {type(e).__name__}: {e}") from None
    return [{"prompt": e["question"], "question": e["question"], "answer": str(e["answer"]),
             "metadata": json.dumps(e.get("metadata", {}), default=str)} for e in ds]


def data_rows(data: Any) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of ``data`` (a ``configs.rl.DataConfig``).

    Files: ``data.train`` (required), held out ``data.eval`` or, without it, ``eval_size`` rows
    split off ``train`` with ``data.seed``. reasoning-gym: ``size`` rows with ``seed`` and
    ``eval_size`` held-out rows with ``seed + 1`` (another draw of the generator).

    Raises:
      UserError: no ``data.train`` for a file source; file errors from
        :func:`jaxflow.data.sources.load_rows` name the file and the columns.
    """
    if data.source.startswith(RG_PREFIX):
        name = data.source[len(RG_PREFIX):]
        settings = json.loads(data.generator) if data.generator else {}
        return (generator_rows(name, data.size, data.seed, settings),
                generator_rows(name, data.eval_size, data.seed + 1, settings))
    if not data.train:
        raise UserError("data.train is not set; valid: a local .jsonl / .json / .parquet / .csv "
                        "file or a datasets.save_to_disk directory (or data.source="
                        "reasoning_gym:NAME)")
    answer_key = data.answer_key or None
    train = sources.load_rows(data.train, prompt_key=data.prompt_key, answer_key=answer_key)
    if data.eval:
        return train, sources.load_rows(data.eval, prompt_key=data.prompt_key,
                                        answer_key=answer_key)
    return sources.heldout_split(train, min(data.eval_size, len(train) - 1), seed=data.seed)


def make_task(data: Any, reward: str, tokenizer: Any, hf_path: str, *,
              max_new_tokens: int):
    """The :class:`jaxflow.rl.dataset_task.DatasetTask` of ``data`` (a ``configs.rl.DataConfig``)
    scored by the reward spec ``reward``; with ``data.chat_template`` prompts are rendered by
    ``hf_path``'s chat template (UserError when it has none). Greedy evaluation generates up to
    ``max_new_tokens`` tokens."""
    from jaxflow.data.chat_template import ChatTemplate
    from jaxflow.rl.dataset_task import DatasetTask

    template = ChatTemplate.from_pretrained(hf_path) if data.chat_template else None
    if data.chat_template and template is None:
        raise UserError(f"data.chat_template=true but {hf_path} has no chat template "
                        "(tokenizer_config.json's chat_template or chat_template.jinja)")
    train, heldout = data_rows(data)
    name = data.source if data.source != "file" else os.path.basename(data.train)
    return DatasetTask(train, reward, prompt_key=data.prompt_key, answer_key=data.answer_key or None,
                       template=template, heldout=heldout, tokenizer=tokenizer,
                       max_completion_len=max_new_tokens - 1, name=name)


def stand_in_task(prompt_tokens: int, max_new_tokens: int) -> tuple[Any, Any]:
    """(task, tokenizer) with real data's shapes for ``--compile-only``, where no data is read:
    one ``prompt_tokens``-token prompt of the character tokenizer, held out as well."""
    from jaxflow.data.tokenizer import CharTokenizer
    from jaxflow.rl.dataset_task import DatasetTask

    rows = [{"prompt": "1" * (prompt_tokens - 1), "answer": "1"}]  # + BOS
    return (DatasetTask(rows, "exact_match", heldout=rows, tokenizer=CharTokenizer(),
                        max_completion_len=max_new_tokens - 1, name="compile-only"), CharTokenizer())
