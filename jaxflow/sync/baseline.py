"""PULSE-style baseline codec, as a competent user of that system would run it.

Per tensor: positions of changed bf16 bit patterns (numpy compare + flatnonzero), gaps in
uint16 when they fit else uint32, new values as raw bf16, both compressed with zstd level 1.
Used by the bench_sync_codec experiment next to jaxflow's codecs; not part of the sync API.
"""

from __future__ import annotations

import struct

import numpy as np

from jaxflow.sync.entropy import zstandard_module

_HEAD = struct.Struct("<IQB")  # tensor id, change count, gap itemsize


def pulse_encode(old_leaves: list[np.ndarray], new_leaves: list[np.ndarray]) -> bytes:
    """Encodes bf16 leaves (uint16 bit views, flat) into one byte string."""
    compressor = zstandard_module().ZstdCompressor(level=1)
    parts = []
    for t, (old, new) in enumerate(zip(old_leaves, new_leaves)):
        idx = np.flatnonzero(old != new)
        if idx.size == 0:
            continue
        gaps = np.diff(idx, prepend=0)
        dtype = np.uint16 if gaps.max() < (1 << 16) else np.uint32
        blob = compressor.compress(gaps.astype(dtype).tobytes() + new[idx].tobytes())
        parts.append(_HEAD.pack(t, idx.size, np.dtype(dtype).itemsize))
        parts.append(struct.pack("<Q", len(blob)))
        parts.append(blob)
    return b"".join(parts)


def pulse_apply(data: bytes, leaves: list[np.ndarray]) -> list[np.ndarray]:
    """Applies ``pulse_encode`` output to copies of uint16 leaves."""
    out = list(leaves)
    decompressor = zstandard_module().ZstdDecompressor()
    offset = 0
    while offset < len(data):
        t, count, itemsize = _HEAD.unpack_from(data, offset)
        offset += _HEAD.size
        (length,) = struct.unpack_from("<Q", data, offset)
        offset += 8
        raw = decompressor.decompress(data[offset: offset + length])
        offset += length
        gaps = np.frombuffer(raw, np.dtype(f"<u{itemsize}"), count=count)
        values = np.frombuffer(raw, np.uint16, count=count, offset=count * itemsize)
        target = np.array(out[t], copy=True)
        target[np.cumsum(gaps, dtype=np.int64)] = values
        out[t] = target
    return out
