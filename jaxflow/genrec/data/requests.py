"""The request layout every generative-recommendation data source produces.

A *request* is (user history, scenario instruction) -> the next item. Histories are int32
item ids, left-aligned and padded with -1 (the valid entries are a prefix, oldest first).
Instruction tokens: 0 = padding, ``1 .. S`` the scenario tokens, ``S + 1 .. S + G`` the genre
(or category) tokens; an instruction is ``[scenario token, genre token or 0]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SCENARIOS = ("genre", "new", "different")
SCENARIO_TEXT = {
    "genre": "more from a genre the user watches",
    "new": "new releases the user would like",
    "different": "something different: a genre the user has not watched",
}


@dataclasses.dataclass(frozen=True)
class Requests:
    """Parallel arrays over R requests (see the module docstring for the layout).

    Attributes:
      history: int32[R, H] item ids, -1 padded; behaviour: int32[R, H] behaviour types.
      instruction: int32[R, I] instruction tokens; scenario: int32[R] index into scenarios.
      target: int32[R] next item; target_behaviour: int32[R]; user: int32[R].
    """

    history: np.ndarray
    behaviour: np.ndarray
    instruction: np.ndarray
    scenario: np.ndarray
    target: np.ndarray
    target_behaviour: np.ndarray
    user: np.ndarray

    def __len__(self) -> int:
        return int(self.target.shape[0])

    def take(self, idx) -> "Requests":
        """The requests at ``idx`` (int array)."""
        return Requests(**{f.name: getattr(self, f.name)[idx] for f in dataclasses.fields(self)})

    def of_scenario(self, s: int) -> "Requests":
        """The requests of scenario ``s``."""
        return self.take(np.flatnonzero(self.scenario == s))


@dataclasses.dataclass(frozen=True)
class RecData:
    """A catalogue plus train / test requests.

    Attributes:
      item_features: f32[N, F] features the semantic IDs are built from.
      item_genre: int32[N] primary genre / category per item (genre-match reward).
      item_new: bool[N] "new release" flag.
      genre_names: G names; scenarios: S scenario names (instruction token s + 1).
      behaviour_weights: loss weight per behaviour type.
      train, test: Requests.
      source: a one-line description of where the data came from.
    """

    item_features: np.ndarray
    item_genre: np.ndarray
    item_new: np.ndarray
    genre_names: tuple[str, ...]
    scenarios: tuple[str, ...]
    behaviour_weights: tuple[float, ...]
    train: Requests
    test: Requests
    source: str

    @property
    def n_items(self) -> int:
        """Items in the catalogue."""
        return int(self.item_features.shape[0])

    @property
    def instruction_vocab(self) -> int:
        """Instruction token ids: padding, one per scenario, one per genre."""
        return 1 + len(self.scenarios) + len(self.genre_names)


def instruction_tokens(scenario, genre, n_scenarios: int) -> np.ndarray:
    """int32[R, 2] ``[scenario + 1, genre + 1 + S or 0 when genre < 0]``."""
    scenario = np.asarray(scenario, np.int64)
    genre = np.asarray(genre, np.int64)
    genre_tok = np.where(genre >= 0, genre + 1 + n_scenarios, 0)
    return np.stack([scenario + 1, genre_tok], axis=1).astype(np.int32)


def pad_histories(histories, behaviours, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Lists of per-request id / behaviour lists -> int32[R, max_len] arrays, -1 / 0 padded.
    Histories longer than ``max_len`` keep their latest ``max_len`` entries."""
    r = len(histories)
    hist = np.full((r, max_len), -1, np.int32)
    beh = np.zeros((r, max_len), np.int32)
    for i, (h, b) in enumerate(zip(histories, behaviours)):
        h, b = list(h)[-max_len:] if max_len else [], list(b)[-max_len:] if max_len else []
        hist[i, :len(h)] = h
        beh[i, :len(b)] = b
    return hist, beh
