"""bench_sync_codec: bytes on the wire and throughput of every sync codec on synthetic trees.

Per target changed fraction (``densities``), a bf16 tree of transformer shapes after one
Adam-like step is encoded and applied by every codec, the trainer's ``SyncSender`` (host and
device paths) and the PULSE-style baseline, alternated round by round after a warm-up; also a
plain memory copy of the tree. The tree, the timing rounds and what each figure means are
``jaxflow.bench.sync_codec``; this driver runs the densities and writes the summary.
"""

from __future__ import annotations

import numpy as np

from jaxflow.bench.sync_codec import (
    BF16,
    HEADLINE_DENSITY,
    SENDERS,
    adam_step_bf16,
    calibrate_lr,
    master_weights,
    measure,
    median,
    paired,
    tight_pairs,
    transformer_shapes,
)
from jaxflow.experiment import RunContext
from jaxflow.sync.bound import entropy_bound_bytes
from jaxflow.sync.diff import diff_tree

__all__ = ["main"]


def main(config, run: RunContext) -> dict:
    """Per density: the tree, its entropy bound and every codec measured; the headline summary."""
    rng = np.random.default_rng(config.seed)
    shapes = transformer_shapes(config.d_model, config.n_layers, config.vocab)
    weights, directions = master_weights(shapes, rng)
    old = {k: w.astype(BF16) for k, w in weights.items()}
    n_elems = sum(w.size for w in weights.values())
    dense_bytes = 2 * n_elems
    run.info(f"tree: {len(shapes)} tensors, {n_elems / 1e6:.1f}M bf16 elements")
    codecs = tuple(config.codecs) + tuple(SENDERS) + ("pulse",)
    run.set_total_steps(len(config.densities), "densities")
    memcpy_times: list[float] = []
    by_density, headline = [], None
    for step, density in enumerate(config.densities):
        lr = calibrate_lr(weights, directions, density)
        new = adam_step_bf16(weights, directions, lr)
        _, specs, diffs = diff_tree(old, new)
        changed = sum(d.count for d in diffs) / n_elems
        bound = entropy_bound_bytes(specs, diffs)
        del diffs
        is_headline = abs(density - HEADLINE_DENSITY) < 1e-12
        rounds = config.timing_rounds if is_headline else config.timing_rounds_other
        # the sender paths (and their compiles) only at the headline density
        results = measure(old, new, codecs if is_headline else tuple(
            c for c in codecs if c not in SENDERS), rounds, config,
            memcpy_times if is_headline else None)
        for codec, res in results.items():
            row = {"density": density, "codec": codec, "changed_fraction": changed,
                   "bytes": res["bytes"], "ratio_vs_dense": dense_bytes / res["bytes"],
                   "bytes_over_entropy_bound": res["bytes"] / bound,
                   "encode_gbps": res["encode_gbps"], "apply_gbps": res["apply_gbps"],
                   "bit_exact": res["bit_exact"], "lr": lr}
            by_density.append(row)
        if is_headline:
            headline = results
            tight = tight_pairs(old, new, config.tight_rounds) if config.tight_rounds else None
            headline_bound, headline_changed = bound, changed
        smallest = min(r["bytes"] for r in results.values())
        run.log(step + 1, {"density": density, "changed_fraction": changed,
                           "best_ratio_vs_dense": dense_bytes / smallest, "bound_bytes": bound})
        del new
    if headline is None:
        raise ValueError(f"densities {config.densities} must include {HEADLINE_DENSITY}")
    memcpy_gbps = 2 * n_elems / median(memcpy_times) / 1e9

    def per_codec(fn):
        return {c: fn(r) for c, r in headline.items()}

    summary = {
        "memcpy_gbps": memcpy_gbps,
        "encode_gbps": per_codec(lambda r: r["encode_gbps"]),
        "apply_gbps": per_codec(lambda r: r["apply_gbps"]),
        "ratio_vs_dense": per_codec(lambda r: dense_bytes / r["bytes"]),
        "bytes_over_entropy_bound": per_codec(lambda r: r["bytes"] / headline_bound),
        "by_density": by_density,
        "encode_fraction_of_memcpy": per_codec(lambda r: r["encode_gbps"] / memcpy_gbps),
        "apply_fraction_of_memcpy": per_codec(lambda r: r["apply_gbps"] / memcpy_gbps),
        "bit_exact": all(row["bit_exact"] for row in by_density),
        "num_elements": n_elems,
        "dense_bytes": dense_bytes,
        "entropy_bound_bytes": headline_bound,
        "changed_fraction": headline_changed,
        "timing_rounds": config.timing_rounds,
    }
    # Paired per round: pulse time / auto time. The trainer's sender carries its base digest
    # from publish to publish; the stateless ``encode`` digests the base tree on every call.
    summary["encode_speedup_auto_vs_pulse"] = paired(headline, "auto_sender")
    summary["encode_speedup_auto_device_vs_pulse"] = paired(headline, "auto_device")
    if "auto" in headline:
        summary["encode_speedup_auto_stateless_vs_pulse"] = paired(headline, "auto")
    summary["encode_tight_auto_vs_pulse"] = tight
    summary["paths"] = {
        path: {"encode_gbps": headline[c]["encode_gbps"], "apply_gbps": headline[c]["apply_gbps"],
               "encode_ms": 1e3 * median(headline[c]["encode_s"]),
               "apply_ms": 1e3 * median(headline[c]["apply_s"]),
               "host_bytes_per_publish": headline[c]["host_bytes"],
               "host_bytes_over_dense_bf16": headline[c]["host_bytes"] / dense_bytes}
        for c, path in SENDERS.items()}
    return summary
