"""Readers parse small files the test writes; the synthetic generator; AUC / logloss."""

import numpy as np
import pytest

from jaxflow.recsys.metrics import log_loss, roc_auc
from jaxflow.recsys.readers import file_batch, movielens_to_clicks, read_criteo_tsv, read_movielens
from jaxflow.recsys.synthetic import SyntheticConfig, SyntheticCriteo


def test_criteo_tsv(tmp_path):
    vocabs = (7,) * 26
    cats = ["1a", "", "ff"] + ["0"] * 23
    line1 = "\t".join(["1", "3", ""] + ["0"] * 11 + cats)
    line2 = "\t".join(["0"] + ["-2"] * 13 + ["b"] * 26)
    path = tmp_path / "day.tsv"
    path.write_text(line1 + "\n" + line2 + "\n\n")
    d = read_criteo_tsv(path, vocabs)
    np.testing.assert_array_equal(d["label"], [1, 0])
    np.testing.assert_allclose(d["dense"][0, :3], [np.log1p(3), 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(d["dense"][1], 0)  # negative counts clamp to 0
    assert d["sparse"]["c0"][0, 0] == 0x1a % 7 and d["sparse"]["c1"][0, 0] == -1
    assert d["sparse"]["c2"][0, 0] == 0xff % 7 and d["sparse"]["c5"][1, 0] == 0xb % 7
    path.write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="3 tab-separated fields, expected 40"):
        read_criteo_tsv(path, vocabs)


@pytest.mark.parametrize("fmt", ["::", "\t", ",", " "])
def test_movielens(tmp_path, fmt):
    rows = [(1, 10, 5.0, 100), (2, 11, 3.5, 200), (1, 12, 4.0, 300)]
    header = "userId,movieId,rating,timestamp\n" if fmt == "," else ""
    path = tmp_path / "ratings"
    path.write_text(header + "".join(fmt.join(str(x) for x in r) + "\n" for r in rows))
    d = read_movielens(path)
    np.testing.assert_array_equal(d["user"], [1, 2, 1])
    np.testing.assert_array_equal(d["item"], [10, 11, 12])
    np.testing.assert_allclose(d["rating"], [5.0, 3.5, 4.0])
    clicks = movielens_to_clicks(d)
    np.testing.assert_array_equal(clicks["label"], [1, 0, 1])
    np.testing.assert_allclose(clicks["dense"][:, 0], [0, 0.5, 1])
    b = file_batch(clicks, step=1, batch_size=2)  # rows 2, 0 (cycling)
    np.testing.assert_array_equal(b["sparse"]["item"][:, 0], [12, 10])


def test_synthetic_generator():
    cfg = SyntheticConfig(vocab_sizes=(1000, 50), multi_hot=3, drift_period=5)
    gen = SyntheticCriteo(cfg, seed=1)
    a, b = gen.batch(0, 256), gen.batch(0, 256)
    np.testing.assert_array_equal(a["sparse"]["c0"], b["sparse"]["c0"])  # pure in (seed, step)
    assert a["dense"].shape == (256, 13) and a["sparse"]["c0"].shape == (256, 3)
    ids = a["sparse"]["c0"]
    assert ids.min() >= -1 and ids.max() < 1000 and (ids[:, 0] >= 0).all()
    # Zipf: few keys dominate, and consecutive batches share hot keys
    vals, counts = np.unique(ids[ids >= 0], return_counts=True)
    top = set(vals[np.argsort(-counts)[:10]])
    nxt = gen.batch(1, 256)["sparse"]["c0"]
    assert len(top & set(nxt[nxt >= 0].tolist())) >= 8
    assert 0.05 < a["label"].mean() < 0.6


def test_auc_and_logloss():
    rng = np.random.default_rng(0)
    y = rng.random(200) < 0.3
    s = np.round(rng.random(200) + 0.3 * y, 1)  # ties on purpose
    pos, neg = s[y], s[~y]
    brute = np.mean((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :]))
    assert abs(roc_auc(y, s) - brute) < 1e-12
    assert roc_auc([0, 1], [0.1, 0.9]) == 1.0
    assert abs(log_loss([1, 0], [0.5, 0.5]) - np.log(2)) < 1e-12
    # saturated probabilities are clipped to [eps, 1 - eps] (not sklearn's 2.2e-16)
    assert abs(log_loss([1, 0], [0.0, 1.0]) + np.log(1e-7)) < 1e-9
    assert abs(log_loss([1], [0.25]) + np.log(0.25)) < 1e-12  # one class is fine
    with pytest.raises(ValueError, match="both classes"):
        roc_auc([1, 1], [0.2, 0.3])


def test_recbole_atomic_file_types_missing_values_and_errors(tmp_path):
    from jaxflow.recsys.readers import read_atomic_file

    path = tmp_path / "x.item"
    path.write_text("item_id:token\tmovie_title:token_seq\tscore:float\temb:float_seq\n"
                    "1\tToy Story\t4.5\t0.5 -1\n"
                    "\n"  # blank lines are skipped
                    "2\tHeat\t\t\n"  # empty fields: missing values
                    "3\tBabe\n", encoding="utf-8")  # short row: the rest missing
    cols = read_atomic_file(path)
    assert cols["item_id"] == ["1", "2", "3"]
    assert cols["movie_title"] == [["Toy", "Story"], ["Heat"], ["Babe"]]
    assert cols["score"][0] == 4.5 and np.isnan(cols["score"][1]) and np.isnan(cols["score"][2])
    assert cols["emb"] == [[0.5, -1.0], [], []]
    assert list(read_atomic_file(path, columns=("score", "item_id"))) == ["score", "item_id"]
    with pytest.raises(ValueError, match=r"lacks columns \['year'\]"):
        read_atomic_file(path, columns=("item_id", "year"))
    path.write_text("item_id:token\tscore:float\n1\t4.5\n2\tgood\n")
    with pytest.raises(ValueError, match=r"x.item:3: column 'score' \(float\) cannot parse 'good'"):
        read_atomic_file(path)
    path.write_text("item_id\tscore:float\n1\t2\n")
    with pytest.raises(ValueError, match=r"header field 'item_id' is not name:type"):
        read_atomic_file(path)
    path.write_text("item_id:token\n1\t2\n")
    with pytest.raises(ValueError, match=r"x.item:2: 2 tab-separated fields, the header has 1"):
        read_atomic_file(path)
