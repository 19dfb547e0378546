"""User-given evaluation tasks and calibration corpora for the calibration study.

With ``--set model.hf_path=DIR`` the study prunes a real checkpoint; these files replace the
synthetic capability world on both sides:

* **Evaluation task files** (JSON Lines, one item per line), each line either an exact-match
  item ``{"prompt": "12+7=", "answer": "19"}`` (greedy decoding until EOS must give the
  answer) or a multiple-choice item ``{"prompt": "q: which is hot? a: ", "choices": ["fire.",
  "ice."], "label": 0}`` (the choice with the highest log-likelihood must be ``label``). An
  optional ``"capability"`` key names the capability; by default it is the file's stem
  (``math.jsonl`` -> ``math``). A capability's items are all of one kind, and its choice
  items all have the same number of choices.
* **Calibration files**: one document per line (``.txt``; blank lines skipped) or JSON Lines
  with a ``"text"`` key (``.jsonl``). The file's stem names the calibration source.

Loaders validate everything before the study starts and raise :class:`TaskFileError` naming
the file, the line and the bad value.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from jaxflow.errors import FileFormatError, text_lines
from jaxflow.prune.capabilities import Example


class TaskFileError(FileFormatError):
    """A task or calibration file that cannot be used (names file, line and value)."""


def _lines(path: str):
    if not pathlib.Path(path).is_file():
        raise TaskFileError(f"{path}: no such file")
    try:
        for number, line in text_lines(path, what="task file"):
            if line.strip():
                yield number, line
    except FileFormatError as e:
        raise TaskFileError(str(e)) from None


def _parse(path: str, number: int, line: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskFileError(f"{path}:{number}: not JSON ({err.msg})") from None
    if not isinstance(item, dict):
        raise TaskFileError(f"{path}:{number}: {line.strip()[:60]!r} is not a JSON object")
    return item


def _example(path: str, number: int, item: dict, capability: str) -> Example:
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise TaskFileError(f"{path}:{number}: prompt={prompt!r}; valid: a non-empty string")
    if "choices" in item:
        choices, label = item["choices"], item.get("label")
        if (not isinstance(choices, list) or len(choices) < 2
                or not all(isinstance(c, str) and c for c in choices)):
            raise TaskFileError(f"{path}:{number}: choices={choices!r}; valid: a list of >= 2 "
                                "non-empty strings")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
            raise TaskFileError(f"{path}:{number}: label={label!r}; valid: an int in "
                                f"[0, {len(choices) - 1}]")
        return Example(capability, prompt, choices[label], tuple(choices), label)
    answer = item.get("answer")
    if not isinstance(answer, str) or not answer:
        raise TaskFileError(f"{path}:{number}: answer={answer!r}; valid: a non-empty string "
                            "(or give choices and label)")
    return Example(capability, prompt, answer)


def load_task_files(paths: Sequence[str]) -> dict[str, list[Example]]:
    """{capability: [Example]} from evaluation task files (format in the module docstring)."""
    sets: dict[str, list[Example]] = {}
    where: dict[str, str] = {}
    for path in paths:
        stem = pathlib.Path(path).stem
        for number, line in _lines(path):
            item = _parse(path, number, line)
            cap = item.get("capability", stem)
            if not isinstance(cap, str) or not cap:
                raise TaskFileError(f"{path}:{number}: capability={cap!r}; valid: a non-empty "
                                    "string")
            ex = _example(path, number, item, cap)
            first = sets.setdefault(cap, [ex])[0]
            if ex is not first:
                if bool(ex.choices) != bool(first.choices):
                    raise TaskFileError(
                        f"{path}:{number}: capability {cap!r} mixes exact-match and "
                        f"multiple-choice items (its first item, at {where[cap]}, is "
                        f"{'multiple-choice' if first.choices else 'exact-match'})")
                if ex.choices and len(ex.choices) != len(first.choices):
                    raise TaskFileError(
                        f"{path}:{number}: {len(ex.choices)} choices; capability {cap!r} has "
                        f"{len(first.choices)} per item (first at {where[cap]})")
                sets[cap].append(ex)
            else:
                where[cap] = f"{path}:{number}"
    if not sets:
        raise TaskFileError(f"no evaluation items in {', '.join(paths) or '(no files given)'}")
    return sets


def load_calibration_files(paths: Sequence[str]) -> dict[str, list[str]]:
    """{source name (file stem): [document]} from calibration files (``.txt`` or ``.jsonl``)."""
    out: dict[str, list[str]] = {}
    for path in paths:
        stem = pathlib.Path(path).stem
        if stem in out:
            raise TaskFileError(f"{path}: a second calibration file named {stem!r}; source "
                                "names (file stems) must be unique")
        docs = []
        for number, line in _lines(path):
            if path.endswith(".jsonl"):
                text = _parse(path, number, line).get("text")
                if not isinstance(text, str) or not text:
                    raise TaskFileError(f"{path}:{number}: text={text!r}; valid: a non-empty "
                                        "string")
                docs.append(text)
            else:
                docs.append(line.rstrip("\n"))
        if not docs:
            raise TaskFileError(f"{path}: no documents")
        out[stem] = docs
    return out
