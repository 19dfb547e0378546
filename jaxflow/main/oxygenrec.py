"""The ``oxygenrec`` experiment: OxygenREC vs TIGER-style (with and without the instruction),
SASRec-style and popularity, with ablations, Recall@K / NDCG@K per scenario over the full item
set, several seeds.

Per seed: data (synthetic, or MovieLens from ``data.path``) -> RQ-KMeans semantic IDs
(``model.levels`` k-means codes plus the de-duplication codes the catalogue needs, see
``jaxflow.genrec.semantic_ids``) and the item trie -> each system trained on the training
requests -> top-K for every test request (constrained beam search for the generative systems)
-> metrics. Training batches are sharded over a data-parallel mesh of all devices.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxflow.config import ConfigError
from jaxflow.experiment import RunContext
from jaxflow.genrec import rl as rl_lib
from jaxflow.genrec import train as train_lib
from jaxflow.genrec.data import movielens, synthetic
from jaxflow.genrec.data.requests import RecData
from jaxflow.genrec.metrics import popularity_ranking, recall_ndcg_at_k
from jaxflow.genrec.model import GenRecConfig
from jaxflow.genrec.sasrec import fit_sasrec, recommend_sasrec
from jaxflow.genrec.semantic_ids import rq_kmeans
from jaxflow.genrec.trie import build_trie


def load_data(config, seed: int) -> RecData:
    d = config.data
    if not d.path:
        return synthetic.generate(d.synthetic, seed=seed)
    try:
        return movielens.load_movielens(
            d.path, items_path=d.items_path or None, max_history=d.max_history,
            max_train_per_user=d.max_train_per_user, new_fraction=d.new_fraction,
            embeddings_path=d.embeddings_path or None, seed=seed)
    except (ValueError, OSError) as e:  # a user-given file: one-line CLI error
        raise ConfigError(f"data.path={d.path!r}: {e}") from None


def model_config(config, data: RecData, *, levels: int, instructions: bool,
                 igr: bool) -> GenRecConfig:
    """The GenRec of one system; ``levels`` is the semantic-ID length (k-means + dedup)."""
    m = config.model
    return GenRecConfig(levels=levels, width=m.width, instruction_vocab=data.instruction_vocab,
                        max_instruction=data.train.instruction.shape[1] if instructions else 0,
                        max_history=m.max_history, behaviours=len(data.behaviour_weights),
                        d_model=m.d_model, n_heads=m.n_heads, d_ff=m.d_ff,
                        encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers,
                        use_igr=igr)


def score(items: np.ndarray, data: RecData, requests, config) -> dict:
    """Recall / NDCG at k overall and per scenario, and the mean unified reward of the top k."""
    recall, ndcg = recall_ndcg_at_k(items, requests.target, config.k)
    reward = rl_lib.unified_reward(items[:, :config.k], requests, data, config.rl).mean(1)
    out = {"recall": float(recall.mean()), "ndcg": float(ndcg.mean()),
           "reward": float(reward.mean()), "per_scenario": {}}
    for s, name in enumerate(data.scenarios):
        m = requests.scenario == s
        if m.any():
            out["per_scenario"][name] = {"recall": float(recall[m].mean()),
                                         "ndcg": float(ndcg[m].mean()), "n": int(m.sum())}
    return out


def run_seed(config, seed: int, run: RunContext) -> tuple[dict, dict, dict]:
    """(metrics per system, semantic-ID report, RL report) of one seed."""
    data = load_data(config, seed)
    run.info(f"seed {seed}: {data.source}; {len(data.train)} train / {len(data.test)} test requests")
    m = config.model
    mesh = train_lib.data_mesh()
    try:  # items sharded over the data axis when there are several devices
        sid = rq_kmeans(data.item_features, levels=m.levels, width=m.width,
                        key=jax.random.key(seed), iters=m.kmeans_iters, dedup=m.dedup,
                        mesh=mesh if mesh.size > 1 else None)
    except ValueError as e:
        raise ConfigError(f"semantic IDs (model.levels={m.levels}, model.width={m.width}, "
                          f"model.dedup={m.dedup}): {e}") from None
    trie = build_trie(sid.codes, m.width)
    sid_report = {"reconstruction_error": list(sid.reconstruction_error),
                  "utilisation": list(sid.utilisation), "collision_rate": sid.collision_rate,
                  "kmeans_levels": sid.kmeans_levels, "dedup_levels": sid.dedup_levels,
                  "largest_prefix_group": sid.largest_prefix_group,
                  "trie_nodes": int(trie.children.shape[0])}
    run.info(f"  semantic IDs: {sid.kmeans_levels} k-means levels + {sid.dedup_levels} dedup "
             f"level(s) of width {m.width}; largest prefix group {sid.largest_prefix_group} "
             f"items, {100 * sid.collision_rate:.1f}% of items collide before resolution")
    test, results, rl_report = data.test, {}, {}
    systems = set(config.systems)
    step_log = [0]

    def log(step, metrics, prefix):
        step_log[0] += 1
        run.log(step_log[0], {f"{prefix}/{k}": v for k, v in metrics.items()})

    def generative(name, *, instructions, igr, q2i, requests=None, steps=None, test_reqs=None):
        mc = model_config(config, data, levels=sid.levels, instructions=instructions, igr=igr)
        sft = dataclasses.replace(config.sft, use_instruction=instructions,
                                  q2i_weight=config.sft.q2i_weight if q2i else 0.0,
                                  steps=steps or config.sft.steps)
        t0 = time.time()
        g, p, _ = train_lib.fit(data, sid.codes, mc, sft, seed=seed, requests=requests,
                                mesh=mesh, log=lambda s, x: log(s, x, name))
        run.info(f"  {name}: {sft.steps} SFT steps in {time.time() - t0:.1f}s")
        return g, p

    def top_items(g, p, reqs, instructions):
        inputs = train_lib.model_inputs(reqs, sid.codes, data.behaviour_weights,
                                        use_instruction=instructions)
        return train_lib.recommend(g, p, trie, inputs, beam_size=config.beam_size)

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
    if "tiger" in systems:
        g, p = generative("tiger", instructions=False, igr=False, q2i=False)
        results["tiger"] = score(top_items(g, p, test, False), data, test, config)
    if "tiger_instruction" in systems:  # the same TIGER model fed the instruction tokens
        g, p = generative("tiger_instruction", instructions=True, igr=False, q2i=False)
        results["tiger_instruction"] = score(top_items(g, p, test, True), data, test, config)
    if systems & {"oxygenrec", "oxygenrec_no_rl"}:
        g, p = generative("oxygenrec", instructions=True, igr=True, q2i=True)
        before = score(top_items(g, p, test, True), data, test, config)
        if "oxygenrec_no_rl" in systems:
            results["oxygenrec_no_rl"] = before
        if "oxygenrec" in systems:
            t0 = time.time()
            p, hist = rl_lib.rl_stage(g, p, trie, data, sid.codes, config.rl, seed=seed,
                                      mesh=mesh, log=lambda s, x: log(s, x, "oxygenrec_rl"))
            run.info(f"  oxygenrec: {config.rl.steps} SA-GCPO steps in {time.time() - t0:.1f}s")
            after = score(top_items(g, p, test, True), data, test, config)
            results["oxygenrec"] = after
            window = max(1, len(hist) // 5)
            rl_report = {
                "recall_at_10": {"before": before["recall"], "after": after["recall"]},
                "ndcg_at_10": {"before": before["ndcg"], "after": after["ndcg"]},
                "reward_at_10": {"before": before["reward"], "after": after["reward"]},
                "train_reward_first": float(np.mean([h["reward"] for h in hist[:window]])),
                "train_reward_last": float(np.mean([h["reward"] for h in hist[-window:]]))}
    if "oxygenrec_no_igr" in systems:
        g, p = generative("oxygenrec_no_igr", instructions=True, igr=False, q2i=True)
        results["oxygenrec_no_igr"] = score(top_items(g, p, test, True), data, test, config)
    if "oxygenrec_no_q2i" in systems:
        g, p = generative("oxygenrec_no_q2i", instructions=True, igr=True, q2i=False)
        results["oxygenrec_no_q2i"] = score(top_items(g, p, test, True), data, test, config)
    if "oxygenrec_per_scenario" in systems:  # one model per scenario, equal total steps
        items = np.full((len(test), config.beam_size), -1, np.int32)
        steps = max(1, config.sft.steps // len(data.scenarios))
        for s, name in enumerate(data.scenarios):
            train_s, rows = data.train.of_scenario(s), np.flatnonzero(test.scenario == s)
            if len(train_s) == 0 or len(rows) == 0:
                continue
            g, p = generative(f"per_scenario_{name}", instructions=True, igr=True, q2i=True,
                              requests=train_s, steps=steps)
            items[rows] = top_items(g, p, test.take(rows), True)
        results["oxygenrec_per_scenario"] = score(items, data, test, config)
    for name in config.systems:
        r = results[name]
        run.info(f"  {name:24s} recall@{config.k} {r['recall']:.4f}  ndcg@{config.k} "
                 f"{r['ndcg']:.4f}  " + "  ".join(f"{s} {v['recall']:.3f}"
                                                  for s, v in r["per_scenario"].items()))
    return results, sid_report, rl_report


def _mean_std(values):
    return float(np.mean(values)), float(np.std(values))


def main(config, run: RunContext) -> dict:
    per_seed = []
    for i in range(config.seeds):
        per_seed.append(run_seed(config, config.seed + i, run))
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


def load_source(config) -> str:
    """``synthetic`` or ``movielens:<ratings>`` plus ``items:<file>`` (given or found beside
    the ratings) or ``items:none`` (co-occurrence embeddings)."""
    d = config.data
    if not d.path:
        return "synthetic"
    items = d.items_path or movielens.find_items_file(d.path)
    return f"movielens:{d.path} items:{items or 'none'}"
