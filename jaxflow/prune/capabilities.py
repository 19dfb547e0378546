"""The capability-mixture corpus and capability-decomposed evaluation.

Four capabilities, each a generator of short documents ``[BOS] prompt answer [EOS]`` over one
character alphabet (``ALPHABET``), all drawn from a fixed synthetic "world" (``World``: made-up
countries, capitals, objects and their properties, fixed by ``world_seed``):

- math:        ``"47+385="`` -> ``"432"`` (addition / subtraction), exact match.
- code:        a mini-language with variables ``"a=4;b=7;c=a;c?"`` -> ``"4"`` and bracket
               completion ``"close ([{<|"`` -> ``">}])"``, exact match.
- general:     templated facts ``"the capital of zorla is "`` -> ``"mipu."``, exact match; the
               training mixture also holds grammar-generated sentences (``grammar_sentence``,
               unscored plain text, the "general text" calibration source).
- commonsense: ``"q: which is hot? a: "`` with 4 choices (one object that has the property,
               three that do not), scored by the log-likelihood of each choice.

Scores are accuracies in [0, 1]; retention = pruned score / dense score.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.models.decode_kernel import DecodeKernel
from jaxflow.models.sampler import SamplingConfig, make_sampler
from jaxflow.rollout.paged_attention import paged_attention

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 +-=;?.:()[]{}<>|"
CAPABILITIES = ("math", "code", "general", "commonsense")
PROPERTIES = ("hot", "cold", "wet", "soft", "loud", "heavy", "sharp", "bright")
_BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


def make_tokenizer() -> CharTokenizer:
    return CharTokenizer(ALPHABET)


def _word(rng: np.random.Generator, syllables: int) -> str:
    cons, vows = "bdfgklmnprstvz", "aeiou"
    return "".join(rng.choice(list(cons)) + rng.choice(list(vows)) for _ in range(syllables))


@dataclasses.dataclass(frozen=True)
class World:
    """Facts shared by training, calibration and evaluation."""

    capitals: tuple[tuple[str, str], ...]  # (country, capital)
    objects: tuple[tuple[str, str], ...]  # (object, property)
    math_digits: int = 2  # operands of the math capability have up to this many digits


@functools.lru_cache(maxsize=8)
def make_world(world_seed: int = 0, n_countries: int = 48, n_objects: int = 64,
               math_digits: int = 2) -> World:
    rng = np.random.default_rng([world_seed, 0xC0DE])
    names: set[str] = set()

    def fresh(syl):
        while True:
            w = _word(rng, syl)
            if w not in names:
                names.add(w)
                return w

    capitals = tuple((fresh(3), fresh(2)) for _ in range(n_countries))
    objects = tuple((fresh(2), PROPERTIES[i % len(PROPERTIES)]) for i in range(n_objects))
    return World(capitals, objects, math_digits)


@dataclasses.dataclass(frozen=True)
class Example:
    """One scored item: exact match of ``answer`` after ``prompt``, or a choice among
    ``choices`` (index ``label``) by log-likelihood."""

    capability: str
    prompt: str
    answer: str
    choices: tuple[str, ...] = ()
    label: int = 0


def math_example(rng: np.random.Generator, world: World) -> Example:
    a, b = (int(v) for v in rng.integers(0, 10**world.math_digits, size=2))
    if rng.random() < 0.5:
        return Example("math", f"{a}+{b}=", str(a + b))
    a, b = max(a, b), min(a, b)
    return Example("math", f"{a}-{b}=", str(a - b))


def code_example(rng: np.random.Generator, world: World) -> Example:
    if rng.random() < 0.5:
        names = rng.choice(list("abcdefghxyz"), size=3, replace=False)
        values = rng.integers(0, 10, size=2)
        src = int(rng.integers(0, 2))
        prog = f"{names[0]}={values[0]};{names[1]}={values[1]};{names[2]}={names[src]};{names[2]}?"
        return Example("code", prog, str(values[src]))
    opens = "".join(rng.choice(list(_BRACKETS), size=int(rng.integers(2, 6))))
    return Example("code", f"close {opens}|", "".join(_BRACKETS[c] for c in reversed(opens)))


def general_example(rng: np.random.Generator, world: World) -> Example:
    country, capital = world.capitals[int(rng.integers(len(world.capitals)))]
    return Example("general", f"the capital of {country} is ", f"{capital}.")


def commonsense_example(rng: np.random.Generator, world: World) -> Example:
    prop = PROPERTIES[int(rng.integers(len(PROPERTIES)))]
    right = [o for o, p in world.objects if p == prop]
    wrong = [o for o, p in world.objects if p != prop]
    answer = str(rng.choice(right))
    distractors = [str(x) for x in rng.choice(wrong, size=3, replace=False)]
    label = int(rng.integers(4))
    choices = distractors[:label] + [answer] + distractors[label:]
    return Example("commonsense", f"q: which is {prop}? a: ", f"{answer}.",
                   tuple(f"{c}." for c in choices), label)


EXAMPLE_FNS: dict[str, Callable[[np.random.Generator, World], Example]] = {
    "math": math_example, "code": code_example, "general": general_example,
    "commonsense": commonsense_example,
}

_SUBJ = ("the cat", "a dog", "the bird", "my friend", "the old man", "a child", "the farmer")
_VERB = ("sees", "likes", "finds", "follows", "helps", "calls")
_OBJ = ("the river", "a tree", "the house", "a small boat", "the red door", "the market")
_ADV = ("today", "again", "at night", "in the rain", "slowly", "")


def grammar_sentence(rng: np.random.Generator, world: World) -> str:
    """A sentence from a small grammar, sometimes mentioning world facts in free form."""
    r = rng.random()
    if r < 0.15:
        country, capital = world.capitals[int(rng.integers(len(world.capitals)))]
        return f"people in {capital} like {country}."
    if r < 0.3:
        obj, prop = world.objects[int(rng.integers(len(world.objects)))]
        return f"a {obj} is {prop}."
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    adv = pick(_ADV)
    return f"{pick(_SUBJ)} {pick(_VERB)} {pick(_OBJ)}{' ' + adv if adv else ''}."


def document(rng: np.random.Generator, world: World, source: str) -> str:
    """One training/calibration document of ``source`` (a capability or "text")."""
    if source == "text":
        return " ".join(grammar_sentence(rng, world) for _ in range(int(rng.integers(1, 4))))
    ex = EXAMPLE_FNS[source](rng, world)
    return ex.prompt + ex.answer


def pack_documents(docs: list[str], tokenizer: CharTokenizer, *, rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """Packs ``[BOS] doc [EOS]`` segments greedily into ``rows`` x ``seq_len`` (+1 for targets).

    Returns tokens/targets/loss_mask/segment_ids/positions, [rows, seq_len] each (the packed
    format of ``jaxflow.train.lm_state.make_train_step``); stops when rows are full.
    """
    length = seq_len + 1
    stream = np.zeros((rows, length), np.int32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    row, col, sid = 0, 0, 1
    for doc in docs:
        ids = tokenizer.encode(doc, bos=True, eos=True)[:length]
        if col + len(ids) > length:
            row, col, sid = row + 1, 0, 1
            if row == rows:
                break
        stream[row, col:col + len(ids)] = ids
        seg[row, col:col + len(ids)] = sid
        pos[row, col:col + len(ids)] = np.arange(len(ids))
        col, sid = col + len(ids), sid + 1
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    return {"tokens": stream[:, :-1], "targets": stream[:, 1:], "loss_mask": same.astype(np.float32),
            "segment_ids": seg[:, :-1], "positions": pos[:, :-1]}


def mixture_batch(world: World, tokenizer: CharTokenizer, *, seed: int, step: int, rows: int,
                  seq_len: int, weights: dict[str, float]) -> dict[str, np.ndarray]:
    """Training batch ``step`` of the capability mixture (sources drawn by ``weights``)."""
    rng = np.random.default_rng([seed, step, 0x313])
    names = list(weights)
    p = np.asarray([weights[n] for n in names], np.float64)
    picks = rng.choice(len(names), size=rows * seq_len // 8, p=p / p.sum())
    return pack_documents([document(rng, world, names[i]) for i in picks], tokenizer, rows=rows,
                          seq_len=seq_len)


def eval_set(world: World, capability: str, n: int, *, seed: int) -> list[Example]:
    rng = np.random.default_rng([seed, CAPABILITIES.index(capability), 0xE7A1])
    return [EXAMPLE_FNS[capability](rng, world) for _ in range(n)]


class CapabilityEvaluator:
    """Scores params of one model structure on fixed per-capability evaluation sets.

    ``fns`` is the model's ``LMFunctions`` (``jaxflow.train.lm_state.lm_functions``). The sets
    are the synthetic world's (``n`` items per capability of ``CAPABILITIES``) unless ``sets``
    ({capability: [Example]}, e.g. from ``jaxflow.prune.task_files.load_task_files``) is
    given. A capability whose items have ``choices`` is scored by log-likelihood, the others
    by exact match of greedy decoding. ``__call__(params) -> {capability: accuracy}``.
    """

    def __init__(self, fns, tokenizer: CharTokenizer, world: World | None, *, n: int,
                 seed: int = 1234, sets: dict[str, list[Example]] | None = None):
        self.fns, self.tokenizer = fns, tokenizer
        if sets is None:
            sets = {c: eval_set(world, c, n, seed=seed) for c in CAPABILITIES}
        self.sets = sets
        self.capabilities = tuple(sets)
        self._exact, self._choice = {}, {}
        for cap, exs in sets.items():
            if exs[0].choices:
                self._choice[cap] = self._choice_set(exs)
                continue
            prompts, lengths = tokenizer.pad_batch([self._prompt_ids(e) for e in exs])
            max_new = max(len(tokenizer.encode(e.answer)) for e in exs) + 1
            sampler = make_sampler(fns.graphdef, SamplingConfig(
                max_new_tokens=max_new, temperature=0.0, eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id), decode_kernel=DecodeKernel(paged_attention))  # TPU / GPU: the kernel
            self._exact[cap] = (sampler, jnp.asarray(prompts), jnp.asarray(lengths), exs)
        self._choice_ll = jax.jit(self._choice_loglik)

    def _prompt_ids(self, e: Example) -> list[int]:
        return self.tokenizer.encode(e.prompt, bos=True)

    def _choice_set(self, exs: list[Example]):
        seqs, starts, ends = [], [], []
        for e in exs:
            prompt = self._prompt_ids(e)
            for c in e.choices:
                seqs.append(prompt + self.tokenizer.encode(c))
                starts.append(len(prompt))
                ends.append(len(seqs[-1]))
        tokens, _ = self.tokenizer.pad_batch(seqs)
        idx = np.arange(tokens.shape[1])[None, :]
        # score targets t in [start, end): log p(tokens[t] | tokens[:t]) taken at position t-1
        mask = ((idx >= np.array(starts)[:, None]) & (idx < np.array(ends)[:, None]))[:, 1:]
        return (jnp.asarray(tokens), jnp.asarray(mask, jnp.float32),
                np.array([e.label for e in exs]), len(exs[0].choices))

    def _decode(self, ids) -> str | None:
        """Generated text up to EOS; None (never a match) if the model emitted an id outside
        the tokenizer (the model's vocabulary may be padded beyond it)."""
        ids = [int(i) for i in ids]
        if self.tokenizer.eos_id in ids:
            ids = ids[:ids.index(self.tokenizer.eos_id)]
        specials = {self.tokenizer.pad_id, self.tokenizer.bos_id} - {None}
        if any(i >= self.tokenizer.vocab_size or i in specials for i in ids):
            return None
        return self.tokenizer.decode(ids)

    def _choice_loglik(self, params, tokens, mask):
        logits = self.fns.model(params)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        ll = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return (ll * mask).sum(-1)

    def __call__(self, params) -> dict[str, float]:
        state = self.fns.nnx_state(params)
        scores = {}
        for cap, (sampler, prompts, lengths, exs) in self._exact.items():
            out = sampler(state, prompts, lengths, jax.random.key(0))
            got = [self._decode(row) for row in np.asarray(out.tokens)]
            scores[cap] = float(np.mean([g == e.answer for g, e in zip(got, exs)]))
        for cap, (tokens, mask, labels, n_choices) in self._choice.items():
            ll = np.asarray(self._choice_ll(params, tokens, mask))
            scores[cap] = float(np.mean(ll.reshape(-1, n_choices).argmax(-1) == labels))
        return {c: scores[c] for c in self.capabilities}


def retention(pruned: dict[str, float], dense: dict[str, float]) -> dict[str, float]:
    """Per-capability pruned / dense score (nan where the dense score is 0), plus ``"total"``
    = mean over the capabilities of ``dense`` (nan when none is defined)."""
    out = {c: (pruned[c] / dense[c] if dense[c] > 0 else float("nan")) for c in dense}
    defined = [v for v in out.values() if v == v]
    out["total"] = float(np.mean(defined)) if defined else float("nan")
    return out
