"""Every registered experiment names a headline builder (``HEADLINES`` in its config), and each
builder gives the right figures on a small synthetic summary in the shape its driver writes (no
experiment is run here)."""

import json

import pytest

from jaxflow.config import experiments
from jaxflow.study import Headline, headline_builder
from jaxflow.study import headlines_bench as hb
from jaxflow.study import headlines_rl as hr
from jaxflow.study import headlines_systems as hs

CONTRACT_KEYS = {"name", "metric", "algorithm", "baseline", "baseline_rule", "baselines", "value", "unit",
                 "higher_is_better", "spread", "target", "target_text", "met"}


@pytest.mark.parametrize("name", sorted(experiments()))
def test_every_experiment_declares_a_headline_builder(name):
    spec = experiments()[name]
    assert spec.headlines, f"configs/{name}.py: no HEADLINES"
    assert callable(headline_builder(spec.headlines))


def _check(heads):
    assert heads and all(isinstance(h, Headline) for h in heads)
    for h in heads:
        d = json.loads(json.dumps(h.to_json()))
        assert CONTRACT_KEYS <= set(d)
        assert h.line().startswith(h.name)
    return heads


def test_nestpipe_is_against_the_strongest_of_sync_and_sparse_dist():
    s = {"speedup_vs_sync": {"sync": 1.0, "sparse_dist": 1.2, "fwp": 0.96, "dbp+fwp": 1.08},
         "speedup_runs": {"sync": [1.0, 1.0], "sparse_dist": [1.2, 1.1], "fwp": [0.96, 0.99],
                          "dbp+fwp": [1.08, 1.1]}}
    a, b = _check(hs.nestpipe(s))
    assert (a.algorithm, a.baseline, b.baseline) == ("nestpipe dbp+fwp", "sparse_dist", "sparse_dist")
    assert a.value == pytest.approx(0.9) and a.met is False and a.baselines == {"sync": 1.0, "sparse_dist": 1.2}
    assert (a.spread.low, a.spread.high) == (pytest.approx(0.9), pytest.approx(1.0))
    # without sparse_dist in the run, sync is the strongest measured
    (h,) = hs.nestpipe({"speedup_vs_sync": {"sync": 1.0, "dbp+fwp": 1.1}})
    assert h.baseline == "sync" and h.value == pytest.approx(1.1) and h.met


def test_flowtrain_is_against_the_stronger_of_padded_and_packed():
    s = {"samples_per_s": {"monolithic_padded": 10.0, "monolithic_packed": 13.0, "decoupled": 14.0},
         "round_seconds": {"monolithic_padded": [1.0, 1.0], "monolithic_packed": [0.8, 0.7],
                           "decoupled": [0.75, 0.7]}}
    (h,) = _check(hs.flowtrain(s))
    assert h.baseline == "monolithic_packed" and h.value == pytest.approx(14 / 13) and h.met is False
    assert (h.spread.n, h.spread.low, h.spread.high) == (2, pytest.approx(1.0), pytest.approx(0.8 / 0.75))


def test_flexmarl_strict_and_bounded_vs_the_fastest_lockstep():
    runs = {"sync": [1.0, 0.9], "sync_unblocked": [0.95, 1.0], "strict": [0.9, 0.96], "bounded_eta1": [1.2, 1.3]}
    s = {"speedups": {m: {"median": sorted(v)[0] + (sorted(v)[1] - sorted(v)[0]) / 2, "runs": v}
                      for m, v in runs.items()}}
    strict, bounded = _check(hs.flexmarl(s))
    assert strict.baseline == "sync_unblocked" and strict.value == pytest.approx(0.93 / 0.975)
    assert strict.target == 0.95 and strict.met is True and bounded.name == "bounded_eta1_vs_fastest_lockstep"


def test_simulators_give_one_headline_marked_stale_from_the_calibration():
    cal = {"stale": True, "git_commit": "319de7791970d742ab5979f8f9dcd4d5dd18a6f6"}
    s = {"step_ms_by_workers": {"sync": {"128": 10.0, "1536": 30.0}, "dbp+fwp": {"128": 8.0, "1536": 10.0}},
         "paper_table": {"NestPipe": {"speedup": 3.06}}, "calibration": cal}
    (h,) = _check(hs.nestpipe_scale(s))
    assert h.value == pytest.approx(3.0) and h.baseline == "sync" and h.met is False and h.stale is True
    assert "(stale calibration: measured code changed since 319de7791970)" in h.line()
    assert h.to_json()["stale"] is True
    f = {"speedup_vs_sync": {"8": 1.5, "64": 2.0}, "samples_per_s": {"8": 15.0, "64": 40.0},
         "baseline_samples_per_s": {"8": 10.0, "64": 20.0}, "paper_speedup": 7.3,
         "calibration": {"stale": False, "git_commit": "abc"}}
    (g,) = _check(hs.flexmarl_scale(f))
    assert g.value == pytest.approx(2.0) and "64" in g.metric and g.stale is False and "stale" not in g.line()


def test_flagship_gain_over_the_warm_start_and_sync_ratio_with_seed_intervals():
    per_seed = [{"heldout_pass_at_1_initial": 0.45, "heldout_pass_at_1_final": 0.85, "sync_sent_bytes": 10.0,
                 "sync_dense_bytes": 60.0},
                {"heldout_pass_at_1_initial": 0.47, "heldout_pass_at_1_final": 0.90, "sync_sent_bytes": 12.0,
                 "sync_dense_bytes": 60.0}]
    s = {"heldout_pass_at_1_initial": 0.46, "heldout_pass_at_1_final": 0.875, "sync_ratio_vs_dense": 5.5,
         "per_seed": per_seed}
    gain, sync = _check(hr.flagship(s))
    assert gain.value == pytest.approx(0.415) and gain.baseline == "warm start" and gain.spread.kind == "seeds"
    assert sync.value == pytest.approx(60 / 11) and sync.spread.n == 2
    assert (sync.spread.low + sync.spread.high) / 2 == pytest.approx((6.0 + 5.0) / 2)


def test_figa_is_against_the_strongest_method_not_the_ablation():
    s = {"results": [{"method": "sft", "heldout_greedy_mean": 0.541}, {"method": "dpo", "heldout_greedy_mean": 0.5},
                     {"method": "figa", "heldout_greedy_mean": 0.522},
                     {"method": "figa_constant", "heldout_greedy_mean": 0.6}],
         "final_by_seed": {"sft": {"0": 0.54, "1": 0.542}, "figa": {"0": 0.52, "1": 0.524}}}
    (h,) = _check(hr.figa(s))
    assert h.baseline == "sft" and h.value == pytest.approx(-0.019) and h.met is False
    assert set(h.baselines) == {"sft", "dpo"} and h.spread.n == 2


def test_sis_studies_compare_sis_with_the_strongest_correction_per_setting():
    def row(corr, accs, lag=4):
        return {"algo": "grpo", "correction": corr, "mismatch": 0.0, "lag": lag, "staleness": 1, "lr_scale": 1.0,
                "prompts": 8, "acc_mean": sum(accs) / len(accs), "acc_per_seed": accs}
    rows = [row("none", [0.5, 0.6]), row("sis", [0.7, 0.7]), row("tis", [0.65, 0.69]), row("none", [0.4], lag=0)]
    (h,) = _check(hr.sis_offpolicy({"results": rows}))  # the lag=0 setting ran no SIS
    assert h.baseline == "tis" and h.value == pytest.approx(0.7 - 0.67) and "lag=4" in h.name
    assert h.spread.kind == "seeds" and h.spread.n == 2
    assert hr.sis_regime({"compare": rows})[0].to_json() == h.to_json()


def test_sis_exact_gradient_ratio_of_mse_at_the_largest_perturbation():
    rows = [{"name": n, "algo": a, "perturbation": p, "mse": m} for n, a, p, m in (
        ("seq_is", "seq_is", 0.5, 4.0), ("none", "grpo", 0.5, 3.0), ("sis", "grpo", 0.5, 1.5),
        ("tis", "grpo", 0.5, 2.0), ("sis", "grpo", 0.1, 9.0))]
    (h,) = _check(hr.sis_exact_gradient({"estimators": rows}))
    assert h.baseline == "tis" and h.value == pytest.approx(2.0 / 1.5)


def test_recommendation_data_selection_and_pruning_builders():
    ox = {"recall_at_10": {"oxygenrec": 0.3, "tiger": 0.25, "popularity": 0.1}, "recall_at_10_std": {},
          "per_seed": [{"oxygenrec": {"recall": 0.3}, "tiger": {"recall": 0.24}},
                       {"oxygenrec": {"recall": 0.3}, "tiger": {"recall": 0.26}}]}
    (h,) = _check(hr.oxygenrec(ox))
    assert h.baseline == "tiger" and h.value == pytest.approx(0.05) and h.metric.startswith("recall@10")
    ppl = {"random": 30.0, "rating": 25.0, "rating+tags": 24.0, "rating+tags+edit": 20.0, "teacher": 10.0}
    (d,) = _check(hr.decoratelm({"heldout_real_ppl": ppl, "per_seed": {}}))
    assert d.baseline == "rating+tags" and d.value == pytest.approx(1.2) and "teacher" not in d.baselines
    ct = {"spearman_sparsity": 0.6, "total_retention": {"web": {"0.6": 0.8}, "code": {"0.6": 0.85},
                                                        "mix": {"0.6": 0.9}}, "best_single_source": {"source": "code"}}
    (c,) = _check(hr.calibration_tradeoffs(ct))
    assert c.baseline == "code" and c.value == pytest.approx(0.05)
    (lm,) = _check(hr.lm_pretrain({"heldout_accuracy": 0.61}))
    assert lm.baseline is None and lm.value == 0.61
    (rl,) = _check(hr.rl({"heldout_pass_at_1_initial": 0.2, "heldout_pass_at_1_final": 0.3, "per_seed": []}))
    assert rl.value == pytest.approx(0.1) and rl.spread is None
    (sp,) = _check(hr.sparse_sync({"ratio_vs_dense": {"coo": 20.0, "auto": 80.0}, "ratio_interval": 1}))
    assert sp.value == pytest.approx(80.0) and sp.baseline == "dense bf16"
    (sc,) = _check(hr.sync_cost_model({"ratio_vs_dense": {"auto": 80.0}}))
    assert sc.value == pytest.approx(80.0)
    (dl,) = _check(hs.dlrm_train({"auc": 0.71}))
    assert dl.value == 0.71


def test_bench_builders():
    case = {"tokens_per_second": {"engine": 300.0, "static": 100.0, "marl": 150.0},
            "seconds": {"engine": [1.0, 1.2], "static": [3.0, 3.0], "marl": [2.0, 2.2]}, "target_ratio": 2.0}
    (r,) = _check(hb.bench_rollout({"models": {"tiny": {"cases": {"long_tail": case}}}}))
    assert r.baseline == "marl" and r.value == pytest.approx(2.0) and r.met is True
    assert (r.spread.kind, r.spread.low, r.spread.high) == ("pairs", pytest.approx(2.2 / 1.2 * 1.0),
                                                            pytest.approx(2.0))
    emb = {"ratios": {"dense": {"median": 3.0, "min": 2.5, "max": 3.5, "pairs": 5},
                      "sparse": {"median": 1.4, "min": 1.2, "max": 1.6, "pairs": 5}}}
    (e,) = _check(hb.bench_embedding(emb))
    assert e.baseline == "sparse" and e.value == 1.4 and (e.spread.low, e.spread.high) == (1.2, 1.6)
    ck = {"forward": {"speedup_jaxflow_over_transformers": 1.3, "pairs": 5},
          "moe": {"speedup_all_to_all_over_dense": 2.0, "pairs": 5},
          "load": {"peak_rss_growth_ratio": 1.1, "target_ratio": 1.2}}
    fw, moe, load = _check(hb.bench_checkpoint(ck))
    assert fw.value == 1.3 and moe.baseline == "dense experts" and load.met is True
    (k,) = _check(hb.bench_kernels({"rows": [{"within_tolerance": True}, {"within_tolerance": False},
                                             {"within_tolerance": None}]}))
    assert k.value == 0.5 and k.met is False
    waste = {"digits_b8": {"padded": 0.5, "lpt+refine": 0.1}, "digits_b64": {"padded": 0.4, "lpt": 0.06,
                                                                              "lpt+refine": 0.05}}
    (p,) = _check(hb.bench_packing({"padding_waste": waste}))
    assert "digits_b64" in p.name and p.baseline == "lpt" and p.value == pytest.approx(0.01)
    pl, fused = _check(hb.bench_policy_loss({"sis_overhead_ratio": 1.05, "sis_overhead_ratios": [1.0, 1.1],
                                             "target_sis_overhead_ratio": 1.03, "fused_to_naive_bytes_ratio": 0.07,
                                             "target_fused_to_naive_bytes_ratio": 0.125}))
    assert pl.met is False and pl.spread.high == 1.1 and fused.met is True
    (sg,) = _check(hb.bench_sparsegpt({"speedup_vs_torch": 2.5, "pairs": 5}))
    assert sg.value == 2.5
    codec = {"bytes_over_entropy_bound": {"auto": 1.02}, "ratio_vs_dense": {"auto": 250.0},
             "encode_speedup_auto_vs_pulse": {"median": 0.5, "min": 0.4, "max": 0.6, "pairs": 3}}
    bound, dense, pulse = _check(hb.bench_sync_codec(codec))
    assert bound.met and dense.value == pytest.approx(250.0) and dense.met and pulse.met is False
    (kf,) = _check(hb.kernel_footprints({"cases": 10, "does_not_fit": 2, "compiled": 8}))
    assert kf.value == 1.0 and kf.met


def test_driver_headlines_round_trip_the_contract():
    h = hb.bench_embedding({"ratios": {"dense": {"median": 3.0, "min": 2.5, "max": 3.5, "pairs": 5}}})[0]
    (back,) = _check(hb.driver_headlines({"headlines": [h.to_json()]}))
    assert back == h
    with pytest.raises(KeyError, match="baseline_rule"):
        hb.driver_headlines({"headlines": [{k: v for k, v in h.to_json().items() if k != "baseline_rule"}]})
