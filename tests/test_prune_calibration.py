"""Calibration sources, IGSP's low-redundancy selection, capability scoring helpers."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxflow.mesh import MeshConfig
from jaxflow.models.transformer import TransformerConfig
from jaxflow.prune.calibration import CalibrationConfig, calibration_set, select_low_redundancy
from jaxflow.prune.capabilities import CAPABILITIES, eval_set, make_tokenizer, make_world, retention
from jaxflow.prune.correlation import spearman
from jaxflow.train.lm_state import init_params, lm_functions

CFG = CalibrationConfig(rows=4, seq_len=48, doc_tokens=12, igsp_pool_factor=2)


@pytest.mark.parametrize("source", ["math", "code", "general", "commonsense", "text", "random", "mix"])
def test_corpus_sources_fill_the_budget_and_differ_by_draw(source):
    world, tok = make_world(0), make_tokenizer()
    a = calibration_set(source, world=world, tokenizer=tok, cfg=CFG, draw=0)
    b = calibration_set(source, world=world, tokenizer=tok, cfg=CFG, draw=1)
    assert a["tokens"].shape == (4, 48)
    assert np.all(a["segment_ids"] > 0)  # every row is full
    assert not np.array_equal(a["tokens"], b["tokens"])


def test_mix_holds_every_capability():
    tok = make_tokenizer()
    cfg = dataclasses.replace(CFG, rows=16)
    text = tok.decode(calibration_set("mix", world=make_world(0), tokenizer=tok, cfg=cfg,
                                      draw=0)["tokens"].ravel(), stop_at_eos=False)
    assert "+" in text or "-" in text  # math
    assert "?" in text and ("close" in text or ";" in text)  # code
    assert "capital of" in text and "q: which is" in text  # general, commonsense


def test_low_redundancy_selection_prefers_new_ngrams():
    dup = [1, 5, 6, 7, 8, 9, 2]
    docs = [dup, list(dup), list(dup), [1, 10, 11, 12, 13, 14, 2]]
    chosen = select_low_redundancy(docs, budget_tokens=14, rng=np.random.default_rng(0))
    assert len(chosen) == 2 and [1, 10, 11, 12, 13, 14, 2] in chosen


def test_igsp_builds_a_capability_stratified_set_from_the_model():
    model_cfg = TransformerConfig(vocab_size=60, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                                  d_ff=64, max_seq_len=64)
    fns = lm_functions(model_cfg, MeshConfig().make())
    params = init_params(fns, model_cfg, jax.random.key(0))
    batch = calibration_set("igsp", world=make_world(0), tokenizer=make_tokenizer(), cfg=CFG, draw=0,
                            fns=fns, params=params)
    assert batch["tokens"].shape == (4, 48) and batch["segment_ids"][-1].max() > 0
    with pytest.raises(ValueError, match="pass fns and params"):
        calibration_set("selfcal", world=make_world(0), tokenizer=make_tokenizer(), cfg=CFG, draw=0)


def test_eval_sets_and_retention():
    world = make_world(0)
    for cap in CAPABILITIES:
        exs = eval_set(world, cap, 8, seed=0)
        assert len(exs) == 8 and all(e.capability == cap for e in exs)
    cs = eval_set(world, "commonsense", 8, seed=0)
    assert all(e.choices[e.label] == e.answer for e in cs)
    r = retention({"math": 0.5, "code": 0.2, "general": 0.9, "commonsense": 0.5},
                  {"math": 1.0, "code": 0.4, "general": 0.9, "commonsense": 1.0})
    assert r == {"math": 0.5, "code": 0.5, "general": 1.0, "commonsense": 0.5, "total": 0.625}


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 2, 3], [5, 5, 5]))
