"""Headline builders of the benchmarks (``HEADLINES`` of ``configs/bench_*.py`` and
``kernel_footprints``): each reads the benchmark's summary and returns its
:class:`jaxflow.study.Headline` list. Timings are alternated pairs or rounds in one process, so
each speed-up names its strongest baseline and the range over the pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxflow.study.headline import Headline, headline_from_arms, headline_from_ratios, range_spread

__all__ = ["bench_rollout", "bench_embedding", "bench_checkpoint", "bench_kernels", "bench_packing",
           "bench_policy_loss", "bench_sparsegpt", "bench_sync_codec", "kernel_footprints", "driver_headlines"]


def bench_rollout(summary: Mapping[str, Any]) -> list[Headline]:
    """Per model and length case (equal, long-tailed, GRPO): the engine's useful tokens/s over
    the strongest other sampler measured in the run (the static sampler and any other arm),
    the range over the alternated pairs; the case's target ratio."""
    out = []
    for model, m in summary["models"].items():
        for case, c in m["cases"].items():
            tps = c["tokens_per_second"]
            rounds = {a: [1.0 / s for s in secs] for a, secs in (c.get("seconds") or {}).items()}
            target = c.get("target_ratio")
            out.append(headline_from_arms(
                f"{model}/{case}_tokens_per_s_vs_strongest", "useful tokens/s ratio (median of pairs)",
                "paged rollout engine", tps, arm="engine", baselines=[a for a in tps if a != "engine"],
                rounds=rounds or None, rounds_kind="pairs", target=target,
                target_text=f">= {target}x the strongest sampler" if target is not None else ""))
    return out


def bench_embedding(summary: Mapping[str, Any]) -> list[Headline]:
    """The sharded embedding step's speed-up over the fastest jnp.take baseline measured
    (dense / sparse ...), the range over the alternated pairs."""
    return [headline_from_ratios("step_speedup_vs_strongest", "lookup + update step speed-up",
                                 "jaxflow sharded embedding", summary["ratios"])]


def bench_checkpoint(summary: Mapping[str, Any]) -> list[Headline]:
    """The forward pass vs transformers, MoE all-to-all dispatch vs dense, and the load's
    peak RSS growth over the tensor bytes (target <= its ``target_ratio``)."""
    fw, mo, ld = summary["forward"], summary["moe"], summary["load"]
    out = [headline_from_ratios("forward_speedup_vs_transformers", "forward speed-up (median of pairs)",
                                "jaxflow forward", {"transformers": {
                                    "median": fw["speedup_jaxflow_over_transformers"], "pairs": fw["pairs"]}}),
           headline_from_ratios("moe_all_to_all_vs_dense", "MoE layer speed-up (median of pairs)",
                                "all-to-all expert dispatch", {"dense experts": {
                                    "median": mo["speedup_all_to_all_over_dense"], "pairs": mo["pairs"]}})]
    target = ld.get("target_ratio")
    out.append(headline_from_arms(
        "load_peak_rss_growth", "peak RSS growth / tensor bytes", "jaxflow checkpoint load",
        {"load": ld["peak_rss_growth_ratio"]}, arm="load", baselines=(), compare="value",
        higher_is_better=False, unit="x tensor bytes", target=target,
        target_text=f"<= {target}x the tensor bytes" if target is not None else ""))
    return out


def bench_kernels(summary: Mapping[str, Any]) -> list[Headline]:
    """The fraction of the Pallas kernels / attention backends that ran and agree with their
    XLA reference within tolerance (target: all)."""
    rows = [r for r in summary["rows"] if r.get("within_tolerance") is not None]
    share = sum(bool(r["within_tolerance"]) for r in rows) / len(rows) if rows else 0.0
    return [headline_from_arms("within_tolerance_fraction", f"kernels within tolerance of the reference "
                               f"({len(rows)} checked)", "pallas kernels", {"kernels": share}, arm="kernels",
                               baselines=(), compare="value", unit="fraction", target=1.0,
                               target_text="every checked kernel within tolerance")]


def bench_packing(summary: Mapping[str, Any]) -> list[Headline]:
    """Per length distribution at its largest batch: the padding waste of FlowTrain's packer
    (lpt + length refinement) against the strongest other algorithm (padded included):
    ``baseline - lpt+refine`` (> 0: less waste)."""
    waste = summary["padding_waste"]
    largest: dict[str, str] = {}
    for key in waste:
        dist, _, b = key.rpartition("_b")
        if dist not in largest or int(b) > int(largest[dist].rpartition("_b")[2]):
            largest[dist] = key
    out = []
    for key in largest.values():
        arms = waste[key]
        out.append(headline_from_arms(
            f"padding_waste_vs_strongest[{key}]", "padding waste difference (baseline - packer)",
            "lpt+refine", arms, baselines=[a for a in arms if a != "lpt+refine"], higher_is_better=False,
            compare="difference", unit="waste fraction"))
    return out


def bench_policy_loss(summary: Mapping[str, Any]) -> list[Headline]:
    """SIS's step time over no correction (the median of alternated pairs and their range;
    target <= ``target_sis_overhead_ratio``) and the fused log-prob's bytes over the naive
    one's (target <= ``target_fused_to_naive_bytes_ratio``) when measured."""
    target = summary.get("target_sis_overhead_ratio")
    h = headline_from_arms("sis_overhead", "policy-loss step time, SIS / none (median of pairs)", "sis",
                           {"sis": summary["sis_overhead_ratio"]}, baselines=(), compare="value",
                           higher_is_better=False, unit="x", target=target,
                           target_text=f"<= {target}x the uncorrected step" if target else "")
    out = [dataclasses.replace(h, spread=range_spread(summary.get("sis_overhead_ratios") or (), kind="pairs"))]
    if "fused_to_naive_bytes_ratio" in summary:
        target = summary.get("target_fused_to_naive_bytes_ratio")
        out.append(headline_from_arms(
            "fused_logprob_bytes", "step bytes, fused / naive log-prob", "fused log-prob",
            {"fused": summary["fused_to_naive_bytes_ratio"]}, arm="fused", baselines=(), compare="value",
            higher_is_better=False, unit="x", target=target,
            target_text=f"<= {target}x the naive bytes" if target else ""))
    return out


def bench_sparsegpt(summary: Mapping[str, Any]) -> list[Headline]:
    """jaxflow's SparseGPT per-layer time vs llmcompressor's (torch): the median over cells of
    each cell's median pair ratio."""
    return [headline_from_ratios("speedup_vs_llmcompressor", "per-layer pruning speed-up (median of cells)",
                                 "jaxflow sparsegpt", {"llmcompressor (torch)": {
                                     "median": summary["speedup_vs_torch"], "pairs": summary.get("pairs")}})]


def bench_sync_codec(summary: Mapping[str, Any]) -> list[Headline]:
    """The auto codec: bytes over the entropy bound (target <= 1.3), the ratio vs dense bf16
    (target >= 100x) and its encode speed-up over the PULSE-style baseline (target >= 1.0x)."""
    out = []
    if "auto" in summary["bytes_over_entropy_bound"]:
        out.append(headline_from_arms(
            "auto_bytes_over_entropy_bound", "encoded bytes / entropy bound", "SparseRL-Sync auto",
            {"auto": summary["bytes_over_entropy_bound"]["auto"]}, arm="auto", baselines=(), compare="value",
            higher_is_better=False, unit="x bound", target=1.3, target_text="<= 1.3x the entropy bound"))
        out.append(headline_from_arms(
            "auto_bytes_vs_dense", "bytes ratio (dense bf16 / auto)", "SparseRL-Sync auto",
            {"auto": 1.0 / summary["ratio_vs_dense"]["auto"], "dense bf16": 1.0}, arm="auto",
            baselines=("dense bf16",), higher_is_better=False, target=100.0, target_text=">= 100x dense bf16"))
    if summary.get("encode_speedup_auto_vs_pulse"):
        out.append(headline_from_ratios("encode_speedup_vs_pulse", "encode speed-up (median of pairs)",
                                        "SparseRL-Sync auto sender", {"pulse": summary["encode_speedup_auto_vs_pulse"]},
                                        target=1.0, target_text=">= 1.0x PULSE"))
    return out


def kernel_footprints(summary: Mapping[str, Any]) -> list[Headline]:
    """The fraction of the kernel x chip cases that fit and compile (target: all of them)."""
    fit = summary["cases"] - summary["does_not_fit"]
    share = summary["compiled"] / fit if fit else 0.0
    return [headline_from_arms("compiled_fraction", f"kernel x chip cases that compile ({fit} that fit)",
                               "pallas kernels", {"kernels": share}, arm="kernels", baselines=(),
                               compare="value", unit="fraction", target=1.0, target_text="every fitting case")]


def driver_headlines(summary: Mapping[str, Any]) -> list[Headline]:
    """The headlines a driver computed itself (``summary["headlines"]``, contract dicts, e.g.
    ``bench_peers``' per-case jaxflow vs the strongest peer), checked and re-read as
    :class:`Headline` objects so the runner writes them in the same shape as every builder's."""
    return [Headline.from_json(d) for d in summary["headlines"]]
