"""``bench_peers``' cases: which arms run which work with which interpreter, and each case's
figures once its rounds are done.

A case is a list of :class:`jaxflow.bench.peers.harness.ArmSpec` on the same JSON work: the
jaxflow arm (``python -m jaxflow.bench.peers.jaxflow_arm`` by this interpreter) and the peers'
arms (``<peer>_arm.py`` run as a script by the peer's interpreter). An arm whose interpreter is
missing is not an error: the case lists it under ``not_run`` with the reason.

  embedding_rowwise_adagrad, embedding_sgd: the embedding step
      (:mod:`jaxflow.bench.peers.workloads`) vs TorchRec's ``FusedEmbeddingBagCollection``
      (``torchrec_fused``) and ``EmbeddingBagCollection`` + optimizer (``torchrec_unfused``).
  generation_equal: greedy generation of ``gen_max_new`` tokens for each of ``gen_sequences``
      prompts (every sequence the same length) by jaxflow's paged rollout engine vs tunix's
      ``Sampler`` (``tunix_sampler``) on the same checkpoint; before timing, the two models'
      logits on the same tokens must agree to ``LOGITS_TOLERANCE`` (:func:`logits_check`), else
      the peer arm is left out with the difference as its reason.
  generation_long_tail: the same with lognormal output lengths (median a quarter of
      ``gen_max_new``, capped there), forced identically in both arms (EOS included).
  generation_grpo: GRPO groups: ``gen_sequences / gen_group_size`` prompts, each sampled G
      times at temperature 1, every sequence ``gen_max_new`` tokens (the stop token never ends
      one): the engine prefills each prompt once for its G slots, tunix's ``Sampler`` gets each
      prompt repeated G times (as its GRPO learner does).
  grpo_iteration: one GRPO iteration (rollout of the generation_grpo work, rewards, group
      advantages, one AdamW update with global-norm clipping; no KL, no separate old-policy
      pass) by :class:`jaxflow.rl.grpo.GRPOTrainer` vs tunix's ``GRPOLearner`` (``tunix_grpo``),
      the same checkpoint (logits checked as above), prompts, G, lengths, reward and optimizer;
      and vs TRL's ``GRPOTrainer`` (``trl_grpo``, torch on the CPU, the same work).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Mapping, Sequence

from jaxflow.bench.peers.harness import ArmSpec, case_cpu_headline, case_headline, missing_interpreter, pair_ratios
from jaxflow.bench.peers.workloads import embedding_case, generation_case

__all__ = ["PEERS", "CASES", "LOGITS_TOLERANCE", "GRPO_OPTIMIZER", "arm_command", "interpreters", "build_cases",
           "logits_check", "summarize_case", "headlines"]

PEERS = ("torchrec", "tunix", "trl")
CASES = ("embedding_rowwise_adagrad", "embedding_sgd", "generation_equal", "generation_long_tail", "generation_grpo",
         "grpo_iteration")
#: the largest |logit difference| between jaxflow's model and a peer's on the same checkpoint
LOGITS_TOLERANCE = 1e-5
#: the GRPO case's AdamW in every arm (jaxflow's OptimConfig defaults; lr from the config, constant)
GRPO_OPTIMIZER = {"weight_decay": 0.01, "b1": 0.9, "b2": 0.98, "grad_clip": 1.0}
HERE = os.path.dirname(os.path.abspath(__file__))


def arm_command(peer: str, python: str | None = None) -> tuple[str, ...]:
    """The argv of an arm: jaxflow's module by this interpreter, or ``<peer>_arm.py`` by ``python``."""
    if peer == "jaxflow":
        return (python or sys.executable, "-m", "jaxflow.bench.peers.jaxflow_arm")
    if peer not in PEERS:
        raise ValueError(f"peer={peer!r}; valid: jaxflow, {', '.join(PEERS)}")
    return (python, os.path.join(HERE, f"{peer}_arm.py"))


def interpreters(pythons: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(``{peer: interpreter}`` of the usable ones, ``{peer: why not}`` of the others) for
    ``pythons`` = ``{peer: path}``."""
    ok, missing = {}, {}
    for peer, python in pythons.items():
        reason = missing_interpreter(python)
        if reason is None:
            ok[peer] = python
        else:
            missing[peer] = reason
    return ok, missing


def build_cases(config, work_dir: str, pythons: Mapping[str, str]) -> tuple[dict, dict]:
    """(``{case: [ArmSpec, ...]}``, ``{case: {arm: reason}}`` of the arms left out for a missing
    interpreter) for ``config.cases``; the work's arrays are written under ``work_dir``.

    ``config``: the ``bench_peers`` config (``cases``, ``seed``, ``warmup``, ``emb_*``)."""
    ok, missing = interpreters(pythons)
    specs, skipped = {}, {}
    emb = None
    for name in config.cases:
        if name not in CASES:
            raise ValueError(f"case {name!r}; valid: {', '.join(CASES)}")
        if name == "grpo_iteration":
            specs[name] = _grpo_arms(config, os.path.join(work_dir, name), ok, missing, skipped.setdefault(name, {}))
            continue
        if name.startswith("generation_"):
            specs[name] = _generation_arms(config, os.path.join(work_dir, name), ok, missing,
                                           skipped.setdefault(name, {}))
            continue
        optimizer = name.removeprefix("embedding_")
        if emb is None:
            emb = embedding_case(os.path.join(work_dir, "embedding"), tables=config.emb_tables,
                                 rows=config.emb_rows, dim=config.emb_dim, batch=config.emb_batch,
                                 bag=config.emb_bag, optimizer=optimizer, learning_rate=config.emb_learning_rate,
                                 num_batches=config.emb_batches, warmup=config.warmup, seed=config.seed)
        case = dict(emb, optimizer=optimizer)
        arms = [ArmSpec("jaxflow", "jaxflow", arm_command("jaxflow"), case)]
        for variant in config.emb_torchrec_variants:
            arm = f"torchrec_{variant}"
            if "torchrec" in ok:
                arms.append(ArmSpec(arm, "torchrec", arm_command("torchrec", ok["torchrec"]),
                                    dict(case, variant=variant)))
            else:
                skipped.setdefault(name, {})[arm] = missing["torchrec"]
        specs[name] = arms
    return specs, skipped


def _config_case(config, directory: str, **extra) -> dict:
    """``generation_case`` with the config's model, lengths, warm-up and seed (+ ``extra``)."""
    return generation_case(directory, vocab=config.gen_vocab, d_model=config.gen_d_model, layers=config.gen_layers,
                           heads=config.gen_heads, kv_heads=config.gen_kv_heads, d_ff=config.gen_d_ff,
                           sequences=config.gen_sequences, prompt_len=config.gen_prompt_len,
                           max_new=config.gen_max_new, page_size=config.gen_page_size, warmup=config.warmup,
                           seed=config.seed, **extra)


def _grpo_arms(config, directory: str, ok: Mapping[str, str], missing: Mapping[str, str],
               skipped: dict) -> list[ArmSpec]:
    case = _config_case(config, directory, group_size=config.gen_group_size)
    case = dict(case, kind="grpo", seed=config.seed, optimizer=dict(GRPO_OPTIMIZER, lr=config.grpo_learning_rate))
    arms = [ArmSpec("jaxflow", "jaxflow", arm_command("jaxflow"),
                    dict(case, logits_out=os.path.join(directory, "logits_jaxflow.bin")))]
    if "tunix" in ok:
        arms.append(ArmSpec("tunix_grpo", "tunix", arm_command("tunix", ok["tunix"]),
                            dict(case, logits_out=os.path.join(directory, "logits_tunix_grpo.bin"))))
    else:
        skipped["tunix_grpo"] = missing.get("tunix", "no interpreter configured")
    if "trl" in ok:
        arms.append(ArmSpec("trl_grpo", "trl", arm_command("trl", ok["trl"]),
                            dict(case, logits_out=os.path.join(directory, "logits_trl_grpo.bin"))))
    else:
        skipped["trl_grpo"] = missing.get("trl", "no interpreter configured")
    return arms


def _generation_arms(config, directory: str, ok: Mapping[str, str], missing: Mapping[str, str],
                     skipped: dict) -> list[ArmSpec]:
    case = _config_case(config, directory, long_tail=directory.endswith("long_tail"),
                        group_size=config.gen_group_size if directory.endswith("grpo") else 1)
    engine = {"decode_steps": config.gen_decode_steps, "prefill_rows": config.gen_prefill_rows or config.gen_sequences}
    if config.gen_loop_steps:  # the engine's multi-step decode loop; the option exists only where the engine has it
        engine["loop_steps"] = config.gen_loop_steps
    arms = [ArmSpec("jaxflow", "jaxflow", arm_command("jaxflow"),
                    dict(case, engine=engine, logits_out=os.path.join(directory, "logits_jaxflow.bin")))]
    if "tunix" in ok:
        arms.append(ArmSpec("tunix_sampler", "tunix", arm_command("tunix", ok["tunix"]),
                            dict(case, logits_out=os.path.join(directory, "logits_tunix_sampler.bin"))))
    else:
        skipped["tunix_sampler"] = missing["tunix"]
    return arms


def logits_check(arms: Sequence[ArmSpec], ours: str = "jaxflow", tolerance: float = LOGITS_TOLERANCE):
    """The ``admit`` of :func:`jaxflow.bench.peers.harness.run_alternated` for arms whose case
    names a ``logits_out`` file: each peer arm's logits against ours; it records
    ``info["logits_max_abs_diff"]`` and leaves out an arm above ``tolerance``. None when no
    arm writes logits."""
    import numpy as np

    paths = {a.name: a.case["logits_out"] for a in arms if "logits_out" in a.case}
    if ours not in paths or len(paths) < 2:
        return None

    def admit(infos: dict) -> dict:
        if ours not in infos:
            return {}
        base = np.fromfile(paths[ours], np.float32)
        out = {}
        for arm, info in infos.items():
            if arm == ours or arm not in paths:
                continue
            got = np.fromfile(paths[arm], np.float32)
            diff = float(np.max(np.abs(got - base))) if got.shape == base.shape else float("inf")
            info["logits_max_abs_diff"] = diff
            if not diff <= tolerance:
                out[arm] = (f"its logits differ from {ours}'s by {diff:.3g} > {tolerance:g} on the same "
                            "checkpoint and tokens: not the same model, not timed")
        return out

    return admit


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def summarize_case(results: Mapping[str, list], infos: Mapping[str, dict], ours: str = "jaxflow") -> dict:
    """A case's figures from :func:`jaxflow.bench.peers.harness.run_alternated`'s results:
    per arm the median rate (units/s), CPU seconds per unit, peak RSS and its ``info``; per peer
    arm the paired ratios (:func:`jaxflow.bench.peers.harness.pair_ratios`) and the relative
    differences of its first loss (before any update) and last loss (after every step of every
    round: the same number of steps in each arm) from ours: the same work gives the same losses,
    up to float rounding."""
    arms = {}
    for arm, rounds in results.items():
        arms[arm] = {"rate": _median([r["units"] / r["wall_s"] for r in rounds]),
                     "cpu_s_per_unit": _median([r["cpu_s"] / r["units"] for r in rounds]),
                     "wall_s_per_round": [r["wall_s"] for r in rounds],
                     "cpu_s_per_round": [r["cpu_s"] for r in rounds],
                     "unit": rounds[0]["unit"], "max_rss_bytes": max(r["max_rss_bytes"] for r in rounds),
                     "rounds": len(rounds), "info": infos.get(arm, {})}
    out = {"arms": arms, "ratios": {}, "first_loss_rel_diff": {}, "last_loss_rel_diff": {}}
    if ours in results:
        for arm in results:
            if arm == ours:
                continue
            out["ratios"][arm] = pair_ratios(results[ours], results[arm])
            first = [infos.get(a, {}).get("first_loss") for a in (ours, arm)]
            last = [results[a][-1]["last"].get("loss") for a in (ours, arm)]
            pairs = {"first_loss_rel_diff": first, "last_loss_rel_diff": last}
            for key, (a, b) in pairs.items():
                if a is not None and b is not None:
                    out[key][arm] = abs(a - b) / max(abs(b), 1e-30)
    return out


def headlines(cases: Mapping[str, dict], ours: str = "jaxflow") -> list[dict]:
    """Two headlines per case with a peer arm: our rate over the strongest peer arm's
    (:func:`jaxflow.bench.peers.harness.case_headline`, target >= 1.0x) and our CPU seconds per
    unit over that arm's (:func:`jaxflow.bench.peers.harness.case_cpu_headline`, target <= 1.0x)."""
    out = []
    for name, case in cases.items():
        arms = case["arms"]
        if ours not in arms:
            continue
        unit = arms[ours]["unit"]
        head = case_headline(name, f"{unit}/s ratio (jaxflow / peer)", ours,
                             {k: v["rate"] for k, v in arms.items()}, case["ratios"])
        if head is not None:
            out.append(head)
            out.append(case_cpu_headline(name, unit[:-1] if unit.endswith("s") else unit, ours,
                                         {k: v["cpu_s_per_unit"] for k, v in arms.items()}, case["ratios"],
                                         head["baseline"]))
    return out
