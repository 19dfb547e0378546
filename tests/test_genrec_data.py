"""Synthetic multi-scenario data and the MovieLens readers (on small files the tests write)."""

import numpy as np
import pytest

from jaxflow.genrec.data import movielens, synthetic
from jaxflow.genrec.data.requests import SCENARIOS

SMALL = synthetic.SyntheticGenRecConfig(n_genres=3, n_sub=2, items_per_cell=10, n_users=20,
                                        min_history=2, max_history=6, test_users=5,
                                        train_requests_per_user=2)


def test_synthetic_is_deterministic_and_follows_its_intents():
    a, b = synthetic.generate(SMALL, seed=3), synthetic.generate(SMALL, seed=3)
    np.testing.assert_array_equal(a.train.target, b.train.target)
    np.testing.assert_array_equal(a.test.history, b.test.history)
    assert a.n_items == 60 and a.instruction_vocab == 1 + 3 + 3
    assert len(a.test) == 5 * 3 and set(a.test.scenario.tolist()) == {0, 1, 2}
    for req in (a.train, a.test):
        genre_tok = req.instruction[:, 1] - 1 - len(SCENARIOS)
        name = np.asarray(SCENARIOS)[req.scenario]
        new = a.item_new[req.target]
        assert (new == (name == "new")).all()  # only the "new" scenario asks for new releases
        named = name != "new"
        assert (a.item_genre[req.target][named] == genre_tok[named]).all()
        assert (req.instruction[name == "new", 1] == 0).all()
        hist = req.history
        assert not a.item_new[hist[hist >= 0]].any()  # histories hold no new releases
        assert not (hist == req.target[:, None]).any()


U_DATA = "1\t10\t4\t100\n1\t20\t3\t50\n2\t10\t5\t10\n1\t30\t2\t100\n2\t40\t4\t20\n3\t20\t4\t5\n"
U_ITEM = ("10|Toy Story (1995)|01-Jan-1995||http://x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n"
          "20|GoldenEye (1995)|01-Jan-1995||http://x|0|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0|1|0|0\n"
          "30|Heat (1998)|01-Jan-1998||http://x|0|1|0|0|0|0|1|0|0|0|0|0|0|0|0|0|1|0|0\n"
          "40|Babe (1999)|01-Jan-1999||http://x|0|0|0|0|1|1|0|0|1|0|0|0|0|0|0|0|0|0|0\n")


def test_ml100k_leave_last_out_split_and_scenarios(tmp_path):
    (tmp_path / "u.data").write_text(U_DATA)
    (tmp_path / "u.item").write_text(U_ITEM, encoding="latin-1")
    data = movielens.load_movielens(tmp_path / "u.data", new_fraction=0.25)
    assert data.n_items == 4 and "u.item" in data.source
    # user 1: times 50 (item 20), 100 (item 10), 100 (item 30; file order breaks the tie)
    u1 = data.test.user == 0
    assert data.test.target[u1].tolist() == [2]  # item 30 -> index 2
    assert data.test.history[u1][0, :2].tolist() == [1, 0]
    assert (data.train.target[data.train.user == 0] == [0]).all()
    # user 3 has one rating: a test request with an empty history, no training request
    u3 = data.test.user == 2
    assert (data.test.history[u3] == -1).all() and not (data.train.user == 2).any()
    assert data.item_new.tolist() == [False, False, False, True]  # 1999 is the newest quarter
    assert data.genre_names[data.item_genre[0]] == "Animation"
    # item 40 (new) is user 2's last item -> the "new" scenario, no genre token
    u2 = data.test.user == 1
    assert SCENARIOS[data.test.scenario[u2][0]] == "new" and data.test.instruction[u2][0, 1] == 0


def test_inter_header_any_column_order_and_ml1m(tmp_path):
    inter = tmp_path / "ml.inter"
    inter.write_text("item_id:token\tuser_id:token\ttimestamp:float\trating:float\n"
                     "10\t1\t100\t4\n20\t1\t50\t3\n10\t2\t10\t5\n")
    r = movielens.read_ratings(inter)
    assert r["user"].tolist() == [1, 1, 2] and r["item"].tolist() == [10, 20, 10]
    assert r["timestamp"].tolist() == [100, 50, 10]
    (tmp_path / "bad.inter").write_text("user_id:token\titem_id:token\n1\t2\n")
    with pytest.raises(ValueError, match=r"lacks columns \['rating', 'timestamp'\]"):
        movielens.read_ratings(tmp_path / "bad.inter")
    d = tmp_path / "ml1m"
    d.mkdir()
    (d / "ratings.dat").write_text("1::10::4::100\n1::20::3::50\n2::10::5::10\n2::20::1::20\n")
    (d / "movies.dat").write_text("10::Toy Story (1995)::Animation|Comedy\n"
                                  "20::Heat (1998)::Action|Crime\n", encoding="latin-1")
    data = movielens.load_movielens(d / "ratings.dat")
    assert data.genre_names[:2] == ("Animation", "Comedy")
    assert data.item_features.shape[0] == 2 and np.isfinite(data.item_features).all()


INTER = ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
         "1\t10\t4\t100\n1\t20\t3\t50\n2\t10\t5\t10\n1\t30\t2\t100\n2\t40\t4\t20\n"
         "3\t20\t4\t5\n")
ITEM = ("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        "10\tToy Story\t1995\tAnimation Children's Comedy\n"
        "20\tGoldenEye\t1995\tAction Adventure Thriller\n"
        "30\tHeat\tunkonwn\tunknown\n"  # RecBole's ml-100k spells a missing year so
        "40\tBabe\t1999\tChildren's Drama\n")


def test_recbole_inter_with_item_titles_beside_it(tmp_path):
    """RecBole's ml-100k layout: ``ml.inter`` + ``ml.item`` (the same stem) in one folder; the
    .item file's titles, years and genres become the item features."""
    (tmp_path / "ml.inter").write_text(INTER)
    (tmp_path / "ml.item").write_text(ITEM, encoding="utf-8")
    items, genres = movielens.read_items(tmp_path / "ml.item")
    assert items[10] == ("Toy Story", 1995, ["Animation", "Children's", "Comedy"])
    assert items[30] == ("Heat", None, ["unknown"])
    assert genres[:4] == ("Animation", "Children's", "Comedy", "Action")
    assert movielens.find_items_file(tmp_path / "ml.inter") == tmp_path / "ml.item"
    data = movielens.load_movielens(tmp_path / "ml.inter", new_fraction=0.25)
    assert "ml.item" in data.source and data.n_items == 4
    assert [data.genre_names[g] for g in data.item_genre] == ["Animation", "Action", "unknown",
                                                            "Children's"]
    assert data.item_new.tolist() == [False, False, False, True]  # 1999; Heat has no year
    f = data.item_features
    ng = len(genres)
    np.testing.assert_array_equal(f[0, :ng] > 0, [g in items[10][2] for g in genres])
    assert f[2, ng] == 0 and f[3, ng] == 1  # scaled year: none for Heat, 1999 the latest
    title = f[:, -32:]  # hashed title tokens: "toy" + "story" vs one token per other title
    assert np.isclose(title[0].sum(), 0.5) and np.isclose(title[1].sum(), 0.25)
    assert not np.array_equal(title[1], title[2])
    # the split is the u.data one (same ratings): user 1's test target is item 30
    assert data.test.target[data.test.user == 0].tolist() == [2]
    # an explicit items_path wins over the file beside the ratings
    (tmp_path / "other.item").write_text(ITEM.replace("Toy Story", "Toy Story Two"))
    data2 = movielens.load_movielens(tmp_path / "ml.inter", items_path=str(tmp_path / "other.item"))
    assert "other.item" in data2.source
    (tmp_path / "ids.inter").write_text("user_id:token\titem_id:token\trating:float\t"
                                        "timestamp:float\nu1\t10\t4\t100\n")
    with pytest.raises(ValueError, match=r"token 'u1' is not an integer id"):
        movielens.read_ratings(tmp_path / "ids.inter")
    (tmp_path / "bad.item").write_text("item_id:token\tmovie_title:token_seq\n10\tToy\n")
    with pytest.raises(ValueError, match=r"no year column"):
        movielens.read_items(tmp_path / "bad.item")


def test_missing_features_named_and_cooccurrence_fallback(tmp_path):
    (tmp_path / "u.data").write_text(U_DATA)
    (tmp_path / "u.item").write_text(U_ITEM.split("\n", 1)[1], encoding="latin-1")  # drop 10
    with pytest.raises(ValueError, match=r"items \[10\] \(1 in all\) are rated but have no "
                                         "features"):
        movielens.load_movielens(tmp_path / "u.data")
    (tmp_path / "u.item").unlink()
    data = movielens.load_movielens(tmp_path / "u.data", categories=2)
    assert "co-occurrence" in data.source and data.item_features.shape == (4, 32)
    assert set(data.item_genre.tolist()) <= {0, 1}
    emb = tmp_path / "emb.txt"
    emb.write_text("10 1 0\n20 0 1\n30 1 1\n40 0.5 0.5\n")
    data = movielens.load_movielens(tmp_path / "u.data", categories=2, embeddings_path=str(emb))
    np.testing.assert_array_equal(data.item_features[3], [0.5, 0.5])
    emb.write_text("10 1 0\n20 0 1\n")
    with pytest.raises(ValueError, match=r"items \[30, 40\] \(2 in all\) have no row"):
        movielens.load_movielens(tmp_path / "u.data", embeddings_path=str(emb))
    with pytest.raises(ValueError, match="does not exist"):
        movielens.read_ratings(tmp_path / "nope.data")


def test_unified_reward_mapping_per_scenario():
    from jaxflow.genrec.rl import RLConfig, unified_reward

    data = synthetic.generate(SMALL, seed=0)
    req = data.test.take(np.arange(3))  # one request per scenario: genre, new, different
    g_new = np.flatnonzero(data.item_new)[0]
    hist0 = int(req.history[0, 0])
    asked = req.instruction[:, 1] - 1 - len(SCENARIOS)
    same_genre_other = [i for i in np.flatnonzero(data.item_genre == asked[0])
                        if i not in req.history[0] and i != req.target[0]][0]
    items = np.asarray([[req.target[0], same_genre_other, hist0, -1],
                        [g_new, req.target[1], hist0, -1],
                        [req.target[2], hist0, hist0, -1]])
    cfg = RLConfig()
    r = unified_reward(items, req, data, cfg)
    top = cfg.hit_weight + cfg.match_weight + cfg.novelty_weight
    g0 = data.item_genre[hist0] == asked[0]
    want = np.asarray([
        [1.0, (0.3 + 0.1) / top, (0.3 * g0) / top, 0.0],
        [(0.3 + 0.1) / top, 1.0, 0.0, 0.0],  # a new release matches "new"; history items don't
        [1.0, 0.0, 0.0, 0.0]])  # a watched genre is never "different"
    np.testing.assert_allclose(r, want, rtol=1e-6)


def test_sasrec_sequences_layout():
    from jaxflow.genrec.sasrec import sequences

    data = synthetic.generate(SMALL, seed=1)
    req = data.test.take(np.arange(4))
    s = sequences(req, max_len=5)
    for b in range(4):
        h = req.history[b][req.history[b] >= 0][-4:]
        n = len(h)
        assert s["last"][b] == n and s["tokens"][b, 0] == 1
        np.testing.assert_array_equal(s["tokens"][b, 1:n + 1], h + 2)
        np.testing.assert_array_equal(s["labels"][b, :n + 1], np.append(h, req.target[b]) + 2)
        assert s["segment_ids"][b].tolist() == [1] * (n + 1) + [0] * (4 - n)
