"""Tags, edit operations, the programmatic teacher, corpus sources and readers (bad input)."""
import json
import random

import numpy as np
import pytest

from jaxflow.decorate import corpus as C
from jaxflow.decorate import editing as E
from jaxflow.decorate import tagging as TG
from jaxflow.decorate.teacher import CallableAnnotator, ProgrammaticTeacher, teacher_edit_ops

H = TG.default_hierarchy()


def test_default_hierarchy_and_bad_tags():
    assert H.sizes == (21, 42, 84) and H.names[0] == TG.LEVEL1_NAMES
    good = H.paths(np.array([0, 41, 83]))
    np.testing.assert_array_equal(TG.validate_tags(good, H), good)
    with pytest.raises(ValueError, match="level-3 id 84 is outside the hierarchy"):
        TG.validate_tags(np.array([[20, 41, 84]]), H)
    with pytest.raises(ValueError, match=r"tag row 0 \[0, 0, 83\] is not a path"):
        TG.validate_tags(np.array([[0, 0, 83]]), H)


def test_hierarchical_decode_is_best_consistent_path():
    rng = np.random.default_rng(0)
    lp = [np.log(rng.dirichlet(np.ones(n), size=6)) for n in H.sizes]
    got = np.asarray(TG.hierarchical_decode(*lp, H))
    for r in range(6):
        best = max(range(84), key=lambda c: sum(lp[k][r, H.path(c)[k]] for k in range(3)))
        assert got[r].tolist() == list(H.path(best))
    acc = TG.hierarchical_accuracy(got, np.array([H.path(0)] * 6))
    assert set(acc) == {"level1", "level2", "level3", "path2", "path3"}


def test_levenshtein_matches_dynamic_programming():
    def ref(a, b):
        d = list(range(len(b) + 1))
        for i, ca in enumerate(a, 1):
            prev, d[0] = d[:], i
            for j, cb in enumerate(b, 1):
                d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (ca != cb))
        return d[-1]

    r = random.Random(0)
    for _ in range(200):
        a = "".join(r.choice("ab c") for _ in range(r.randint(0, 10)))
        b = "".join(r.choice("ab c") for _ in range(r.randint(0, 10)))
        assert E.levenshtein(a, b) == ref(a, b)
    assert E.edit_similarity("", "") == 1.0


def test_teacher_edit_undoes_injected_noise():
    clean = ("The value of the expression is returned to the caller, and the loop continues "
             "with the next item of the sequence.")
    rng = np.random.default_rng(1)
    for level in (0.3, 1.0):
        noisy = C.degrade(clean, level, rng)
        assert noisy != clean
        assert E.apply_ops(noisy, teacher_edit_ops(noisy)) == clean
    assert (teacher_edit_ops(clean) == E.KEEP).all()
    # free-form edits map back to operations where they can be expressed
    noisy = C.degrade(clean, 1.0, rng)
    target = E.apply_ops(noisy, teacher_edit_ops(noisy))
    ops, missing = E.ops_from_edit(noisy, target)
    assert missing == 0 and E.apply_ops(noisy, ops) == target


def test_programmatic_teacher_judgements():
    t = ProgrammaticTeacher(H, judge_noise=0.0)
    docs = C.TemplateGenerator(H, max_chars=256).generate(60, seed=0)
    tags = t.tag([d.text for d in docs])
    assert (tags == H.paths([d.leaf for d in docs])).all(1).mean() > 0.9
    clean = C.pydoc_passages(256)[10].text
    salad = C.noise_document(np.random.default_rng(0), H, "n", 200).text
    f_clean, f_salad = t.criteria_features(clean), t.criteria_features(salad)
    assert (f_clean[:4] >= f_salad[:4]).all() and f_clean[:4].sum() > f_salad[:4].sum() + 0.3
    y = t.compare([clean], [salad])
    assert y.shape == (1, 8) and (y[0, :4] >= 0.5).all() and (y[0, :4] == 1).any()
    with pytest.raises(ValueError, match="empty text"):
        t.criteria_features("   ")
    bad = CallableAnnotator(H, tag_fn=lambda texts: np.array([[0, 0, 83]] * len(texts)))
    with pytest.raises(ValueError, match="not a path"):
        bad.tag(["x"])


def test_real_text_fingerprint_is_recorded():
    docs = C.pydoc_passages(128)
    fp = C.corpus_fingerprint(docs)
    assert fp == C.corpus_fingerprint(C.pydoc_passages(128)) and len(fp["sha256"]) == 64
    assert fp["documents"] > 1000 and all(len(d.text) <= 128 for d in docs)
    assert set("".join(d.text for d in docs)) <= set(C.ALPHABET)


def test_readers_and_bad_input(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"id": "a", "text": "Hello \u201cworld\u201d."}, {"id": "b", "text": "   "},
            {"id": "c", "text": "word " * 30}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    stats = C.ReadStats()
    docs = list(C.read_jsonl(path, max_chars=64, stats=stats))
    assert docs[0].text == 'Hello "world".' and stats.empty == 1 and stats.chunked == 1
    assert [d.id for d in docs[1:]] == ["c#0", "c#1", "c#2"] and all(len(d.text) <= 64 for d in docs)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: byte offset 13 is not UTF-8"):
        list(C.read_jsonl(bad, max_chars=64))
    assert [d.text for d in C.read_jsonl(bad, max_chars=64, errors="replace")] == ["ok", "caf?"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("Some text.\n")
    (tmp_path / "d" / "y.txt").write_text("\n\n")
    stats = C.ReadStats()
    assert [d.id for d in C.read_text_dir(tmp_path / "d", max_chars=64, stats=stats)] == ["x.txt"]
    assert stats.empty == 1


def test_label_file_annotator(tmp_path):
    from jaxflow.decorate.teacher import LabelFileAnnotator

    rows = [{"text": "alpha", "scores": [1, 2, 3, 4, 5, 6, 7, 8], "tag": H.path(5), "edit": "Alpha."},
            {"text": "beta", "scores": [2, 2, 1, 4, 5, 6, 7, 9], "tag": H.path(80)}]
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({**r, "tag": list(r["tag"])}) + "\n" for r in rows))
    ann = LabelFileAnnotator(H, path)
    np.testing.assert_array_equal(ann.compare(["alpha"], ["beta"])[0], [0, .5, 1, .5, .5, .5, .5, 0])
    np.testing.assert_array_equal(ann.tag(["beta"]), [H.path(80)])
    assert ann.edit(["alpha"]) == ["Alpha."]
    with pytest.raises(ValueError, match="no 'edit' for text 'beta'"):
        ann.edit(["beta"])
    with pytest.raises(ValueError, match="no 'scores' for text 'gamma'"):
        ann.compare(["gamma"], ["alpha"])
    path.write_text(json.dumps({"text": "x", "tag": [0, 0, 83]}) + "\n")
    with pytest.raises(ValueError, match="not a path"):
        LabelFileAnnotator(H, path)
