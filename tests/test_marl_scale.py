"""flexmarl_scale simulator: analytic degenerate cases, balancer equivalences, invariants, CLI."""

import dataclasses
import json

import numpy as np
import pytest

from jaxflow import run as runner
from jaxflow.marl import balance
from jaxflow.marl.simulate import (
    FLEXMARL,
    AgentCosts,
    AgentLoad,
    MeasuredRun,
    RolloutPool,
    Schedule,
    calibrate,
    check_agents,
    load_measurement,
    run_scale,
    sample_lengths,
    simulate,
    simulate_flexmarl,
    simulate_sync,
    split_devices,
)

ONE = AgentLoad("solo", params=1e9, prompt_tokens=10, len_median=50.0, len_sigma=0.0,
                len_max=1000)


def _costs(weight=1e-3, seq=0.0, train=1e-4, publish=0.0, swap=0.0):
    return AgentCosts(weight_s=weight, seq_s=seq, train_token_s=train, publish_s=publish,
                      swap_s=swap)


def _drain(pool, requests):
    return pool.run([(i, L) for i, L in enumerate(requests)], 0.0)


# ----------------------------------------------------------------------------- rollout pool


@pytest.mark.parametrize("policy", ["round_robin", "longest_first", "work_stealing"])
def test_one_slot_pool_matches_balance_makespans(policy):
    """slots=1 and a constant step cost: the pool is balance.py's sequential workers."""
    lengths = np.random.default_rng(3).lognormal(3.0, 1.0, 37).round().clip(1).astype(int)
    pool = RolloutPool(5, 1, _costs(weight=2e-3), policy)
    end = _drain(pool, lengths.tolist())
    costs = lengths.astype(float).tolist()
    if policy == "work_stealing":
        expected = balance.work_stealing_makespan(costs, 5)
    else:
        fn = balance.round_robin if policy == "round_robin" else balance.longest_first
        expected = balance.makespan(costs, fn(costs, 5), 5)
    assert end == pytest.approx(expected * 2e-3, rel=1e-9)
    assert pool.busy_s == pytest.approx(lengths.sum() * 2e-3, rel=1e-9)  # one slot: busy = work


def test_continuous_batching_step_cost_depends_on_occupancy():
    # n equal sequences on one replica: L steps of (w + n s); then a tail alone at (w + s).
    pool = RolloutPool(1, 8, _costs(weight=1.0, seq=0.5), "round_robin")
    assert _drain(pool, [10] * 4) == pytest.approx(10 * (1.0 + 4 * 0.5))
    pool = RolloutPool(1, 8, _costs(weight=1.0, seq=0.5), "round_robin")
    # two of length 10 together (step 2.0), then the longer one alone for 6 steps (1.5)
    assert _drain(pool, [10, 16]) == pytest.approx(10 * 2.0 + 6 * 1.5)


def test_balancers_match_round_robin_without_length_skew():
    for policy in ("longest_first", "work_stealing"):
        ends = {p: _drain(RolloutPool(6, 4, _costs(seq=1e-4), p), [40] * 53)
                for p in ("round_robin", policy)}
        assert ends[policy] == pytest.approx(ends["round_robin"], rel=1e-12)
    lengths = sample_lengths([ONE], versions=2, inputs=12, group_size=4, seed=0)
    walls = {p: simulate_flexmarl([ONE], {"solo": _costs()}, lengths, devices=8, slots=4,
                                  schedule=Schedule(p, True, request_policy=p)).wall_s
             for p in ("round_robin", "longest_first", "work_stealing")}
    assert len({round(w, 9) for w in walls.values()}) == 1, walls


def test_balancers_beat_round_robin_on_skewed_lengths():
    lengths = np.random.default_rng(0).lognormal(4.0, 1.2, 200).round().clip(1).astype(int)
    ends = {p: _drain(RolloutPool(8, 2, _costs(seq=1e-4), p), lengths.tolist())
            for p in ("round_robin", "longest_first", "work_stealing")}
    assert ends["longest_first"] < ends["round_robin"]
    assert ends["work_stealing"] < ends["round_robin"]


# ----------------------------------------------------------------------------- schedules


def test_sync_matches_the_lockstep_formula():
    L, n, D, versions = 50, 32, 8, 3
    c = _costs(weight=1e-3, seq=2e-5, train=1e-4, publish=0.3, swap=0.7)
    lengths = sample_lengths([ONE], versions=versions, inputs=8, group_size=4, seed=1)
    assert (lengths["solo"] == L).all()
    res = simulate_sync([ONE], {"solo": c}, lengths, devices=D, slots=8)
    k = n // D
    per_version = L * (c.weight_s + k * c.seq_s) + n * (10 + L) * c.train_token_s / D \
        + 2 * c.swap_s + c.publish_s
    assert res.wall_s == pytest.approx(versions * per_version, rel=1e-9)


@pytest.mark.parametrize("train", [2e-4, 9e-4])  # train per sample below / above rollout
def test_strict_pipeline_reaches_the_analytic_overlap(train):
    """One rollout + one train device, one slot, equal lengths: streaming micro-batches of 1
    gives min(t_ro, t_tr) + n max(t_ro, t_tr) per version; a full-batch trainer n (t_ro + t_tr);
    so the speedup is exact and tends to the overlap bound (t_ro + t_tr) / max(t_ro, t_tr)."""
    n, versions = 24, 2
    c = _costs(weight=1e-3, train=train)
    t_ro, t_tr = 50 * 1e-3, 60 * train  # 50 response tokens; 10 prompt + 50 trained tokens
    lengths = sample_lengths([ONE], versions=versions, inputs=6, group_size=4, seed=0)
    split = ({"solo": 1}, {"solo": 1})
    run = lambda mb: simulate_flexmarl([ONE], {"solo": c}, lengths, devices=2, slots=1,  # noqa
                                       schedule=Schedule("s", True, micro_batch=mb),
                                       split=split).wall_s
    streamed, full_batch = run(1), run(n)
    assert streamed == pytest.approx(versions * (min(t_ro, t_tr) + n * max(t_ro, t_tr)), rel=1e-9)
    assert full_batch == pytest.approx(versions * n * (t_ro + t_tr), rel=1e-9)
    bound = (t_ro + t_tr) / max(t_ro, t_tr)
    assert full_batch / streamed == pytest.approx(bound * n * max(t_ro, t_tr)
                                                  / (min(t_ro, t_tr) + n * max(t_ro, t_tr)))
    assert bound * (1 - 1 / n) < full_batch / streamed < bound


def test_bounded_staleness_is_never_slower_than_strict():
    cfg = _small_config()
    agents = cfg.agents
    costs, _ = calibrate(agents, load_measurement().measured, cfg.hardware)
    lengths = sample_lengths(agents, versions=3, inputs=16, group_size=4, seed=0)
    strict = simulate(agents, costs, lengths, devices=16, slots=8, schedule=FLEXMARL)
    eta1 = simulate(agents, costs, lengths, devices=16, slots=8,
                    schedule=dataclasses.replace(FLEXMARL, eta=1))
    assert eta1.wall_s <= strict.wall_s * (1 + 1e-12)


def _small_config(**kw):
    from configs.flexmarl_scale import get_config

    return dataclasses.replace(get_config("quick"),
                               **{"nodes": (1, 2), "inputs_per_node": 4, "versions": 2} | kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flexmarl_not_worse_than_sync_and_fractions_in_range(seed):
    out = run_scale(_small_config(seed=seed))
    walls = {(r["nodes"], r["schedule"]): r["wall_s"] for r in out["rows"]}
    for nodes in (1, 2):
        assert walls[(nodes, "flexmarl")] <= walls[(nodes, "sync")], walls
    for r in out["rows"]:
        for role, u in r["utilisation"].items():
            assert 0.0 < u <= 1.0, (r["schedule"], role, u)


def test_deterministic_given_seed():
    a, b = run_scale(_small_config()), run_scale(_small_config())
    assert json.dumps(a["rows"], default=float) == json.dumps(b["rows"], default=float)
    c = run_scale(_small_config(seed=5))
    assert json.dumps(a["rows"], default=float) != json.dumps(c["rows"], default=float)


def test_split_devices_is_proportional_and_complete():
    assert split_devices(10, [1, 1]) == [5, 5]
    assert split_devices(10, [3, 1]) == [7, 3]
    assert split_devices(5, [1000, 1e-9, 1e-9]) == [3, 1, 1]
    with pytest.raises(ValueError, match="3 devices"):
        split_devices(3, [1, 1, 1, 1])


@pytest.mark.parametrize("make, match", [
    (lambda: dataclasses.replace(ONE, len_sigma=-0.5), "len_sigma=-0.5"),
    (lambda: dataclasses.replace(ONE, len_median=0.0), "len_median=0.0"),
    (lambda: Schedule("x", True, request_policy="fifo"), "request_policy='fifo'"),
    (lambda: Schedule("x", True, eta=-1), "eta=-1"),
    (lambda: Schedule("x", True, agent_split="even"), "agent_split='even'"),
    (lambda: RolloutPool(2, 0, _costs(), "round_robin"), "slots=0"),
    (lambda: run_scale(_small_config(nodes=(0, 8))), r"nodes=\(0, 8\)"),
    (lambda: run_scale(_small_config(slots=0)), "slots=0"),
    (lambda: run_scale(_small_config(global_inputs=-4)), "global_inputs=-4"),
    (lambda: run_scale(_small_config(sigma_scale=-1.0)), "sigma_scale=-1.0"),
    (lambda: simulate_sync([dataclasses.replace(ONE, upstream="ghost")], {}, {}, devices=2,
                           slots=1), "upstream='ghost'"),
    (lambda: simulate_flexmarl([ONE], {"solo": _costs()}, sample_lengths(
        [ONE], versions=1, inputs=1, group_size=2, seed=0), devices=1, slots=1), "devices=1"),
])
def test_bad_values_raise_errors_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        obj = make()
        if isinstance(obj, AgentLoad):
            check_agents([obj])


def test_bad_variant_names_the_variant():
    from configs.flexmarl_scale import get_config

    with pytest.raises(ValueError, match="'huge'"):
        get_config("huge")


def test_cli_quick_run_writes_summary(tmp_path, capsys):
    """The runner in-process (a subprocess would spend seconds importing JAX)."""
    out = tmp_path / "run"
    code = runner.main(["--exp=flexmarl_scale", "--variant=quick", f"--out={out}",
                        "--set", "nodes=1,2", "--set", "inputs_per_node=2", "--set", "versions=2"])
    assert code == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("speedup_vs_sync", "utilisation", "baseline_utilisation", "paper_speedup",
                "paper_utilisation_ratio", "utilisation_ratio"):
        assert key in summary, key
    assert set(summary["speedup_vs_sync"]) == {"1", "2"}
    assert summary["paper_speedup"] == 7.3 and summary["paper_utilisation_ratio"] == 5.6
    assert 0 < summary["utilisation"]["2"]["overall"] <= 1
    assert (out / "plots" / "flexmarl_scale.png").stat().st_size > 1000


def test_builtin_measurement_is_a_data_file_with_provenance(tmp_path):
    from jaxflow.marl.simulate import DEFAULT_CALIBRATION

    record = json.loads(DEFAULT_CALIBRATION.read_text())
    assert {"command", "git_commit", "devices", "date", "machine"} <= set(record["provenance"])
    assert "--exp=flexmarl" in record["provenance"]["command"]
    assert load_measurement().measured == MeasuredRun(**record["values"])
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"provenance": {}, "values": {
        k: v for k, v in record["values"].items() if k != "busy_rollout"}}))
    with pytest.raises(ValueError, match="busy_rollout"):
        load_measurement(bad)
