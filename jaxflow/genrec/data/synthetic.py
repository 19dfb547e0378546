"""Synthetic multi-scenario recommendation data with known user intents (tests and CI).

Catalogue: G genres x S sub-clusters; each (genre, sub-cluster) cell holds the same number of
items, a fraction of them "new releases", with Zipf popularity inside the cell. Item features
are the genre and cell one-hots, the new flag and Gaussian noise, so semantic IDs can recover
the structure.

Users: each has ``fav_genres`` favourite genres and, per genre, a preferred sub-cluster (the
known intent). A history item comes from a favourite genre with probability ``p_fav`` (its
preferred sub-cluster with probability ``p_sub``), otherwise from anywhere; history items are
never new releases. Requests (scenario -> target, instruction):

* ``genre``: a favourite genre g, its preferred sub-cluster w.p. p_sub; instruction [genre, g];
* ``new``: a new release of a favourite genre's preferred sub-cluster; instruction [new];
* ``different``: a genre g the user does not favour, any sub-cluster; instruction [different, g].

Without the instruction a model can at best guess the scenario and the genre, which is what
the instruction-following test measures.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.config_domains import COUNT, COUNT0, NON_NEGATIVE, UNIT, Real, domains
from jaxflow.genrec.data.requests import SCENARIOS, RecData, Requests, instruction_tokens, pad_histories


@domains(n_genres=COUNT, n_sub=COUNT, items_per_cell=COUNT, new_fraction=Real(0.0, 1.0, high_open=True),
         n_users=COUNT, min_history=COUNT, max_history=COUNT, fav_genres=COUNT, p_fav=UNIT, p_sub=UNIT,
         zipf_a=NON_NEGATIVE, train_requests_per_user=COUNT, test_users=COUNT, feature_noise=NON_NEGATIVE,
         noise_dim=COUNT0, behaviour_probs=UNIT, behaviour_weights=NON_NEGATIVE)
@dataclasses.dataclass(frozen=True)
class SyntheticGenRecConfig:
    """The synthetic multi-scenario catalogue and users: genres x sub-genres of items, new-item share, users, history
    lengths, favourite-genre and popularity (Zipf) parameters."""
    n_genres: int = 6
    n_sub: int = 4
    items_per_cell: int = 20
    new_fraction: float = 0.2
    n_users: int = 600
    min_history: int = 8
    max_history: int = 32
    fav_genres: int = 2
    p_fav: float = 0.85
    p_sub: float = 0.8
    zipf_a: float = 1.0
    train_requests_per_user: int = 4
    test_users: int = 200  # each gets one test request per scenario
    feature_noise: float = 0.3
    noise_dim: int = 8
    behaviour_probs: tuple[float, ...] = (0.7, 0.2, 0.1)  # click, cart, purchase
    behaviour_weights: tuple[float, ...] = (1.0, 2.0, 3.0)

    def __post_init__(self):
        if self.fav_genres >= self.n_genres:
            raise ValueError(f"fav_genres={self.fav_genres} must be < n_genres={self.n_genres} "
                             "(the 'different' scenario needs a non-favourite genre)")
        new = round(self.items_per_cell * self.new_fraction)
        if not 1 <= new < self.items_per_cell:
            raise ValueError(f"items_per_cell={self.items_per_cell} x new_fraction="
                             f"{self.new_fraction} must leave >= 1 new and >= 1 old item per cell")
        if self.test_users > self.n_users or self.min_history > self.max_history:
            raise ValueError(f"need test_users <= n_users and min_history <= max_history, got "
                             f"{self.test_users}, {self.n_users}, {self.min_history}, "
                             f"{self.max_history}")


class _Catalogue:
    def __init__(self, c: SyntheticGenRecConfig, rng: np.random.Generator):
        cells = c.n_genres * c.n_sub
        n = cells * c.items_per_cell
        perm = rng.permutation(n)  # item ids are not sorted by cell
        cell = np.repeat(np.arange(cells), c.items_per_cell)[np.argsort(perm)]
        rank = np.tile(np.arange(c.items_per_cell), cells)[np.argsort(perm)]
        n_new = round(c.items_per_cell * c.new_fraction)
        self.genre = (cell // c.n_sub).astype(np.int32)
        self.sub = (cell % c.n_sub).astype(np.int32)
        self.new = rank >= c.items_per_cell - n_new  # the least popular ranks are the new ones
        pop = 1.0 / (1.0 + np.where(self.new, rank - (c.items_per_cell - n_new), rank)) ** c.zipf_a
        self.members = {}
        for key in zip(*np.unique(np.stack([cell, self.new]), axis=1)):
            ids = np.flatnonzero((cell == key[0]) & (self.new == key[1]))
            self.members[(int(key[0]), bool(key[1]))] = (ids, pop[ids] / pop[ids].sum())
        self.features = np.concatenate([
            2.0 * np.eye(c.n_genres, dtype=np.float32)[self.genre],
            np.eye(cells, dtype=np.float32)[cell],
            self.new[:, None].astype(np.float32),
            c.feature_noise * rng.standard_normal((n, c.noise_dim)).astype(np.float32)], axis=1)
        self.n_sub = c.n_sub

    def draw(self, rng, genre: int, sub: int, new: bool, exclude=()) -> int:
        ids, p = self.members[(genre * self.n_sub + sub, new)]
        if exclude:
            keep = ~np.isin(ids, list(exclude))
            if keep.any():
                ids, p = ids[keep], p[keep] / p[keep].sum()
        return int(rng.choice(ids, p=p))


def generate(config: SyntheticGenRecConfig = SyntheticGenRecConfig(), *, seed: int = 0) -> RecData:
    """A RecData drawn from ``config``; a pure function of (config, seed)."""
    c = config
    rng = np.random.default_rng([seed, 25])
    cat = _Catalogue(c, rng)
    G, S = c.n_genres, c.n_sub
    fav = np.stack([rng.choice(G, c.fav_genres, replace=False) for _ in range(c.n_users)])
    pref = rng.integers(0, S, (c.n_users, G))
    beh_p = np.asarray(c.behaviour_probs) / np.sum(c.behaviour_probs)

    histories, behaviours = [], []
    for u in range(c.n_users):
        h = []
        for _ in range(int(rng.integers(c.min_history, c.max_history + 1))):
            if rng.random() < c.p_fav:
                g = int(rng.choice(fav[u]))
                s = int(pref[u, g]) if rng.random() < c.p_sub else int(rng.integers(S))
            else:
                g, s = int(rng.integers(G)), int(rng.integers(S))
            h.append(cat.draw(rng, g, s, False, exclude=h))
        histories.append(h)
        behaviours.append(rng.choice(len(beh_p), len(h), p=beh_p).tolist())

    def request(u: int, scenario: int):
        name = SCENARIOS[scenario]
        if name == "different":
            g = int(rng.choice(np.setdiff1d(np.arange(G), fav[u])))
            s, new, shown = int(rng.integers(S)), False, g
        else:
            g = int(rng.choice(fav[u]))
            s = int(pref[u, g]) if rng.random() < c.p_sub else int(rng.integers(S))
            new = name == "new"
            shown = -1 if new else g
        return cat.draw(rng, g, s, new, exclude=histories[u]), shown

    def build(users, scenarios) -> Requests:
        targets, shown = zip(*(request(int(u), int(s)) for u, s in zip(users, scenarios)))
        hist, beh = pad_histories([histories[u] for u in users], [behaviours[u] for u in users],
                                  c.max_history)
        return Requests(history=hist, behaviour=beh,
                        instruction=instruction_tokens(scenarios, shown, len(SCENARIOS)),
                        scenario=np.asarray(scenarios, np.int32),
                        target=np.asarray(targets, np.int32),
                        target_behaviour=rng.choice(len(beh_p), len(users), p=beh_p).astype(np.int32),
                        user=np.asarray(users, np.int32))

    train_users = np.repeat(np.arange(c.n_users), c.train_requests_per_user)
    train = build(train_users, rng.integers(0, len(SCENARIOS), len(train_users)))
    test_users = np.repeat(np.arange(c.test_users), len(SCENARIOS))
    test = build(test_users, np.tile(np.arange(len(SCENARIOS)), c.test_users))
    return RecData(item_features=cat.features, item_genre=cat.genre, item_new=cat.new,
                   genre_names=tuple(f"genre{g}" for g in range(G)), scenarios=SCENARIOS,
                   behaviour_weights=tuple(c.behaviour_weights), train=train, test=test,
                   source=f"synthetic (seed {seed}: {len(cat.genre)} items, {c.n_users} users, "
                          f"{G} genres x {S} sub-clusters)")
