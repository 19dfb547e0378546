"""bench_peers' harness against a fake peer interpreter that speaks the protocol with canned
figures: alternated order, parsing past a library's stray prints, paired ratios and their
ranges, headlines, and the arms that could not run (missing interpreter, setup error, crash)."""

from __future__ import annotations

import json
import os
import stat
import sys

import numpy as np
import pytest

from jaxflow.bench.peers import arm_protocol, cases, harness, workloads

# argv: FAKE <arm name> <order file>; the case carries {"fake": {arm: {"wall": [...], "cpu": ..., ...}}}
FAKE = r'''#!{python}
import json, sys
name, order = sys.argv[1], sys.argv[2]
print("a library's stray print", flush=True)
case = json.loads(sys.stdin.readline())["case"]
me = case["fake"][name]
def send(m):
    sys.stdout.write("@@arm " + json.dumps(m) + "\n"); sys.stdout.flush()
if me.get("fail_setup"):
    send({{"error": "ValueError: no such table"}}); sys.exit(1)
send({{"ready": True, "info": {{"first_loss": me["loss"]}}}})
for line in sys.stdin:
    m = json.loads(line)
    if m.get("stop"):
        break
    r = m["round"]
    with open(order, "a") as f:
        f.write(f"{{name}} {{r}}\n")
    if r == me.get("crash_round"):
        sys.exit(3)
    units = me["units"] * m["steps"]
    send({{"round": r, "wall_s": me["wall"][r] * m["steps"], "cpu_s": me["cpu"] * m["steps"], "steps": m["steps"],
          "units": units, "unit": "samples", "max_rss_bytes": 1000, "last": {{"loss": me["loss"] + 1}}}})
'''


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake_python"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path), str(tmp_path / "order.txt")


def _specs(fake, arms: dict) -> list:
    python, order = fake
    case = {"fake": arms}
    return [harness.ArmSpec(name, "fake", (python, name, order), case) for name in arms]


def test_rounds_alternate_and_ratios_come_from_the_replies(fake, tmp_path):
    arms = {"jaxflow": {"wall": [1.0, 1.0, 1.0], "cpu": 2.0, "units": 100, "loss": 5.0},
            "peer_a": {"wall": [2.0, 3.0, 4.0], "cpu": 1.0, "units": 100, "loss": 5.0},
            "peer_b": {"wall": [0.5, 0.5, 0.5], "cpu": 4.0, "units": 50, "loss": 4.0}}
    results, infos, not_run = harness.run_alternated(_specs(fake, arms), rounds=3, steps=2, log_dir=str(tmp_path))
    assert not_run == {}
    order = open(fake[1]).read().split("\n")[:-1]
    assert order == ["jaxflow 0", "peer_a 0", "peer_b 0", "peer_b 1", "peer_a 1", "jaxflow 1",
                     "jaxflow 2", "peer_a 2", "peer_b 2"]
    assert [r["round"] for r in results["peer_a"]] == [0, 1, 2] and infos["peer_b"]["first_loss"] == 4.0
    summary = cases.summarize_case(results, infos)
    a = summary["ratios"]["peer_a"]
    # jaxflow 100 samples/s; peer_a 50, 33.3, 25 samples/s -> 2x, 3x, 4x; CPU per sample 0.02 vs 0.01
    assert a["throughput"] == pytest.approx({"median": 3.0, "low": 2.0, "high": 4.0, "n": 3})
    assert a["wall"]["median"] == pytest.approx(1 / 3) and a["cpu"]["median"] == pytest.approx(2.0)
    assert summary["ratios"]["peer_b"]["throughput"]["median"] == pytest.approx(1.0)  # 100 vs 100 samples/s
    assert summary["first_loss_rel_diff"] == {"peer_a": 0.0, "peer_b": pytest.approx(0.25)}
    assert summary["last_loss_rel_diff"]["peer_b"] == pytest.approx(0.2)
    heads = cases.headlines({"emb": summary})
    assert [h["name"] for h in heads] == ["emb_vs_strongest_peer", "emb_cpu_vs_strongest_peer"]
    h, cpu = heads
    assert cpu["baseline"] == "peer_b" and cpu["value"] == pytest.approx(0.25) and cpu["met"] is True  # 0.02 / 0.08
    assert cpu["higher_is_better"] is False and cpu["metric"] == "CPU seconds per sample ratio (jaxflow / peer)"
    assert h["baseline"] == "peer_b" and h["value"] == pytest.approx(1.0) and h["met"] is True  # the faster peer
    assert set(h["baselines"]) == {"peer_a", "peer_b"} and h["spread"]["kind"] == "pairs" and h["spread"]["n"] == 3
    assert set(h) >= {"name", "metric", "algorithm", "baseline", "baseline_rule", "baselines", "value", "unit",
                      "higher_is_better", "spread", "target", "target_text", "met"}
    json.dumps(heads)


def test_arms_that_cannot_run_are_listed_and_the_others_go_on(fake, tmp_path):
    arms = {"jaxflow": {"wall": [1.0, 1.0], "cpu": 1.0, "units": 10, "loss": 1.0},
            "broken": {"fail_setup": True, "loss": 1.0},
            "crashy": {"wall": [1.0, 1.0], "cpu": 1.0, "units": 10, "loss": 1.0, "crash_round": 1},
            "rejected": {"wall": [1.0, 1.0], "cpu": 1.0, "units": 10, "loss": 1.0}}
    specs = _specs(fake, arms) + [harness.ArmSpec("absent", "fake", (str(tmp_path / "nope"), "x"), {})]
    seen = []

    def admit(infos):
        seen.append(sorted(infos))
        return {"rejected": "not the same model"}

    results, _, not_run = harness.run_alternated(specs, rounds=2, steps=1, log_dir=str(tmp_path), admit=admit)
    assert seen == [["crashy", "jaxflow", "rejected"]]  # the ready arms, before any round
    assert not_run["rejected"] == "not the same model" and "rejected" not in open(fake[1]).read()
    assert set(results) == {"jaxflow"} and len(results["jaxflow"]) == 2
    assert not_run["broken"] == "arm broken: ValueError: no such table"
    assert not_run["crashy"].startswith("failed in round 1: arm crashy exited (status 3)")
    assert "cannot start" in not_run["absent"]
    assert cases.headlines({"c": cases.summarize_case(results, {})}) == []  # no peer ran: no headline


def test_missing_interpreters_are_reported_not_raised(tmp_path):
    from configs.bench_peers import Config, PeersConfig

    plain = tmp_path / "not_executable"
    plain.write_text("")
    config = Config(cases=("embedding_sgd",), emb_tables=2, emb_rows=50, emb_dim=4, emb_batch=8, emb_bag=3,
                    peers=PeersConfig(torchrec_python=str(tmp_path / "absent")))
    specs, skipped = cases.build_cases(config, str(tmp_path), {"torchrec": config.peers.torchrec_python})
    assert [s.name for s in specs["embedding_sgd"]] == ["jaxflow"]
    assert set(skipped["embedding_sgd"]) == {"torchrec_fused", "torchrec_unfused"}
    assert "no interpreter at" in skipped["embedding_sgd"]["torchrec_fused"]
    assert harness.missing_interpreter(str(plain)) == f"{plain} is not executable"
    specs, skipped = cases.build_cases(config, str(tmp_path), {"torchrec": sys.executable})
    assert [s.name for s in specs["embedding_sgd"]] == ["jaxflow", "torchrec_fused", "torchrec_unfused"]
    assert specs["embedding_sgd"][1].command[1].endswith(os.path.join("peers", "torchrec_arm.py"))
    assert specs["embedding_sgd"][2].case["variant"] == "unfused" and skipped == {}


def test_logits_check_admits_the_same_model_and_leaves_out_another(tmp_path):
    base = np.linspace(-3, 3, 24, dtype=np.float32)
    arms = []
    for name, logits in (("jaxflow", base), ("close", base + 4e-6), ("far", base + 3e-5), ("short", base[:5])):
        path = tmp_path / f"{name}.bin"
        logits.tofile(path)
        arms.append(harness.ArmSpec(name, "fake", ("x",), {"logits_out": str(path)}))
    admit = cases.logits_check(arms)
    infos = {a.name: {} for a in arms}
    out = admit(infos)
    assert set(out) == {"far", "short"} and "differ from jaxflow's by 3e-05 > 1e-05" in out["far"]
    assert infos["close"]["logits_max_abs_diff"] == pytest.approx(4e-6, rel=0.1)
    assert infos["short"]["logits_max_abs_diff"] == float("inf")
    assert cases.logits_check(arms[:1]) is None  # nothing to compare


def test_the_work_is_written_once_and_read_back_exactly(tmp_path):
    case = workloads.embedding_case(str(tmp_path), tables=2, rows=30, dim=4, batch=5, bag=3, optimizer="sgd",
                                    learning_rate=0.1, num_batches=2, warmup=1)
    ids = workloads.read_array(case["arrays"]["ids_1"])
    assert ids.shape == (2, 5, 3) and ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 30
    assert case["max_unique"] >= workloads.unique_ids_bound(ids)
    data, dtype, shape = arm_protocol.read_raw(case["arrays"]["tables"])  # the peers' reader
    assert np.array_equal(np.frombuffer(data, dtype).reshape(shape), workloads.read_array(case["arrays"]["tables"]))
    with pytest.raises(ValueError, match="optimizer='adam'; valid: rowwise_adagrad, sgd"):
        workloads.embedding_case(str(tmp_path), tables=1, rows=2, dim=1, batch=1, bag=1, optimizer="adam",
                                 learning_rate=0.1, num_batches=1, warmup=1)


def test_long_tail_lengths_are_capped_and_long_tailed():
    lengths = workloads.long_tail_lengths(4000, 64, seed=0)
    assert lengths.dtype == np.int32 and lengths.min() >= 1 and lengths.max() == 64
    # median 64 / 4, and a tail capped at 64
    assert abs(float(np.median(lengths)) - 16) <= 1 and float(np.mean(lengths == 64)) > 0.05
    assert np.array_equal(lengths, workloads.long_tail_lengths(4000, 64, seed=0))


def test_protocol_lines_and_config_errors():
    from configs.bench_peers import Config

    assert arm_protocol.decode(arm_protocol.encode({"round": 2})) == {"round": 2}
    assert arm_protocol.decode("Compiling...\n") is None
    with pytest.raises(ValueError, match=r"cases=\('embeddings',\); valid: one or more of embedding_rowwise"):
        Config(cases=("embeddings",))
    with pytest.raises(ValueError, match="emb_torchrec_variants=.*valid: a subset of fused, unfused"):
        Config(emb_torchrec_variants=("fast",))
    with pytest.raises(ValueError, match="gen_vocab=60 with gen_max_new=64: .*valid: gen_vocab > gen_max_new"):
        Config(gen_vocab=60)
    with pytest.raises(ValueError, match="pair_ratios: 1 rounds against 2"):
        harness.pair_ratios([{}], [{}, {}])


def test_grpo_group_case_has_distinct_prompts_sampled_g_times(tmp_path):
    from configs.bench_peers import Config, PeersConfig

    config = Config(cases=("generation_grpo",), gen_vocab=40, gen_d_model=8, gen_layers=1, gen_heads=2,
                    gen_kv_heads=1, gen_d_ff=16, gen_sequences=12, gen_group_size=4, gen_max_new=5,
                    peers=PeersConfig(tunix_python=sys.executable))
    specs, skipped = cases.build_cases(config, str(tmp_path), {"tunix": sys.executable})
    assert skipped == {"generation_grpo": {}}
    ours, peer = specs["generation_grpo"]
    assert (ours.name, peer.name) == ("jaxflow", "tunix_sampler") and peer.command[1].endswith("tunix_arm.py")
    for arm in (ours, peer):  # the same work: 3 prompts x G = 4, sampled, no forced lengths
        assert arm.case["group_size"] == 4 and arm.case["sampled"] is True and arm.case["lengths"] is None
    prompts = workloads.read_array(ours.case["arrays"]["prompts"])
    assert prompts.shape == (3, 16) and 1 <= prompts.min() and prompts.max() < 39  # never the stop id 39
    assert ours.case["logits_out"] != peer.case["logits_out"]
    with pytest.raises(ValueError, match="gen_group_size=5 with gen_sequences=12; valid: a group size dividing"):
        Config(cases=("generation_grpo",), gen_sequences=12, gen_group_size=5)
    with pytest.raises(ValueError, match="group_size=2 with sequences=4, long_tail=True; valid: G >= 1 dividing"):
        workloads.generation_case(str(tmp_path / "x"), vocab=40, d_model=8, layers=1, heads=2, kv_heads=1, d_ff=16,
                                  sequences=4, prompt_len=4, max_new=5, page_size=4, warmup=1, long_tail=True,
                                  group_size=2)



def test_grpo_iteration_case_gives_both_arms_the_same_work(tmp_path):
    from configs.bench_peers import Config, PeersConfig
    from jaxflow.bench.peers import jaxflow_arm

    config = Config(cases=("grpo_iteration",), gen_vocab=40, gen_d_model=8, gen_layers=1, gen_heads=2,
                    gen_kv_heads=1, gen_d_ff=16, gen_sequences=6, gen_group_size=3, gen_max_new=5,
                    grpo_learning_rate=0.25, peers=PeersConfig(tunix_python=str(tmp_path / "absent")))
    specs, skipped = cases.build_cases(config, str(tmp_path), {"tunix": config.peers.tunix_python})
    assert [s.name for s in specs["grpo_iteration"]] == ["jaxflow"]
    assert "no interpreter at" in skipped["grpo_iteration"]["tunix_grpo"]  # listed, not raised
    assert skipped["grpo_iteration"]["trl_grpo"] == "no interpreter configured"
    specs, skipped = cases.build_cases(config, str(tmp_path), {"tunix": sys.executable, "trl": sys.executable})
    ours, peer, trl = specs["grpo_iteration"]
    assert peer.name == "tunix_grpo" and peer.command[1].endswith("tunix_arm.py") and skipped["grpo_iteration"] == {}
    assert trl.name == "trl_grpo" and trl.command[1].endswith("trl_arm.py")
    shared = {k: v for k, v in ours.case.items() if k != "logits_out"}
    for arm in (peer, trl):  # the same work, file for file
        assert shared == {k: v for k, v in arm.case.items() if k != "logits_out"}
    assert ours.case["kind"] == "grpo" and ours.case["group_size"] == 3
    assert ours.case["optimizer"] == dict(cases.GRPO_OPTIMIZER, lr=0.25)
    # the arms' prompts as the trainer's task sees them, and the reward every arm computes
    prompts = [" ".join(str(int(x)) for x in row) for row in workloads.read_array(ours.case["arrays"]["prompts"])]
    task = jaxflow_arm.PromptsTask(prompts, 5)
    assert task.prompts(None, 4) == prompts + prompts[:2] and task.max_prompt_tokens == 16
    assert task.score("p", "2 3 4 7") == jaxflow_arm.even_token_reward("2 3 4 7") == 0.5
    tok = jaxflow_arm.IdTokenizer(40, 40)
    assert tok.decode(tok.encode("5 0 39")) == "5 0 39" and tok.eos_ids == (40,) and tok.bos_id is None
    import importlib.util

    spec = importlib.util.spec_from_file_location("tunix_arm", peer.command[1])  # the peer's script, no tunix import
    tunix_arm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tunix_arm)
    spec = importlib.util.spec_from_file_location("trl_arm", trl.command[1])  # no torch / trl import at the top
    trl_arm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_arm)
    for text in ("2 3 4 7", "1 3", "0 8 38 12 5"):  # the peers' reward is jaxflow's
        ours = jaxflow_arm.even_token_reward(text)
        assert tunix_arm.even_token_reward(text) == trl_arm.even_token_reward([int(t) for t in text.split()]) == ours
