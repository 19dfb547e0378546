"""The ``oxygenrec`` study: every system of ``config.systems`` on one seed's data
(:func:`run_seed`; one cell of :func:`jaxflow.study.run_cells` per seed, :func:`seed_cells` /
:func:`seed_record`), and the summary over seeds (:func:`summarize_seeds`).

Per seed: data and semantic IDs (:func:`jaxflow.genrec.setup.build_setup`) -> each system
trained on the training requests (the generative arms through
:class:`jaxflow.genrec.system.OxygenRECSystem`, SASRec, popularity) -> top-K for every test
request -> :func:`jaxflow.genrec.system.score`. ``oxygenrec_no_rl`` is the ``oxygenrec`` arm
before its RL stage; ``oxygenrec_per_scenario`` trains one ``oxygenrec`` arm per scenario
with the same total SFT steps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxflow.genrec.metrics import popularity_ranking
from jaxflow.genrec.sasrec import fit_sasrec, recommend_sasrec
from jaxflow.genrec.setup import build_setup, load_source, semantic_id_report
from jaxflow.genrec.system import ARMS, OxygenRECSystem, score, train_stage
from jaxflow.genrec.train import data_mesh, log_hook


def run_seed(config, seed: int, run) -> tuple[dict, dict, dict]:
    """(score per system, semantic-ID report, RL report) of one seed; training rows go to
    ``run.log`` as ``<system>/<metric>`` (one row per logged step, numbered across the seed),
    progress to ``run.info``."""
    config = dataclasses.replace(config, seed=seed)
    mesh = data_mesh()
    setup = build_setup(config, seed, mesh)
    data, sid, m = setup.data, setup.sid, config.model
    run.info(f"seed {seed}: {data.source}; {len(data.train)} train / {len(data.test)} test requests")
    sid_report = semantic_id_report(setup)
    run.info(f"  semantic IDs: {sid.kmeans_levels} k-means levels + {sid.dedup_levels} dedup "
             f"level(s) of width {m.width}; largest prefix group {sid.largest_prefix_group} "
             f"items, {100 * sid.collision_rate:.1f}% of items collide before resolution")
    test, results, rl_report = data.test, {}, {}
    systems = set(config.systems)
    step_log = [0]

    def log(step, metrics, prefix):
        step_log[0] += 1
        run.log(step_log[0], {f"{prefix}/{k}": v for k, v in metrics.items()})

    def generative(name, arm, *, requests=None, steps=None):
        system = OxygenRECSystem(ARMS[arm])
        state = system.init(config, {"mesh": mesh}, jax.random.key(seed), setup=setup)
        steps = steps or config.sft.steps
        t0 = time.time()
        hook = log_hook(lambda s, x: log(s, x, name), every=100, steps=steps)
        state, _ = train_stage(system, state, steps=steps, requests=requests, hooks=[hook])
        run.info(f"  {name}: {steps} SFT steps in {time.time() - t0:.1f}s")
        return system, state

    def evaluate(system, state, reqs=test):
        return score(system.recommend(state, reqs), data, reqs, config)

    if "popularity" in systems:
        seen = np.unique(np.concatenate([
            np.stack([data.train.user, data.train.target], 1),
            np.stack([np.repeat(data.train.user, data.train.history.shape[1]),
                      data.train.history.reshape(-1)], 1)]), axis=0)
        seen = seen[seen[:, 1] >= 0]
        top = popularity_ranking(seen[:, 1], data.n_items, config.k)
        results["popularity"] = score(np.tile(top, (len(test), 1)), data, test, config)
    if "sasrec" in systems:
        t0 = time.time()
        g, p, _ = fit_sasrec(data.train, data.n_items, config.sasrec, seed=seed, mesh=mesh)
        run.info(f"  sasrec: {config.sasrec.steps} steps in {time.time() - t0:.1f}s")
        results["sasrec"] = score(recommend_sasrec(g, p, test, config.sasrec, k=config.k),
                                  data, test, config)
    for name in ("tiger", "tiger_instruction"):
        if name in systems:
            results[name] = evaluate(*generative(name, name))
    if systems & {"oxygenrec", "oxygenrec_no_rl"}:
        system, state = generative("oxygenrec", "oxygenrec")
        before = evaluate(system, state)
        if "oxygenrec_no_rl" in systems:
            results["oxygenrec_no_rl"] = before
        if "oxygenrec" in systems:
            t0 = time.time()
            hook = log_hook(lambda s, x: log(s, x, "oxygenrec_rl"), every=10,
                            steps=config.rl.steps, prefix="rl_")
            state, hist = train_stage(system, system.start_rl(state), steps=config.rl.steps,
                                      hooks=[hook])
            run.info(f"  oxygenrec: {config.rl.steps} SA-GCPO steps in {time.time() - t0:.1f}s")
            after = results["oxygenrec"] = evaluate(system, state)
            window = max(1, len(hist) // 5)
            rl_report = {
                "recall_at_10": {"before": before["recall"], "after": after["recall"]},
                "ndcg_at_10": {"before": before["ndcg"], "after": after["ndcg"]},
                "reward_at_10": {"before": before["reward"], "after": after["reward"]},
                "train_reward_first": float(np.mean([h["reward"] for h in hist[:window]])),
                "train_reward_last": float(np.mean([h["reward"] for h in hist[-window:]]))}
    for name in ("oxygenrec_no_igr", "oxygenrec_no_q2i"):
        if name in systems:
            results[name] = evaluate(*generative(name, name))
    if "oxygenrec_per_scenario" in systems:  # one model per scenario, equal total steps
        items = np.full((len(test), config.beam_size), -1, np.int32)
        steps = max(1, config.sft.steps // len(data.scenarios))
        for s, name in enumerate(data.scenarios):
            train_s, rows = data.train.of_scenario(s), np.flatnonzero(test.scenario == s)
            if len(train_s) == 0 or len(rows) == 0:
                continue
            system, state = generative(f"per_scenario_{name}", "oxygenrec", requests=train_s,
                                       steps=steps)
            items[rows] = system.recommend(state, test.take(rows))
        results["oxygenrec_per_scenario"] = score(items, data, test, config)
    for name in config.systems:
        r = results[name]
        run.info(f"  {name:24s} recall@{config.k} {r['recall']:.4f}  ndcg@{config.k} "
                 f"{r['ndcg']:.4f}  " + "  ".join(f"{s} {v['recall']:.3f}"
                                                  for s, v in r["per_scenario"].items()))
    return results, sid_report, rl_report


class SeedCell(NamedTuple):
    """One seed of the study as a :func:`jaxflow.study.run_cells` cell (``label`` "seed<s>")."""

    label: str
    seed: int


def seed_cells(config) -> list[SeedCell]:
    """The cells of seeds ``config.seed .. config.seed + config.seeds - 1``."""
    return [SeedCell(f"seed{s}", s) for s in range(config.seed, config.seed + config.seeds)]


def seed_record(config, seed: int, run) -> dict:
    """:func:`run_seed` as a JSON-able cell record: ``{"label", "seed", "systems" (score per
    system), "semantic_ids", "rl"}``."""
    results, sid_report, rl_report = run_seed(config, seed, run)
    return {"label": f"seed{seed}", "seed": seed, "systems": results, "semantic_ids": sid_report,
            "rl": rl_report}


def _mean_std(values):
    return float(np.mean(values)), float(np.std(values))


def summarize_seeds(config, records: list[dict]) -> dict:
    """The experiment's summary from the :func:`seed_record` of every seed: per system the
    mean (and ``*_std``) over seeds of recall / ndcg / reward at k, ``per_scenario`` means,
    ``test_requests_per_scenario``, the semantic-ID reports, the RL before / after means and
    the per-seed recall / ndcg."""
    per_seed = [(r["systems"], r["semantic_ids"], r["rl"]) for r in records]
    systems = config.systems
    summary = {"data": load_source(config), "seeds": config.seeds}
    for metric, key in (("recall", f"recall_at_{config.k}"), ("ndcg", f"ndcg_at_{config.k}"),
                        ("reward", f"reward_at_{config.k}")):
        stats = {s: _mean_std([r[s][metric] for r, _, _ in per_seed]) for s in systems}
        summary[key] = {s: v[0] for s, v in stats.items()}
        summary[f"{key}_std"] = {s: v[1] for s, v in stats.items()}
    scenarios = list(per_seed[0][0][systems[0]]["per_scenario"])
    summary["per_scenario"] = {
        f"{metric}_at_{config.k}": {
            s: {sc: float(np.mean([r[s]["per_scenario"][sc][metric] for r, _, _ in per_seed
                                   if sc in r[s]["per_scenario"]])) for sc in scenarios}
            for s in systems}
        for metric in ("recall", "ndcg")}
    summary["test_requests_per_scenario"] = {
        sc: per_seed[0][0][systems[0]]["per_scenario"][sc]["n"] for sc in scenarios}
    summary["semantic_ids"] = per_seed[0][1]
    summary["semantic_ids_per_seed"] = [
        {k: r[1][k] for k in ("dedup_levels", "largest_prefix_group", "collision_rate")}
        for r in per_seed]
    if per_seed[0][2]:
        summary["rl"] = {k: ({kk: float(np.mean([p[2][k][kk] for p in per_seed])) for kk in v}
                             if isinstance(v, dict) else float(np.mean([p[2][k] for p in per_seed])))
                         for k, v in per_seed[0][2].items()}
    summary["per_seed"] = [{s: {"recall": r[s]["recall"], "ndcg": r[s]["ndcg"]} for s in systems}
                           for r, _, _ in per_seed]
    return summary
