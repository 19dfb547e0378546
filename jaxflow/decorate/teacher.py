"""The annotator ("teacher") interface and the built-in programmatic teacher.

An annotator is anything with three methods (records in, labels out):

* ``compare(texts_a, texts_b) -> [P, 8]`` outcomes in [0, 1] per criterion of ``CRITERIA``
  (1 = the first text is better, 0.5 = tie);
* ``tag(texts) -> [N, 3]`` tag paths of a ``TagHierarchy``;
* ``edit(texts) -> list[str]`` rewritten texts.

``CallableAnnotator`` wraps user functions (e.g. calls to an LLM endpoint) and checks what they
return; ``LabelFileAnnotator`` answers from a JSONL file of stored labels. With no network,
``ProgrammaticTeacher`` is the default: its judgements are computable from the text, so every
experiment can verify them.

ProgrammaticTeacher, documented rules (``criteria_features``): each criterion is a saturating
function of a measurable rate, in [0, 1]:

  educational_value  explanation phrases ("is defined as", "for example", "returns", ...)
                     per sentence
  expertise          topic keywords of the tag tree and technical tokens (identifiers with
                     "_", calls "f()", quoted literals, alphanumerics) per word
  fact_and_trivia    numbers and mid-sentence capitalised words per word
  reasoning_level    connectives ("because", "therefore", "if", "since", "hence", ...) per
                     sentence
  scarcity           fraction of long (>= 11 letters) or rare-list words
  story_likeness     narrative markers ("one day", "then", "walked", names, ...) per word
  structural_format  fraction of lines that are list items, titles or heading rules
  subjectivity       first-person and opinion words per word

The five "quality" criteria (educational value, expertise, facts, reasoning, structure) are
multiplied by cleanliness = exp(-8 * fraction of characters the teacher's edit changes) times
fluency = min(1, 4 * fraction of function words), so noisy copies and keyword salad rate lower.
A comparison adds logistic judge noise (``judge_noise``) to the feature difference. Tags:
keyword hits summed per level-1 category, then per level-2 child, then per leaf (top-down
argmax, ties to the lower id; no hit at all gives leaf 0). Edits (``teacher_edit_ops``): delete
the markup junk of ``corpus.JUNK_MARKERS`` (with the space before it), collapse runs of spaces
between a lower-case letter or comma and a letter, drop an immediately repeated word, lower-case
runs of >= 2 consecutive ALL-CAPS words.
"""

from __future__ import annotations

import re
from typing import Callable, Protocol, Sequence

import numpy as np

from jaxflow.decorate.editing import DELETE, KEEP, LOWER, apply_ops
from jaxflow.decorate.rating import CRITERIA
from jaxflow.decorate.tagging import TagHierarchy, validate_tags
from jaxflow.errors import FileFormatError, text_lines


class Annotator(Protocol):
    """What the decoration pipeline asks of a teacher."""

    def compare(self, texts_a: Sequence[str], texts_b: Sequence[str]) -> np.ndarray:
        """Pairwise outcomes float32[n, len(CRITERIA)] in [0, 1] (1 = the first text is better) for ``texts_a[i]`` vs
        ``texts_b[i]``."""

    def tag(self, texts: Sequence[str]) -> np.ndarray:
        """Tags int[n, 3] (one per level of the tag tree) of each text."""

    def edit(self, texts: Sequence[str]) -> list[str]:
        """The edited (cleaned) version of each text."""


_JUNK = re.compile(r" ?(?:<br>|<div>|</p>|&nbsp;|&amp;|\[\[(?:ad|img|link)\]\])")
_SPACES = re.compile(r"(?<=[a-z,]) {2,}(?=[A-Za-z])")
_REPEAT = re.compile(r"(?<![A-Za-z])([A-Za-z]{2,}) \1(?![A-Za-z])")
_SHOUT = re.compile(r"(?<![A-Za-z])[A-Z]{2,}(?: [A-Z]{2,})+(?![A-Za-z])")


def teacher_edit_ops(text: str) -> np.ndarray:
    """[len(text)] int8 edit operations of the programmatic teacher (see module docstring)."""
    ops = np.zeros(len(text), np.int8)
    idx = np.arange(len(text))
    cur = text

    def drop(spans):
        nonlocal cur, idx
        keep = np.ones(len(cur), bool)
        for a, b in spans:
            keep[a:b] = False
        ops[idx[~keep]] = DELETE
        idx = idx[keep]
        cur = "".join(c for c, k in zip(cur, keep) if k)

    drop([m.span() for m in _JUNK.finditer(cur)])
    drop([(m.start() + 1, m.end()) for m in _SPACES.finditer(cur)])
    drop([(m.start(1) + len(m.group(1)), m.end()) for m in _REPEAT.finditer(cur)])
    for m in _SHOUT.finditer(cur):
        ops[idx[m.start():m.end()]] = LOWER
    return ops


_WORD = re.compile(r"[A-Za-z]+|\d+")
_EXPLAIN = ("is defined as", "for example", "this means", "in other words", "is used",
            "are used", "refers to", "e.g.", "i.e.", "such as", "is called", "that is,",
            "describes", "returns", "means that", "note that", "must be", " is a ", " is an ")
_CONNECT = {"because", "therefore", "thus", "hence", "since", "if", "then", "unless",
            "consequently", "implies", "otherwise", "whereas"}
_STORY = {"once", "then", "walked", "remembered", "smiled", "friend", "talk", "day", "she",
          "he", "her", "his", "ada", "ben", "chen", "dara", "eli", "farah", "goran", "hana"}
_OPINION = {"i", "my", "me", "think", "feel", "believe", "honestly", "opinion", "beautiful",
            "terrible", "amazing", "love", "hate", "overrated", "best", "worst"}
_RARE = {"recondite", "abstruse", "esoteric", "arcane", "idiosyncratic", "sesquipedalian",
         "perspicacious", "crepuscular", "ineffable", "quixotic"}
_FUNCTION_WORDS = {"the", "a", "an", "is", "are", "was", "were", "be", "of", "to", "in", "and",
                   "or", "for", "with", "on", "that", "this", "it", "as", "by", "at", "from",
                   "not", "can", "which", "when", "its", "their", "has", "have", "about"}
_TECHNICAL = re.compile(r"[A-Za-z]\w*_\w*|\w+\(\)|\w+\.\w+\(|\"[^\"\n]{1,20}\"|[A-Za-z]+\d+")
_STRUCT_LINE = re.compile(r"^\s*(?:[-*+] |\d+[.)] |Title:|[*=~^-]{4,}$)")


def _sat(x: float, scale: float) -> float:
    return float(1.0 - np.exp(-scale * x))


class ProgrammaticTeacher:
    """The built-in annotator: rules in the module docstring, judge noise from ``seed``."""

    def __init__(self, hierarchy: TagHierarchy, *, judge_noise: float = 0.05, seed: int = 0):
        if judge_noise < 0:
            raise ValueError(f"judge_noise={judge_noise}: must be >= 0")
        self.hierarchy, self.judge_noise = hierarchy, judge_noise
        self._rng = np.random.default_rng(seed)
        self._leaf_of: dict[str, list[int]] = {}
        for leaf, kws in enumerate(hierarchy.keywords):
            words = set(kws) | set(_WORD.findall(hierarchy.names[2][leaf].lower()))
            for w in words:
                self._leaf_of.setdefault(w, []).append(leaf)
        self._keywords = set(self._leaf_of)

    # -- rating ------------------------------------------------------------------------

    def criteria_features(self, text: str) -> np.ndarray:
        """[8] criterion features in [0, 1] (order of CRITERIA)."""
        if not text.strip():
            raise ValueError("criteria_features: empty text (readers drop empty texts)")
        low = text.lower()
        words = _WORD.findall(low)
        n_words = max(len(words), 1)
        raw_words = _WORD.findall(text)
        lines = [ln for ln in text.split("\n") if ln.strip()]
        n_sent = max(len(re.findall(r"[.!?](?:\s|$)", text)), len(lines), 1)
        ops = teacher_edit_ops(text)
        # fluent prose has ~1 function word in 3; keyword salad almost none
        fluent = min(1.0, 4.0 * sum(w in _FUNCTION_WORDS for w in words) / n_words)
        clean = float(np.exp(-8.0 * np.mean(ops != KEEP))) * fluent
        technical = len(_TECHNICAL.findall(text))
        numbers = sum(w.isdigit() for w in words)
        caps = sum(1 for i, w in enumerate(raw_words[1:], 1) if w[:1].isupper() and w[1:].islower())
        f = [
            _sat(sum(low.count(p) for p in _EXPLAIN) / n_sent, 2.0) * clean,
            _sat((sum(w in self._keywords for w in words) + technical) / n_words, 6.0) * clean,
            _sat((numbers + caps) / n_words, 12.0) * clean,
            _sat(sum(w in _CONNECT for w in words) / n_sent, 1.5) * clean,
            _sat(sum(len(w) >= 11 or w in _RARE for w in words) / n_words, 15.0),
            _sat(sum(w in _STORY for w in words) / n_words + 0.5 * low.count("one day") / n_sent, 10.0),
            _sat(sum(bool(_STRUCT_LINE.match(ln)) for ln in lines) / len(lines) if lines else 0.0,
                 3.0) * clean,
            _sat(sum(w in _OPINION for w in words) / n_words, 15.0),
        ]
        return np.asarray(f, np.float64)

    def features(self, texts: Sequence[str]) -> np.ndarray:
        """[N, 8] criterion features."""
        return np.stack([self.criteria_features(t) for t in texts]) if texts else np.zeros((0, 8))

    def compare_features(self, fa: np.ndarray, fb: np.ndarray) -> np.ndarray:
        """Outcomes [P, 8] from features [P, 8] x 2: 1 where fa - fb + noise > 0, 0 where < 0,
        0.5 for an exact tie without noise."""
        d = np.asarray(fa) - np.asarray(fb)
        if self.judge_noise > 0:
            d = d + self.judge_noise * self._rng.logistic(size=d.shape)
        return np.where(d > 0, 1.0, np.where(d < 0, 0.0, 0.5)).astype(np.float32)

    def compare(self, texts_a: Sequence[str], texts_b: Sequence[str]) -> np.ndarray:
        """Pairwise outcomes float32[n, len(CRITERIA)] from the texts' measurable features."""
        if len(texts_a) != len(texts_b):
            raise ValueError(f"compare: {len(texts_a)} first texts vs {len(texts_b)} second texts")
        return self.compare_features(self.features(texts_a), self.features(texts_b))

    # -- tagging -------------------------------------------------------------------------

    def tag(self, texts: Sequence[str]) -> np.ndarray:
        """[N, 3] int32 tag paths by top-down keyword hits."""
        h = self.hierarchy
        n1, n2, n3 = h.sizes
        p2, p3 = np.asarray(h.parent2), np.asarray(h.parent3)
        out = np.zeros((len(texts), 3), np.int32)
        for i, text in enumerate(texts):
            hits = np.zeros(n3)
            for w in _WORD.findall(text.lower()):
                for leaf in self._leaf_of.get(w, ()):
                    hits[leaf] += 1
            h2 = np.bincount(p3, weights=hits, minlength=n2)
            h1 = np.bincount(p2, weights=h2, minlength=n1)
            a = int(np.argmax(h1))
            kids2 = np.flatnonzero(p2 == a)
            b = int(kids2[np.argmax(h2[kids2])])
            kids3 = np.flatnonzero(p3 == b)
            c = int(kids3[np.argmax(hits[kids3])])
            out[i] = (a, b, c) if hits.any() else h.path(0)
        return out

    # -- editing -------------------------------------------------------------------------

    def edit_ops(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The teacher's per-character edit operations of each text (``teacher_edit_ops``)."""
        return [teacher_edit_ops(t) for t in texts]

    def edit(self, texts: Sequence[str]) -> list[str]:
        """Each text with the teacher's edit operations applied."""
        return [apply_ops(t, teacher_edit_ops(t)) for t in texts]


class CallableAnnotator:
    """An annotator from user functions (e.g. calls to an LLM endpoint or a label file).

    Any function left None raises when used. Outputs are checked: comparison outcomes must be
    [P, 8] in [0, 1], tags valid paths of ``hierarchy``, edits one string per text.
    """

    def __init__(self, hierarchy: TagHierarchy, *,
                 compare_fn: Callable[[Sequence[str], Sequence[str]], np.ndarray] | None = None,
                 tag_fn: Callable[[Sequence[str]], np.ndarray] | None = None,
                 edit_fn: Callable[[Sequence[str]], list[str]] | None = None):
        self.hierarchy = hierarchy
        self._compare, self._tag, self._edit = compare_fn, tag_fn, edit_fn

    def _need(self, fn, name):
        if fn is None:
            raise ValueError(f"this CallableAnnotator has no {name}_fn")
        return fn

    def compare(self, texts_a, texts_b):
        """``compare_fn``'s outcomes, checked: shape [n, len(CRITERIA)], values in [0, 1]."""
        y = np.asarray(self._need(self._compare, "compare")(texts_a, texts_b), np.float32)
        if y.shape != (len(texts_a), len(CRITERIA)):
            raise ValueError(f"compare_fn returned shape {y.shape}; need ({len(texts_a)}, {len(CRITERIA)})")
        if np.isnan(y).any() or (y < 0).any() or (y > 1).any():
            raise ValueError("compare_fn outcomes must be in [0, 1] (1 = first text better)")
        return y

    def tag(self, texts):
        """``tag_fn``'s tags, checked against the hierarchy."""
        tags = np.asarray(self._need(self._tag, "tag")(texts))
        if tags.shape[0] != len(texts):
            raise ValueError(f"tag_fn returned {tags.shape[0]} rows for {len(texts)} texts")
        return validate_tags(tags, self.hierarchy)

    def edit(self, texts):
        """``edit_fn``'s edits, checked: one string per text."""
        out = list(self._need(self._edit, "edit")(texts))
        if len(out) != len(texts) or not all(isinstance(t, str) for t in out):
            raise ValueError(f"edit_fn must return {len(texts)} strings, got {len(out)} items")
        return out


def annotate(annotator: Annotator, texts: Sequence[str], *, min_comparisons: int,
             key, l2: float = 0.1) -> dict:
    """Everything the student learns from: the annotator's comparisons of random pairs (each
    text in >= ``min_comparisons``), their Bradley-Terry scores, tags and edits.

    Returns:
      {"pairs" [P, 2], "outcomes" [P, 8], "scores" [N, 8] Bradley-Terry, "uniform" [N, 8]
        0-100 rank scores, "tags" [N, 3], "edits" list[str], "ops" list of [len(text)] int8,
        "unrepresentable" (target characters edit ops cannot express, for free-form edits)}.
    """
    from jaxflow.decorate.editing import ops_from_edit
    from jaxflow.decorate.rating import fit_bradley_terry, sample_pairs, uniform_scores

    texts = list(texts)
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"annotate: text {i} is empty (readers drop empty texts)")
    pairs = sample_pairs(len(texts), min_comparisons, key=key)
    if isinstance(annotator, ProgrammaticTeacher):  # features once per text, not per pair
        feats = annotator.features(texts)
        outcomes = annotator.compare_features(feats[pairs[:, 0]], feats[pairs[:, 1]])
    else:
        outcomes = annotator.compare([texts[i] for i in pairs[:, 0]], [texts[j] for j in pairs[:, 1]])
    scores, _ = fit_bradley_terry(pairs, outcomes, len(texts), l2=l2)
    scores = np.asarray(scores)
    tags = annotator.tag(texts)
    if isinstance(annotator, ProgrammaticTeacher):
        ops = annotator.edit_ops(texts)
        edits = [apply_ops(t, o) for t, o in zip(texts, ops)]
        missing = 0
    else:
        edits = annotator.edit(texts)
        ops, missing = [], 0
        for t, e in zip(texts, edits):
            o, m = ops_from_edit(t, e)
            ops.append(o)
            missing += m
    return {"pairs": pairs, "outcomes": outcomes, "scores": scores,
            "uniform": uniform_scores(scores), "tags": tags, "edits": edits, "ops": ops,
            "unrepresentable": missing}


class LabelFileAnnotator:
    """An annotator answering from a JSONL label file (e.g. an LLM's stored annotations).

    One row per text: ``{"text": str, "scores": [8 floats], "tag": [l1, l2, l3], "edit": str}``
    (each label optional). ``compare`` orders two texts by their stored per-criterion scores
    (ties 0.5); a text without a row, or without the label asked for, raises ValueError naming
    it.
    """

    def __init__(self, hierarchy: TagHierarchy, path):
        import json

        self.hierarchy = hierarchy
        self._rows: dict[str, dict] = {}
        for lineno, line in text_lines(path, what="label file"):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FileFormatError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise FileFormatError(f"{path}:{lineno}: label row needs a 'text' string field")
            if "tag" in row:
                validate_tags(np.asarray([row["tag"]]), hierarchy)
            if "scores" in row and (not isinstance(row["scores"], list)
                                    or len(row["scores"]) != len(CRITERIA)):
                raise FileFormatError(f"{path}:{lineno}: 'scores' needs a list of "
                                      f"{len(CRITERIA)} values")
            self._rows[row["text"]] = row

    def _get(self, text: str, field: str):
        row = self._rows.get(text)
        if row is None or field not in row:
            raise ValueError(f"label file has no {field!r} for text {text[:60]!r}")
        return row[field]

    def compare(self, texts_a, texts_b):
        """Outcomes from the stored scores: 1 where the first text scores higher, 0 lower, 0.5 tied."""
        sa = np.asarray([self._get(t, "scores") for t in texts_a], np.float64).reshape(-1, len(CRITERIA))
        sb = np.asarray([self._get(t, "scores") for t in texts_b], np.float64).reshape(-1, len(CRITERIA))
        return np.where(sa > sb, 1.0, np.where(sa < sb, 0.0, 0.5)).astype(np.float32)

    def tag(self, texts):
        """The stored tags of each text, checked against the hierarchy."""
        return validate_tags(np.asarray([self._get(t, "tag") for t in texts]).reshape(-1, 3), self.hierarchy)

    def edit(self, texts):
        """The stored edit of each text."""
        return [str(self._get(t, "edit")) for t in texts]
