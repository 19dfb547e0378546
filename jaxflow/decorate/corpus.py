"""Corpus sources for DecorateLM-style data engineering, all offline.

* Real text that ships with Python: the language reference in ``pydoc_data.topics`` and the
  docstrings of a fixed list of standard-library modules. Both vary with the Python version, so
  ``corpus_fingerprint`` records a sha256 of exactly what was used.
* A templated multi-topic generator over the tag tree (21 first-level categories by default):
  every document has a known leaf tag and 8 known latent levels in [0, 1], one per rating
  criterion, which set measurable properties of the text (how many explanations, numbers,
  connectives, stories, opinions, lists, rare words, topic keywords it has).
* Degraded copies of known noise level (markup junk, repeated words, shouted words, extra
  spaces) and keyword-salad noise documents.
* Readers for a user-given JSONL file or text directory, streaming one document at a time.

Token budgets count tokens of one named tokenizer, ``TOKENIZER_NAME``: the project's character
tokenizer over printable ASCII plus newline. ``normalize_text`` maps everything else into that
alphabet (typographic quotes and dashes to ASCII, tabs to spaces, other characters to '?').

Rules for bad input: empty (whitespace-only) texts are skipped by the readers and counted in
``ReadStats.empty``; bytes that are not UTF-8 raise ValueError naming the file, line and byte
offset unless ``errors="replace"`` (then they become '?'); texts longer than ``max_chars`` are
split at whitespace into consecutive chunks with ids ``<id>#<k>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import pathlib
import re
import string
import sys
from typing import Iterable, Iterator, Sequence

import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.decorate.rating import CRITERIA
from jaxflow.decorate.tagging import TagHierarchy
from jaxflow.errors import FileFormatError

#: The tokenizer every token count uses: characters of ALPHABET, ids 0/1/2 = PAD/BOS/EOS.
ALPHABET = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
TOKENIZER_NAME = "jaxflow.data.CharTokenizer(printable ASCII + newline)"

_UNICODE_MAP = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                              "\u2013": "-", "\u2014": "--", "\u2026": "...", "\u00a0": " ",
                              "\t": "    ", "\r": ""})
_ALLOWED = set(ALPHABET)

#: Standard-library modules whose docstrings form the second real-text source.
DOCSTRING_MODULES = ("json", "collections", "itertools", "functools", "heapq", "bisect",
                     "statistics", "fractions", "textwrap", "string", "re", "pathlib",
                     "argparse", "datetime", "calendar", "random", "shlex", "difflib",
                     "csv", "base64", "hashlib", "zipfile", "tarfile", "logging", "unittest",
                     "contextlib", "dataclasses", "enum", "typing", "abc", "copy", "pprint")


def text_tokenizer() -> CharTokenizer:
    """The tokenizer named by TOKENIZER_NAME (vocab_size 99)."""
    return CharTokenizer(ALPHABET)


def normalize_text(text: str) -> str:
    """Maps ``text`` into ALPHABET: typographic punctuation to ASCII, tabs to 4 spaces, carriage
    returns dropped, any other character outside the alphabet to '?'."""
    text = text.translate(_UNICODE_MAP)
    return "".join(c if c in _ALLOWED else "?" for c in text)


@dataclasses.dataclass(frozen=True)
class Document:
    """One text with what is known about it.

    Attributes:
      id: unique string id.
      text: normalised text (characters of ALPHABET).
      source: "pydoc_topics", "docstring", "template", "degraded", "noise" or "user".
      leaf: true level-3 tag id, -1 when unknown.
      latent: true levels of the 8 criteria in [0, 1] (empty when unknown).
      noise: fraction of words the degrader touched (0 for clean text, 1 for noise docs).
    """

    id: str
    text: str
    source: str
    leaf: int = -1
    latent: tuple[float, ...] = ()
    noise: float = 0.0

    def to_json(self) -> dict:
        """The document as one JSONL row (``read_jsonl`` / ``from_json`` read it back)."""
        return {"id": self.id, "text": self.text, "source": self.source, "leaf": self.leaf,
                "latent": list(self.latent), "noise": self.noise}

    @classmethod
    def from_json(cls, row: dict) -> "Document":
        """A document from a JSONL row; only ``id`` and ``text`` are required."""
        return cls(id=str(row["id"]), text=row["text"], source=row.get("source", "user"),
                   leaf=int(row.get("leaf", -1)), latent=tuple(row.get("latent", ())),
                   noise=float(row.get("noise", 0.0)))


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Splits ``text`` into consecutive chunks of at most ``max_chars`` characters, at line or
    word boundaries where one exists in the second half of the window; chunks are stripped and
    empty ones dropped."""
    if max_chars < 16:
        raise ValueError(f"max_chars={max_chars}: need >= 16")
    out, rest = [], text.strip()
    while len(rest) > max_chars:
        window = rest[: max_chars + 1]
        cut = window.rfind("\n\n")
        if cut < max_chars // 2:
            cut = window.rfind("\n")
        if cut < max_chars // 2:
            cut = window.rfind(" ")
        if cut < max_chars // 2:
            cut = max_chars
        out.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    out.append(rest)
    return [c for c in out if c]


def _passages(paragraphs: Iterable[str], max_chars: int) -> list[str]:
    """Greedily packs paragraphs into passages of at most max_chars (long ones chunked)."""
    out, cur = [], ""
    for para in paragraphs:
        para = para.strip("\n")
        if not para.strip():
            continue
        for piece in chunk_text(para, max_chars):
            if cur and len(cur) + 2 + len(piece) > max_chars:
                out.append(cur)
                cur = ""
            cur = piece if not cur else cur + "\n\n" + piece
    if cur:
        out.append(cur)
    return out


def pydoc_passages(max_chars: int) -> list[Document]:
    """The language reference of ``pydoc_data.topics`` as passages of <= max_chars."""
    from pydoc_data import topics

    docs = []
    for name in sorted(topics.topics):
        text = normalize_text(topics.topics[name])
        for k, p in enumerate(_passages(re.split(r"\n\s*\n", text), max_chars)):
            docs.append(Document(id=f"pydoc:{name}#{k}", text=p, source="pydoc_topics"))
    return docs


def docstring_passages(max_chars: int, modules: Sequence[str] = DOCSTRING_MODULES,
                       min_chars: int = 80) -> list[Document]:
    """Docstrings (module, public classes and functions) of ``modules``, as passages."""
    docs = []
    for mod_name in modules:
        mod = importlib.import_module(mod_name)
        items = [(mod_name, mod)] + [(f"{mod_name}.{n}", getattr(mod, n)) for n in sorted(vars(mod))
                                     if not n.startswith("_")]
        seen = set()
        for qual, obj in items:
            if not (inspect.ismodule(obj) and obj is mod or inspect.isclass(obj)
                    or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < min_chars or doc in seen:
                continue
            seen.add(doc)
            text = normalize_text(doc)
            for k, p in enumerate(_passages(re.split(r"\n\s*\n", text), max_chars)):
                docs.append(Document(id=f"doc:{qual}#{k}", text=p, source="docstring"))
    return docs


def corpus_fingerprint(docs: Sequence[Document]) -> dict:
    """sha256 of the documents' ids and texts, with the Python version they came from."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.id.encode())
        h.update(b"\0")
        h.update(d.text.encode())
        h.update(b"\1")
    return {"sha256": h.hexdigest(), "documents": len(docs),
            "characters": int(sum(len(d.text) for d in docs)),
            "python": sys.version.split()[0]}


# -- templated multi-topic generator ------------------------------------------------------

_NAMES = ("Ada", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana")
_GENERIC = ("things", "work", "people", "stuff", "ideas", "matters", "parts")
_RARE = ("recondite", "abstruse", "esoteric", "arcane", "idiosyncratic", "sesquipedalian",
         "perspicacious", "crepuscular", "ineffable", "quixotic")
_PLAIN = ("{K1} is often discussed together with {k2}.",
          "Many people work with {k1} and {k2} every day.",
          "The field of {leaf} covers {k1}, {k2} and {k3}.",
          "There is a lot to say about {k1} and {k3}.")
_EXPLAIN = ("{K1} is defined as the part of {mid} that deals with {k2}.",
            "For example, {k1} is used to measure {k2}.",
            "This means that {k1} depends on {k3} in a simple way.",
            "In other words, {k2} describes how {k1} is organised.")
_FACT = ("In {year}, about {num} percent of {k1} studies involved {k2}.",
         "The first {k1} report was published in {year}.",
         "Roughly {num} thousand {k2} records were counted in {year}.")
_REASON = ("Because {k1} affects {k2}, changes in {k3} therefore follow.",
           "If {k1} increases, then {k2} must also change, since both depend on {k3}.",
           "Hence {k1} cannot explain {k2} unless {k3} is considered as well.")
_STORY = ("One day, {name} walked to the old {k1} hall and asked about {k2}.",
          "Then {name} remembered the {k3} and smiled for a long time.",
          "After that, {name} and a friend had a long talk about {k1}.")
_OPINION = ("I think {k1} is the most beautiful part of {leaf}.",
            "Honestly, I feel that {k2} is terrible and overrated.",
            "In my opinion, {k1} is amazing and I love {k3}.")


class TemplateGenerator:
    """Documents over the tag tree with known tags and known latent criterion levels.

    Criterion levels u (order of ``CRITERIA``) shape the text: u[educational_value],
    u[fact_and_trivia], u[reasoning_level], u[story_likeness], u[subjectivity] raise the share
    of explanation / fact / reasoning / story / opinion sentences; u[expertise] the chance that
    a keyword slot holds a topic keyword rather than a generic word; u[scarcity] the rate of
    rare words; u[structural_format] whether the text is a titled list (> 0.6), lines (> 0.3)
    or one paragraph.
    """

    def __init__(self, hierarchy: TagHierarchy, *, max_chars: int = 256):
        if not hierarchy.keywords or any(len(k) < 3 for k in hierarchy.keywords):
            raise ValueError("TemplateGenerator needs >= 3 keywords for every leaf")
        self.hierarchy, self.max_chars = hierarchy, max_chars

    def document(self, rng: np.random.Generator, doc_id: str, leaf: int,
                 latent: np.ndarray) -> Document:
        """One document of tag ``leaf`` with latent levels ``latent`` [8]."""
        h = self.hierarchy
        u = dict(zip(CRITERIA, latent))
        words = h.keywords[leaf]
        mid, leaf_name = h.names[1][h.parent3[leaf]].lower(), h.names[2][leaf].lower()
        kinds = (_PLAIN, _EXPLAIN, _FACT, _REASON, _STORY, _OPINION)
        p = np.array([0.5, u["educational_value"], u["fact_and_trivia"], u["reasoning_level"],
                      u["story_likeness"], u["subjectivity"]]) ** 2 + 1e-3
        p /= p.sum()
        name = _NAMES[rng.integers(len(_NAMES))]
        sentences, used = [], 0
        for _ in range(12):
            tpl = kinds[rng.choice(6, p=p)]
            tpl = tpl[rng.integers(len(tpl))]
            slots = {}
            for s in ("k1", "k2", "k3"):
                if rng.random() < 0.2 + 0.8 * u["expertise"]:
                    slots[s] = words[rng.integers(len(words))]
                else:
                    slots[s] = _GENERIC[rng.integers(len(_GENERIC))]
                if rng.random() < 0.6 * u["scarcity"]:
                    slots[s] = f"{_RARE[rng.integers(len(_RARE))]} {slots[s]}"
            sent = tpl.format(K1=slots["k1"][:1].upper() + slots["k1"][1:], mid=mid,
                              leaf=leaf_name, year=int(rng.integers(1800, 2025)),
                              num=int(rng.integers(2, 99)), name=name, **slots)
            if sentences and used + len(sent) + 3 > self.max_chars - 16:
                break
            sentences.append(sent)
            used += len(sent) + 3
        if u["structural_format"] > 0.6:
            text = f"Title: {h.names[2][leaf]}\n" + "\n".join(f"- {s}" for s in sentences)
        elif u["structural_format"] > 0.3:
            text = "\n".join(sentences)
        else:
            text = " ".join(sentences)
        return Document(id=doc_id, text=chunk_text(text, self.max_chars)[0], source="template", leaf=leaf,
                        latent=tuple(float(x) for x in latent))

    def generate(self, n: int, *, seed: int, level1_skew: float = 1.0, prefix: str = "tpl",
                 latent_low: float = 0.0) -> list[Document]:
        """``n`` documents; level-1 categories drawn with probability proportional to
        (rank + 1)^-level1_skew (a Zipf-like skew; 0 = uniform), leaves uniform below; latent
        levels uniform in [latent_low, 1]."""
        rng = np.random.default_rng(seed)
        h = self.hierarchy
        n1 = h.sizes[0]
        p1 = (np.arange(n1) + 1.0) ** -level1_skew
        p1 /= p1.sum()
        leaves_of = [[c for c in range(h.sizes[2]) if h.path(c)[0] == a] for a in range(n1)]
        out = []
        for i in range(n):
            a = rng.choice(n1, p=p1)
            leaf = leaves_of[a][rng.integers(len(leaves_of[a]))]
            latent = rng.uniform(latent_low, 1.0, size=len(CRITERIA))
            out.append(self.document(rng, f"{prefix}:{i}", int(leaf), latent))
        return out


# -- degradation and noise -----------------------------------------------------------------

JUNK_MARKERS = ("<br>", "<div>", "</p>", "&nbsp;", "&amp;", "[[ad]]", "[[img]]", "[[link]]")


def degrade(text: str, level: float, rng: np.random.Generator) -> str:
    """A noisy copy: each word, with probability ``level``, gets one of: a junk marker after it,
    repeated, shouted (it and the next word upper-cased, when both are lower-case words), or an
    extra space after it (after a lower-case letter or comma). The programmatic teacher's edit
    undoes these (see teacher.teacher_edit_ops)."""
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"degrade level={level}: valid range [0, 1]")
    out = []
    for line in text.split("\n"):
        lead = len(line) - len(line.lstrip(" "))
        new, shout_next = [], False
        for w in line[lead:].split(" "):
            if shout_next and w.isalpha():
                new.append(w.upper())
                shout_next = False
                continue
            shout_next = False
            if w and rng.random() < level:
                kind = rng.integers(4)
                if kind == 0:
                    new.extend([w, JUNK_MARKERS[rng.integers(len(JUNK_MARKERS))]])
                elif kind == 1 and w.isalpha():
                    new.extend([w, w])
                elif kind == 2 and w.isalpha() and w.islower() and len(w) >= 2:
                    new.append(w.upper())
                    shout_next = True
                elif kind == 3 and w[-1] in "abcdefghijklmnopqrstuvwxyz,":
                    new.append(w + " ")
                else:
                    new.append(w)
            else:
                new.append(w)
        out.append(" " * lead + " ".join(new))
    return "\n".join(out)


def noise_document(rng: np.random.Generator, hierarchy: TagHierarchy, doc_id: str,
                   n_chars: int) -> Document:
    """Keyword salad with junk markers and digits: no sentences, quality 0 by construction."""
    vocab = [w for kws in hierarchy.keywords for w in kws] + list(_GENERIC)
    parts, size = [], 0
    while size < n_chars:
        r = rng.random()
        w = (JUNK_MARKERS[rng.integers(len(JUNK_MARKERS))] if r < 0.2 else
             str(int(rng.integers(0, 10_000))) if r < 0.35 else vocab[rng.integers(len(vocab))])
        parts.append(w)
        size += len(w) + 1
    return Document(id=doc_id, text=" ".join(parts)[:n_chars], source="noise", noise=1.0)


# -- readers ---------------------------------------------------------------------------------

@dataclasses.dataclass
class ReadStats:
    """What a reader skipped or changed: empty texts, replaced bytes, chunked documents."""

    read: int = 0
    empty: int = 0
    replaced_bytes: int = 0
    chunked: int = 0


def _decode(raw: bytes, where: str, errors: str, stats: ReadStats) -> str:
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (file start) is not text
    except UnicodeDecodeError as e:
        if errors != "replace":
            raise FileFormatError(f"{where}: byte offset {e.start} is not UTF-8 "
                                  f"({raw[e.start:e.start + 4]!r}); fix the file or read it "
                                  "with errors='replace'") from None
        stats.replaced_bytes += 1
        return raw.decode("utf-8-sig", errors="replace")


def _emit(doc_id: str, text: str, max_chars: int, stats: ReadStats) -> Iterator[Document]:
    text = normalize_text(text).strip()
    if not text:
        stats.empty += 1
        return
    stats.read += 1
    chunks = chunk_text(text, max_chars)
    if len(chunks) > 1:
        stats.chunked += 1
        for k, c in enumerate(chunks):
            yield Document(id=f"{doc_id}#{k}", text=c, source="user")
    else:
        yield Document(id=doc_id, text=chunks[0], source="user")


def read_jsonl(path: str | pathlib.Path, *, max_chars: int, text_key: str = "text",
               id_key: str = "id", errors: str = "strict",
               stats: ReadStats | None = None) -> Iterator[Document]:
    """Streams Documents from a JSONL file (one object per line with ``text_key``).

    A line without ``text_key`` raises ValueError naming the line; ``id_key`` defaults to the
    line number when absent. Known fields of ``Document`` (source, leaf, latent, noise) are kept.
    """
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors={errors!r}; valid: strict, replace")
    stats = ReadStats() if stats is None else stats
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = _decode(raw, f"{path}:{lineno}", errors, stats)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise FileFormatError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict) or text_key not in row:
                raise FileFormatError(f"{path}:{lineno}: needs a {text_key!r} field")
            doc_id = str(row.get(id_key, lineno))
            if set(row) & {"source", "leaf", "latent"}:
                text = normalize_text(row[text_key]).strip()
                if not text:
                    stats.empty += 1
                    continue
                stats.read += 1
                yield Document.from_json({**row, "id": doc_id, "text": text})
                continue
            yield from _emit(doc_id, row[text_key], max_chars, stats)


def read_text_dir(path: str | pathlib.Path, *, max_chars: int, pattern: str = "*.txt",
                  errors: str = "strict", stats: ReadStats | None = None) -> Iterator[Document]:
    """Streams one Document per file matching ``pattern`` under ``path`` (sorted, recursive),
    id = relative path."""
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors={errors!r}; valid: strict, replace")
    stats = ReadStats() if stats is None else stats
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    for file in sorted(root.rglob(pattern)):
        text = _decode(file.read_bytes(), str(file), errors, stats)
        yield from _emit(str(file.relative_to(root)), text, max_chars, stats)


def write_jsonl(docs: Iterable[Document], path: str | pathlib.Path) -> int:
    """Writes Documents as JSONL; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d.to_json()) + "\n")
            n += 1
    return n


def count_tokens(text: str) -> int:
    """Tokens of ``text`` under TOKENIZER_NAME plus one EOS (characters + 1)."""
    return len(text) + 1


def split_heldout(docs: Sequence[Document], fraction: float, *, seed: int):
    """(kept, held_out) by a seeded random split of ``docs``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction={fraction}; valid: (0, 1)")
    rng = np.random.default_rng(seed)
    mask = rng.random(len(docs)) < fraction
    return [d for d, m in zip(docs, mask) if not m], [d for d, m in zip(docs, mask) if m]


def latent_quality(doc: Document) -> float:
    """A document's known quality in [0, 1]: mean latent level of the four main criteria
    (educational value, expertise, fact and trivia, reasoning) times (1 - noise); clean real
    text counts as 1 before noise; nan when unknown (user text)."""
    if doc.source == "noise":
        return 0.0
    if doc.latent:
        base = float(np.mean(doc.latent[:4]))
    elif doc.source in ("pydoc_topics", "docstring", "degraded"):
        base = 1.0
    else:
        return math.nan
    return base * (1.0 - doc.noise)
