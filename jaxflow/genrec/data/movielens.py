"""MovieLens as multi-scenario generative-recommendation requests, from user-given files.

Ratings: ml-100k ``u.data`` (tab separated), a RecBole atomic ``.inter`` file with a typed
header (``user_id:token item_id:token rating:float timestamp:float``, any column order; read by
``jaxflow.recsys.readers.read_atomic_file``) or ml-1m ``ratings.dat`` (``::``). Items: a RecBole
``.item`` file (``item_id:token movie_title:token_seq release_year:token class:token_seq``;
``title`` / ``year`` / ``genre`` are accepted as column names too), ml-100k ``u.item`` (``|``,
19 genre flags) or ml-1m ``movies.dat`` (``id::Title (Year)::Genre|Genre``). Given as
``items_path`` or found beside the ratings file: ``<stem>.item`` (RecBole's ``ml-100k.inter``
-> ``ml-100k.item`` in the same folder), then ``u.item``, then ``movies.dat``. Item ids must be
integers (MovieLens). Every rating is an interaction (MovieLens has no behaviour types: one
type, weight 1).

Rules:
* split: per user, interactions sorted by time (file order breaks ties); the last one is the
  test target, every earlier position t >= 1 a training target with history s_0..s_{t-1}
  (the latest ``max_train_per_user`` of them). A user with one rating gets a test request
  with an empty history (the encoder then reads only the instruction).
* item features: genre multi-hot, release year (scaled, plus a decade one-hot) and hashed
  title tokens; an item that is rated but missing from the items file is an error naming it.
  Without an items file, item embeddings come from co-occurrence (PPMI of items rated by the
  same user, truncated SVD) and the "genre" is the item's k-means cluster of that embedding.
* scenarios, from the data: ``new`` when the target is a new release (release year, or first
  rating time without years, in the catalogue's latest ``new_fraction``); else ``genre``
  when the target's primary genre occurs in the history, with that genre in the instruction;
  else ``different`` with the target's genre in the instruction. The instruction is thus
  derived from the held-out target (standing in for the slow-thinking model's instruction).
"""

from __future__ import annotations

import pathlib
import re
import zlib

import jax
import numpy as np

from jaxflow.errors import FileFormatError, text_lines
from jaxflow.genrec.data.requests import SCENARIOS, RecData, Requests, instruction_tokens, pad_histories
from jaxflow.genrec.semantic_ids import kmeans
from jaxflow.recsys.readers import ATOMIC_TYPES, read_atomic_file, read_atomic_ratings, read_movielens

ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                 "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                 "Romance", "Sci-Fi", "Thriller", "War", "Western")


def read_ratings(path) -> dict:
    """int64 user / item / timestamp and f32 rating arrays, in file order."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileFormatError(f"ratings file {str(path)!r} does not exist")
    if path.suffix != ".inter":
        return read_movielens(path)
    return read_atomic_ratings(path)  # every id, rating and timestamp checked (file:line)


def _first_column(header_names, candidates, path, what):
    for c in candidates:
        if c in header_names:
            return c
    raise FileFormatError(f"{path}: no {what} column (one of {list(candidates)}) in the header")


def _is_atomic(path) -> bool:
    """Whether the first line is a RecBole typed header (``name:type`` fields, tab separated)."""
    with open(path, encoding="latin-1") as f:
        fields = f.readline().rstrip("\r\n").split("\t")
    return all(f.rpartition(":")[0] and f.rpartition(":")[2] in ATOMIC_TYPES for f in fields)


def read_recbole_items(path) -> tuple[dict[int, tuple[str, int | None, list[str]]],
                                      tuple[str, ...]]:
    """({item id: (title, year or None, genres)}, genre names in order of first appearance)
    from a RecBole ``.item`` atomic file; a year field without 4 digits (ml-100k has
    ``unkonwn``) is None."""
    path = pathlib.Path(path)
    first = next(text_lines(path, what="RecBole item file"), (1, ""))[1]
    names = [h.rpartition(":")[0] for h in first.rstrip("\r\n").split("\t")]
    title = _first_column(names, ("movie_title", "title"), path, "title")
    year = _first_column(names, ("release_year", "year"), path, "year")
    genre = _first_column(names, ("class", "genre", "genres"), path, "genre")
    cols = read_atomic_file(path, columns=("item_id", title, year, genre))
    items: dict[int, tuple[str, int | None, list[str]]] = {}
    genre_names: list[str] = []
    for row, (iid, t, y, gs) in enumerate(zip(*cols.values()), 2):
        try:
            item = int(iid)
        except ValueError:
            raise FileFormatError(f"{path}:{row}: item id {iid!r} is not an int") from None
        t = " ".join(t) if isinstance(t, list) else str(t)
        y = " ".join(y) if isinstance(y, list) else str(y)
        gs = gs if isinstance(gs, list) else str(gs).split()
        m = re.search(r"(\d{4})", y)
        items[item] = (t, int(m.group(1)) if m else None, list(gs))
        genre_names += [g for g in gs if g not in genre_names]
    if not items:
        raise FileFormatError(f"{path}: no items")
    return items, tuple(genre_names)


def read_items(path) -> tuple[dict[int, tuple[str, int | None, list[str]]], tuple[str, ...]]:
    """({item id: (title, year or None, genres)}, genre names) from a RecBole ``.item`` file
    (recognised by its typed header), u.item or movies.dat."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileFormatError(f"items file {str(path)!r} does not exist")
    if _is_atomic(path):
        return read_recbole_items(path)
    items: dict[int, tuple[str, int | None, list[str]]] = {}
    pipe = path.name == "u.item" or "::" not in path.read_text(encoding="latin-1")[:2000]
    genre_names: list[str] = list(ML100K_GENRES) if pipe else []
    with open(path, encoding="latin-1") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if pipe:
                parts = line.split("|")
                if len(parts) < 5 + len(ML100K_GENRES):
                    raise FileFormatError(f"{path}:{lineno}: {len(parts)} '|' fields; u.item has "
                                          f"{5 + len(ML100K_GENRES)}")
                flags = parts[5:5 + len(ML100K_GENRES)]
                genres = [g for g, f_ in zip(ML100K_GENRES, flags) if f_.strip() == "1"]
                title, date = parts[1], parts[2]
                year = re.search(r"(\d{4})", date) or re.search(r"\((\d{4})\)", title)
            else:
                parts = line.split("::")
                if len(parts) < 3:
                    raise FileFormatError(f"{path}:{lineno}: {len(parts)} '::' fields; movies.dat "
                                          "has id::title::genres")
                title, genres = parts[1], [g for g in parts[2].split("|") if g]
                year = re.search(r"\((\d{4})\)\s*$", title)
                for g in genres:
                    if g not in genre_names:
                        genre_names.append(g)
            try:
                item = int(parts[0])
            except ValueError:
                raise FileFormatError(f"{path}:{lineno}: item id {parts[0]!r} is not an int") from None
            items[item] = (title, int(year.group(1)) if year else None, genres)
    if not items:
        raise FileFormatError(f"{path}: no items")
    return items, tuple(genre_names)


def find_items_file(ratings_path) -> pathlib.Path | None:
    """``<stem>.item``, u.item or movies.dat beside the ratings file (in that order), else
    None."""
    ratings_path = pathlib.Path(ratings_path)
    folder = ratings_path.parent
    for name in (ratings_path.stem + ".item", "u.item", "movies.dat"):
        if (folder / name).is_file():
            return folder / name
    return None


def _title_tokens(title: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", re.sub(r"\(\d{4}\)", "", title.lower()))


def item_feature_matrix(item_ids, items: dict, genre_names, *, title_dim: int = 32) -> np.ndarray:
    """f32[N, G + 1 + decades + title_dim] features of raw ``item_ids`` (in that order).

    Raises:
      ValueError: naming the item ids missing from the items file.
    """
    missing = [int(i) for i in item_ids if int(i) not in items]
    if missing:
        raise ValueError(f"items {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} in all) are rated but have no features in the items "
                         "file; pass the matching items file or none (co-occurrence embeddings)")
    years = np.asarray([items[int(i)][1] or 0 for i in item_ids], np.float64)
    known = years > 0
    lo, hi = (years[known].min(), years[known].max()) if known.any() else (0.0, 1.0)
    decades = np.unique((years[known] // 10).astype(int)) if known.any() else np.zeros(0, int)
    g_index = {g: k for k, g in enumerate(genre_names)}
    feats = np.zeros((len(item_ids), len(genre_names) + 1 + len(decades) + title_dim), np.float32)
    for row, i in enumerate(item_ids):
        title, year, genres = items[int(i)]
        for g in genres:
            feats[row, g_index[g]] = 1.0
        if year:
            feats[row, len(genre_names)] = (year - lo) / max(hi - lo, 1.0)
            feats[row, len(genre_names) + 1 + int(np.searchsorted(decades, year // 10))] = 0.5
        for tok in _title_tokens(title):
            feats[row, -title_dim + zlib.crc32(tok.encode()) % title_dim] += 0.25
    return feats


def cooccurrence_embeddings(sequences, n_items: int, *, dim: int = 32) -> np.ndarray:
    """f32[N, dim]: truncated SVD of the PPMI matrix of items rated by the same user."""
    if n_items > 20000:
        raise ValueError(f"co-occurrence embeddings are dense N x N; n_items={n_items} > 20000, "
                         "give an items file or an embedding file instead")
    x = np.zeros((len(sequences), n_items), np.float32)
    for u, seq in enumerate(sequences):
        x[u, seq] = 1.0
    co = x.T @ x
    np.fill_diagonal(co, 0.0)
    total = max(co.sum(), 1.0)
    row = co.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        pmi = np.log(co * total / np.maximum(row * row.T, 1e-12))
    ppmi = np.where(np.isfinite(pmi) & (pmi > 0), pmi, 0.0).astype(np.float32)
    u, s, _ = np.linalg.svd(ppmi, full_matrices=False)
    k = min(dim, len(s))
    emb = u[:, :k] * np.sqrt(s[:k])
    return np.pad(emb, ((0, 0), (0, dim - k))).astype(np.float32)


def read_embedding_file(path, item_ids) -> np.ndarray:
    """f32[N, D] rows of a text file ``item_id v_1 ... v_D`` (spaces, tabs or commas) for raw
    ``item_ids`` in that order.

    Raises:
      ValueError: unparsable lines, rows of different widths, or rated items without a row.
    """
    table: dict[int, list[float]] = {}
    for lineno, line in text_lines(path, what="item feature file"):
        parts = line.replace(",", " ").split()
        if not parts:
            continue
        try:
            table[int(parts[0])] = [float(x) for x in parts[1:]]
        except ValueError:
            raise FileFormatError(f"{path}:{lineno}: expected 'item_id v_1 ... v_D'") from None
    widths = {len(v) for v in table.values()}
    if len(widths) != 1 or 0 in widths:
        raise FileFormatError(f"{path}: embedding rows have widths {sorted(widths)}; need one D >= 1")
    missing = [int(i) for i in item_ids if int(i) not in table]
    if missing:
        raise ValueError(f"items {missing[:5]} ({len(missing)} in all) have no row in {path}")
    return np.asarray([table[int(i)] for i in item_ids], np.float32)


def load_movielens(path, *, items_path: str | None = None, max_history: int = 50,
                   max_train_per_user: int = 20, new_fraction: float = 0.1,
                   categories: int = 8, embeddings_path: str | None = None,
                   seed: int = 0) -> RecData:
    """RecData from a ratings file (see the module docstring for every rule).

    Args:
      path: ratings file; items_path: items file (default: found beside ``path``).
      max_history: history slots kept per request (the latest ones).
      max_train_per_user: latest training targets kept per user.
      new_fraction: share of the catalogue counted as new releases.
      categories: clusters standing in for genres when there is no items file.
      embeddings_path: optional item embedding file (:func:`read_embedding_file`) used as the
        semantic-ID input instead of the item features / co-occurrence.
    """
    if not 0 < new_fraction < 1:
        raise ValueError(f"new_fraction={new_fraction}: must be in (0, 1)")
    r = read_ratings(path)
    raw_items, item_index = np.unique(r["item"], return_inverse=True)
    _, user_index = np.unique(r["user"], return_inverse=True)
    order = np.lexsort((np.arange(len(r["item"])), r["timestamp"], user_index))
    users_sorted, items_sorted = user_index[order], item_index[order]
    bounds = np.flatnonzero(np.diff(users_sorted)) + 1
    seqs = np.split(items_sorted, bounds)
    n_items = len(raw_items)
    items_path = items_path or find_items_file(path)
    if items_path is not None:
        items, genre_names = read_items(items_path)
        features = item_feature_matrix(raw_items, items, genre_names)
        genre_names = tuple(genre_names)
        g_index = {g: k for k, g in enumerate(genre_names)}
        genre = np.asarray([g_index[items[int(i)][2][0]] if items[int(i)][2] else 0
                            for i in raw_items], np.int32)
        years = np.asarray([items[int(i)][1] or -1 for i in raw_items], np.float64)
        source = f"MovieLens ratings {path} with items {items_path}"
    else:
        features = cooccurrence_embeddings(seqs, n_items)
        _, genre = kmeans(features, categories, key=jax.random.key(seed))
        genre = np.asarray(genre, np.int32)
        genre_names = tuple(f"cluster{k}" for k in range(categories))
        years = np.full(n_items, -1.0)
        source = f"MovieLens ratings {path} (no items file: co-occurrence embeddings)"
    if embeddings_path:
        features = read_embedding_file(embeddings_path, raw_items)
        source += f", embeddings {embeddings_path}"
    if (years > 0).sum() >= max(1, n_items // 2):
        release = np.where(years > 0, years, years[years > 0].min())
    else:  # first rating time
        release = np.full(n_items, np.inf)
        np.minimum.at(release, item_index, r["timestamp"].astype(np.float64))
    new = release >= np.quantile(release, 1.0 - new_fraction)

    hists, targets, kinds = [], [], []
    for u, seq in enumerate(seqs):
        positions = list(range(1, len(seq) - 1))[-max_train_per_user:] + [len(seq) - 1]
        for t in positions:
            hists.append((u, seq[:t]))
            targets.append(int(seq[t]))
            kinds.append(t == len(seq) - 1)
    scenario, shown = [], []
    for (_, h), tgt in zip(hists, targets):
        if new[tgt]:
            kind = "new"
        else:
            kind = "genre" if (genre[h] == genre[tgt]).any() else "different"
        scenario.append(SCENARIOS.index(kind))
        shown.append(-1 if kind == "new" else int(genre[tgt]))
    hist, beh = pad_histories([h for _, h in hists], [np.zeros(len(h), int) for _, h in hists],
                              max_history)
    all_req = Requests(history=hist, behaviour=beh,
                       instruction=instruction_tokens(scenario, shown, len(SCENARIOS)),
                       scenario=np.asarray(scenario, np.int32),
                       target=np.asarray(targets, np.int32),
                       target_behaviour=np.zeros(len(targets), np.int32),
                       user=np.asarray([u for u, _ in hists], np.int32))
    is_test = np.asarray(kinds)
    return RecData(item_features=features, item_genre=genre, item_new=new,
                   genre_names=genre_names, scenarios=SCENARIOS, behaviour_weights=(1.0,),
                   train=all_req.take(np.flatnonzero(~is_test)),
                   test=all_req.take(np.flatnonzero(is_test)), source=source)
