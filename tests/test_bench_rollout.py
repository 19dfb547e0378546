"""bench_rollout at a tiny shape (seconds): the JSON fields, useful tokens counted equally by
every arm, the engine's tokens equal to the static sampler's on the same keys in the bench
setup (the forcing hook included), the forced lengths following the stated distribution."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from configs.bench_rollout import Config, ModelCase
from jaxflow.experiment import standalone_context
from jaxflow.main import bench_rollout as br
from jaxflow.models.transformer import Transformer, TransformerConfig
from jaxflow.rollout import bench_arms as arms
from jaxflow.rollout.bench import TARGET_RATIO

TINY = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64,
                         max_seq_len=32)
CASE = ModelCase(name="tiny", model=TINY, prompt_len=6, max_new=12, slots=4, page_size=4, pairs=2)
CASE_KEYS = {"sequences", "prompts", "group_size", "length_distribution", "realised_lengths",
             "useful_tokens", "useful_tokens_equal", "mismatched_rows_engine_vs_static",
             "tokens_per_second",
             "ratio_median", "ratio_min", "ratio_max", "ratios", "median_round", "seconds",
             "cpu_seconds", "cpu_ratio_median", "cpu_ratio_min", "cpu_ratio_max",
             "target_ratio", "target_ratio_met", "peak_kv_bytes", "engine_pool_bytes",
             "engine_stats", "load_avg_1min"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_rollout")
    cfg = Config(requests=16, group_size=4, flagship=CASE, large=None)
    summary = br.main(cfg, standalone_context("bench_rollout", out_dir=str(out)))
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["models"]["tiny"]["cases"].keys() == summary["models"]["tiny"]["cases"].keys()
    return summary


def test_results_fields_and_counts(results):
    assert {"machine", "budget", "targets", "load_avg_start", "load_avg_end"} <= set(results)
    model = results["models"]["tiny"]
    assert model["kv_budget_bytes"] == 4 * (6 + 12) * arms.kv_bytes_per_token(TINY)
    assert set(model["cases"]) == {"equal", "long_tail", "grpo"}
    assert all(set(case["seconds"]) == {"engine", "static"} for case in model["cases"].values())
    for name, case in model["cases"].items():
        assert CASE_KEYS <= set(case), (name, CASE_KEYS - set(case))
        assert case["sequences"] == 16 and len(case["ratios"]) == 2
        assert case["useful_tokens_equal"] is True
        assert case["mismatched_rows_engine_vs_static"] == 0
        assert case["ratio_min"] <= case["ratio_median"] <= case["ratio_max"]
        assert case["target_ratio"] == TARGET_RATIO[name]
        assert all(len(s) == 2 and min(s) > 0 for s in case["seconds"].values())
        assert all(len(s) == 2 and min(s) > 0 for s in case["cpu_seconds"].values())
        assert case["cpu_ratio_min"] <= case["cpu_ratio_median"] <= case["cpu_ratio_max"]
        assert case["cpu_ratio_median"] == pytest.approx(float(np.median(
            np.divide(case["cpu_seconds"]["static"], case["cpu_seconds"]["engine"]))))
        # equal budget: the engine's pool is the baselines' cache plus its null page
        page = model["kv_bytes_per_token"] * 4
        assert case["peak_kv_bytes"]["static"] == model["kv_budget_bytes"]
        assert case["engine_pool_bytes"] == (1 + 4 * -(-18 // 4)) * page  # 5 pages per row
        assert case["peak_kv_bytes"]["engine"] <= case["engine_pool_bytes"]
    equal = model["cases"]["equal"]
    assert equal["useful_tokens"] == 16 * 12 and equal["realised_lengths"]["min"] == 12
    tail = model["cases"]["long_tail"]
    assert tail["useful_tokens"] < 16 * 12 and tail["realised_lengths"]["min"] >= 1
    grpo = model["cases"]["grpo"]
    assert grpo["group_size"] == 4 and grpo["prompts"] == 4
    pk = grpo["prompt_kv"]
    assert pk["bound_bytes"] == pytest.approx(pk["baseline_bytes"] / 4 + 4 * page)
    assert pk["met"] == (pk["engine_peak_bytes"] <= pk["bound_bytes"])
    assert pk["engine_peak_bytes"] <= pk["engine_peak_bytes_with_lookahead"]
    # sharing happens: the engine holds less prompt KV than the baselines' rows
    assert pk["engine_peak_bytes"] < pk["baseline_bytes"]


def test_engine_equals_static_sampler_in_bench_setup():
    """Same keys, the forcing hook, the bench's engine config: identical tokens and masks, and
    the useful tokens counted from either are the same."""
    graphdef, state = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    sampling = arms.sampling_config(12, 1.0)
    cfg = Config()
    for case in ("long_tail", "grpo"):  # the fixture's shapes and hook: compiled programs reused
        w = arms.make_workload(case, sequences=16, group_size=4, prompt_len=6, max_new=12,
                               vocab=23, median_frac=cfg.tail_median_frac, sigma=cfg.tail_sigma,
                               seed=1)
        engine = arms.EngineArm(graphdef, state, sampling, slots=4, page_size=4, prompt_len=6,
                                prefill_rows=CASE.prefill_rows, prefill_calls=cfg.prefill_calls,
                                decode_steps=CASE.decode_steps).run(w)
        static = arms.StaticArm(graphdef, state, sampling, 4).run(w)
        np.testing.assert_array_equal(engine.tokens, static.tokens)
        np.testing.assert_array_equal(engine.mask, static.mask)
        lengths = engine.mask.sum(1)
        assert lengths.min() < 12 and engine.mask.sum() == static.mask.sum()
        # mask is 1 up to and including EOS, and EOS ends a row (or the cap does)
        ends = engine.tokens[np.arange(16), lengths.astype(int) - 1]
        assert np.all((ends == arms.EOS_ID) | (lengths == 12))


def test_forced_lengths_follow_the_pmf():
    """The hook's EOS hazard gives lengths distributed as the pmf (checked on 4096 draws)."""
    pmf = arms.length_pmf("long_tail", 16, median_frac=0.25, sigma=1.0)
    assert pmf.sum() == pytest.approx(1.0) and pmf[-1] > 0
    h = arms.hazard(pmf)
    assert h[-1] == 1.0
    hook = arms.forced_length_hook(h)
    logits = jax.random.normal(jax.random.key(0), (4096, 23))
    alive = np.ones(4096, bool)
    lengths = np.zeros(4096, int)
    for t in range(16):
        lp = hook.apply(logits, None, np.int32(t), None)
        tok = np.asarray(jax.random.categorical(jax.random.key(t + 1), lp))
        ended = alive & (tok == arms.EOS_ID)
        lengths[ended] = t + 1
        alive &= ~ended
    assert not alive.any()
    freq = np.bincount(lengths, minlength=17)[1:] / 4096
    np.testing.assert_allclose(freq, pmf, atol=0.025)
    equal = arms.hazard(arms.length_pmf("equal", 16, median_frac=0.25, sigma=1.0))
    assert equal[:-1].max() == 0.0 and equal[-1] == 1.0
