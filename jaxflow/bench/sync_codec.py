"""The ``bench_sync_codec`` measurement: bytes on the wire and throughput of every sync codec on
synthetic trees.

A tree is made as a real optimizer makes it: fp32 master weights of transformer shapes and
scales, one Adam-like step (update directions of magnitude <= 1, like Adam's normalised step)
with the learning rate bisected to hit each target changed fraction, cast to bf16 before and
after. Per density and codec: ``len(to_bytes())``, ratio vs dense, bytes over the entropy bound,
encode (encode + to_bytes) and apply (from_bytes + apply) throughput in bf16 parameter bytes
per second, bit-exactness. In the same run: a plain memory copy of the tree and the PULSE-style
baseline (baseline.py). Timings alternate all codecs round by round after a warm-up and report
medians.

Both sync paths of the trainer's ``SyncSender`` at codec ``auto`` run in the same rounds:
``auto_sender`` (host numpy path; the base digest carried from the previous publish, as a
sender holds it) and ``auto_device`` (the device path: cast, diff and compaction on the
default device, only the changes cross to the host; its replica applies on the device), with
the bytes each publish moves device -> host. ``auto`` is the stateless ``encode``, which
digests the base tree on every call.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxflow.sync import Payload, SyncSender, apply, baseline, bits, encode

__all__ = ["BF16", "HEADLINE_DENSITY", "SENDERS", "adam_step_bf16", "calibrate_lr", "master_weights", "measure",
           "median", "paired", "tight_pairs", "transformer_shapes"]

HEADLINE_DENSITY = 0.006
BF16 = ml_dtypes.bfloat16


def transformer_shapes(d_model: int, n_layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a decoder with ``n_layers`` blocks (qkv, out, up [d, 4d], down,
    two norms each), an embedding [vocab, d_model] and a final norm."""
    shapes = {"embed": (vocab, d_model), "final_norm": (d_model,)}
    for layer in range(n_layers):
        p = f"layer{layer:02d}"
        shapes.update({f"{p}.attn_norm": (d_model,), f"{p}.qkv": (d_model, 3 * d_model),
                       f"{p}.out": (d_model, d_model), f"{p}.mlp_norm": (d_model,),
                       f"{p}.up": (d_model, 4 * d_model), f"{p}.down": (4 * d_model, d_model)})
    return shapes


def master_weights(shapes, rng) -> tuple[dict, dict]:
    """fp32 weights (norms ~1, matrices ~N(0, 1/fan_in) or 0.02) and Adam-like directions."""
    weights, directions = {}, {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
        else:
            std = 0.02 if name == "embed" else 1.0 / np.sqrt(shape[0])
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        weights[name] = w
        # Adam's step m / (sqrt(v) + eps) is bounded by ~1 and often near +-1.
        directions[name] = np.tanh(1.5 * rng.standard_normal(shape, dtype=np.float32))
    return weights, directions


def adam_step_bf16(weights, directions, lr: float) -> dict:
    """bf16(w - lr * direction) per tensor: the next version of the tree."""
    return {k: (w - np.float32(lr) * directions[k]).astype(BF16) for k, w in weights.items()}


def calibrate_lr(weights, directions, density: float, sample: int = 1 << 20) -> float:
    """Bisects (in log space) the learning rate whose step changes ``density`` of bf16 values."""
    total = sum(w.size for w in weights.values())
    ws, ds = [], []
    for k, w in weights.items():
        take = max(1, int(round(w.size * sample / total)))
        ws.append(w.reshape(-1)[:take])
        ds.append(directions[k].reshape(-1)[:take])
    w, d = np.concatenate(ws), np.concatenate(ds)
    base = w.astype(BF16).view(np.uint16)

    def changed(lr):
        return np.mean((w - np.float32(lr) * d).astype(BF16).view(np.uint16) != base)

    lo, hi = 1e-9, 1.0
    for _ in range(40):
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if changed(mid) < density else (lo, mid)
    return float(np.sqrt(lo * hi))


def median(xs) -> float:
    """The median of ``xs`` as a float."""
    return float(np.median(np.asarray(xs)))


def _bit_equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(bits.as_bits(np.asarray(a[k])), bits.as_bits(np.asarray(b[k])))
               for k in b)


# Beside the stateless codecs: the trainer's own sender at codec "auto", on the host numpy
# path and on the device path (jax arrays on the default device; XLA compaction on the CPU).
SENDERS = {"auto_sender": "host", "auto_device": "device"}


def measure(old, new, codecs, rounds, config, memcpy_times=None):
    """Alternates every codec (and the memcpy) round by round, the order rotated each round,
    a round's encodes back to back and then its applies; returns per-codec results.

    Even rounds encode old -> new, odd rounds new -> old (the same changes reversed), so the
    senders -- one each, kept across rounds as a trainer keeps it, its base digest carried
    from publish to publish -- publish a real next version every round."""
    nbytes = sum(v.nbytes for v in new.values())
    trees = {"host": (old, new), "device": tuple(jax.tree.map(jnp.asarray, t)
                                                 for t in (old, new))}
    flat = [[bits.as_bits(t[k]) for k in sorted(t)] for t in (old, new)]
    senders = {c: SyncSender(trees[path][0], codec="auto", path=path, copy=False)
               for c, path in SENDERS.items() if c in codecs}  # copy=False: PULSE's arrays
    for sender in senders.values():
        sender.base_digest()  # carried from the previous publish in a trainer
    scratch = {k: np.empty_like(v) for k, v in new.items()} if memcpy_times is not None else None
    times = {c: {"encode": [], "apply": []} for c in codecs}
    wire, exact, host_bytes = {}, {}, {}
    for r in range(rounds + 1):  # round 0 is the warm-up
        a, b = (0, 1) if r % 2 == 0 else (1, 0)
        if scratch is not None:
            t0 = time.perf_counter()
            for k, v in new.items():
                np.copyto(scratch[k], v)
            if r:
                memcpy_times.append(time.perf_counter() - t0)
        # the order rotates round by round, so no codec always follows the same neighbour;
        # all encodes of a round run back to back, then all applies
        order = codecs[r % len(codecs):] + codecs[: r % len(codecs)]
        blobs, versions = {}, {}
        for codec in order:
            path = SENDERS.get(codec)
            base, target = trees[path or "host"][a], trees[path or "host"][b]
            t0 = time.perf_counter()
            if codec == "pulse":
                blob = baseline.pulse_encode(flat[a], flat[b])
            elif path:
                stats = senders[codec].publish(target, copy=False)
            else:
                blob = encode(base, target, base_version=0, version=1, codec=codec,
                              bucket_elems=config.bucket_elems,
                              zstd_level=config.zstd_level).to_bytes()
            t1 = time.perf_counter()
            if path:
                versions[codec] = senders[codec].version - 1
                blob = senders[codec].chain_from(versions[codec])[0]
                # the host path pulls every leaf whole when the params live on a device (the
                # bench hands it host arrays: counted as that pull, in the tree's dtype)
                host_bytes[codec] = stats.host_bytes if path == "device" else nbytes
            blobs[codec] = blob
            if r:
                times[codec]["encode"].append(t1 - t0)
        for codec in order:
            path = SENDERS.get(codec)
            base, blob = trees[path or "host"][a], blobs.pop(codec)
            t1 = time.perf_counter()
            if codec == "pulse":
                out_bits = baseline.pulse_apply(blob, flat[a])
            elif path == "device":  # the replica scatters on its devices
                out = apply(Payload.from_bytes(blob), base, version=versions[codec],
                            on_device=True)
                jax.block_until_ready(out)
            else:
                out = apply(Payload.from_bytes(blob), base, version=versions.get(codec, 0))
            t2 = time.perf_counter()
            if r:
                times[codec]["apply"].append(t2 - t1)
            else:
                wire[codec] = len(blob)
                if codec == "pulse":
                    exact[codec] = all(np.array_equal(x, y) for x, y in zip(out_bits, flat[b]))
                else:
                    exact[codec] = _bit_equal(out, new)
                if path:  # the senders make the stateless encoder's payload bytes
                    exact[codec] &= blob == encode(old, new, base_version=0, version=1,
                                                   codec="auto").to_bytes()
            del blob
    return {c: {"bytes": wire[c], "bit_exact": exact[c], "host_bytes": host_bytes.get(c),
                "encode_s": times[c]["encode"], "apply_s": times[c]["apply"],
                "encode_gbps": nbytes / median(times[c]["encode"]) / 1e9,
                "apply_gbps": nbytes / median(times[c]["apply"]) / 1e9} for c in codecs}


def tight_pairs(old, new, rounds: int) -> dict:
    """The host sender's publish and the PULSE encode alone, back to back (old -> new and
    new -> old alternately, nothing else in between) for ``rounds`` pairs: min and median
    milliseconds of each and the paired median of PULSE-time / sender-time."""
    flat = [[bits.as_bits(t[k]) for k in sorted(t)] for t in (old, new)]
    sender = SyncSender(old, codec="auto", path="host", copy=False)
    sender.base_digest()
    mine, theirs = [], []
    for r in range(rounds + 1):
        a, b = (0, 1) if r % 2 == 0 else (1, 0)
        t0 = time.perf_counter()
        sender.publish(new if b else old, copy=False)
        t1 = time.perf_counter()
        baseline.pulse_encode(flat[a], flat[b])
        t2 = time.perf_counter()
        if r:
            mine.append(t1 - t0)
            theirs.append(t2 - t1)
    mine, theirs = np.asarray(mine), np.asarray(theirs)
    return {"pairs": rounds, "sender_ms_min": 1e3 * mine.min(),
            "sender_ms_median": 1e3 * float(np.median(mine)),
            "pulse_ms_min": 1e3 * theirs.min(), "pulse_ms_median": 1e3 * float(np.median(theirs)),
            "speedup_median": float(np.median(theirs / mine)),
            "speedup_of_mins": float(theirs.min() / mine.min())}


def paired(headline, slow: str, fast: str = "pulse") -> dict:
    """Per round (run back to back): ``fast`` time / ``slow`` time, i.e. the speedup of
    ``slow``'s codec over ``fast``'s (>= 1: ``slow`` is at least as fast)."""
    ratios = np.asarray(headline[fast]["encode_s"]) / np.asarray(headline[slow]["encode_s"])
    return {"median": float(np.median(ratios)), "min": float(ratios.min()),
            "max": float(ratios.max()), "pairs": int(ratios.size)}
