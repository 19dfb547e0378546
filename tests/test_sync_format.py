"""Payload format v2: exact round trips of random trees for every codec, and every malformed
input rejected with PayloadError (message checked) before a parameter is touched."""

import hashlib
import json
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow import sync
from jaxflow.sync import payload as fmt
from jaxflow.sync.diff import tree_layout
from tests.test_sync_trees import adversarial_pair, tree_bits

CODECS = sync.CODECS
FLOAT_DTYPES = [np.dtype(d) for d in (
    ml_dtypes.bfloat16, np.float16, np.float32, np.float64, ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e3m4, ml_dtypes.float8_e4m3,
    ml_dtypes.float8_e8m0fnu, ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn,
    ml_dtypes.float4_e2m1fn)]
OTHER_DTYPES = [np.dtype(d) for d in (np.int32, np.uint8, np.bool_, np.complex64, np.int64)]
SHAPES = [(), (0,), (3, 0), (1,), (7,), (2, 3), (4, 1, 2), (33,)]
BF16 = np.dtype(ml_dtypes.bfloat16)


def _random_bits(rng, dtype, shape):
    """Random bit patterns of ``dtype`` (NaN payloads, infs, subnormals included); sub-byte
    and bool dtypes get valid codes only."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    width = ml_dtypes.finfo(dtype).bits if dtype in FLOAT_DTYPES else 8 * dtype.itemsize
    raw = rng.integers(0, 256, (int(np.prod(shape, dtype=np.int64)), dtype.itemsize),
                       dtype=np.uint8)
    if width < 8:
        raw &= np.uint8((1 << width) - 1)
    return raw.reshape(-1).view(dtype).reshape(shape)


def _leaf_pair(rng, dtype, shape):
    old = _random_bits(rng, dtype, shape)
    new = old.copy()
    if old.size and rng.random() < 0.8:  # change some (or all) elements
        k = int(rng.integers(1, old.size + 1))
        where = rng.choice(old.size, k, replace=False)
        new.reshape(-1)[where] = _random_bits(rng, dtype, (k,))
    return old, new


def random_tree_pair(seed: int, dtypes=None, depth: int = 3):
    """(old, new): a random nest of dicts / lists / tuples with 0-d, empty and n-d leaves of
    every float dtype (and a few others)."""
    rng = np.random.default_rng(seed)
    dtypes = dtypes or FLOAT_DTYPES + OTHER_DTYPES

    def node(level):
        if level == depth or rng.random() < 0.3:
            dtype = dtypes[int(rng.integers(len(dtypes)))]
            return _leaf_pair(rng, dtype, SHAPES[int(rng.integers(len(SHAPES)))])
        n = int(rng.integers(1, 4))
        kids = [node(level + 1) for _ in range(n)]
        kind = rng.integers(3)
        if kind == 0:
            return ({f"k{i}": k[0] for i, k in enumerate(kids)},
                    {f"k{i}": k[1] for i, k in enumerate(kids)})
        wrap = list if kind == 1 else tuple
        return wrap(k[0] for k in kids), wrap(k[1] for k in kids)

    old, new = {}, {}
    for i, dtype in enumerate(dtypes):  # every dtype at least once, 0-d and empty included
        old[f"d{i}"], new[f"d{i}"] = _leaf_pair(rng, dtype, SHAPES[i % len(SHAPES)])
    old["nest"], new["nest"] = node(0)
    old["nest0"], new["nest0"] = _leaf_pair(rng, BF16, ())
    return old, new


def assert_identical(out, expected):
    """Same tree structure, and per leaf the same shape, dtype and bit pattern."""
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(expected)
    for o, e in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        assert np.shape(o) == np.shape(e), (np.shape(o), np.shape(e))
        assert np.asarray(o).dtype == np.asarray(e).dtype
        assert np.asarray(o).tobytes() == np.asarray(e).tobytes()


@pytest.mark.parametrize("seed", range(6))
def test_random_numpy_trees_round_trip_exactly_for_every_codec(seed):
    old, new = random_tree_pair(seed)
    for codec in CODECS:
        wire = sync.encode(old, new, base_version=3, version=4, codec=codec,
                           bucket_elems=40).to_bytes()
        out = sync.apply(sync.Payload.from_bytes(wire), old, version=3)
        assert_identical(out, new)
    assert_identical(old, random_tree_pair(seed)[0])  # apply did not write into old


_JAX_DTYPES = [d for d in FLOAT_DTYPES if d.itemsize <= 4 and "float6" not in d.name] + [
    np.dtype(np.int32), np.dtype(np.bool_), np.dtype(np.complex64)]


def _to_jax(tree, mesh):
    def put(x):
        spec = P("x") if x.ndim and x.shape[0] % 8 == 0 else P()
        return jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    return jax.tree.map(put, tree)


@pytest.mark.parametrize("seed", range(2))
def test_random_jax_trees_round_trip_exactly_for_every_codec(seed):
    mesh = jax.make_mesh((8,), ("x",))
    old_np, new_np = random_tree_pair(100 + seed, dtypes=_JAX_DTYPES, depth=2)
    old_np["sharded"], new_np["sharded"] = _leaf_pair(np.random.default_rng(seed), BF16, (16, 3))
    old = _to_jax(old_np, mesh)
    for codec in CODECS:
        wire = sync.encode(old, _to_jax(new_np, mesh), base_version=0, version=1,
                           codec=codec).to_bytes()
        for on_device in (False, True):
            out = sync.apply(sync.Payload.from_bytes(wire), old, version=0, on_device=on_device)
            assert_identical(out, new_np)
            assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(out))
            assert out["sharded"].sharding == old["sharded"].sharding


@pytest.mark.parametrize("codec", CODECS)
def test_zero_d_and_empty_leaves_keep_their_shape(codec):
    old = {"s": np.array(1.5, BF16), "f": np.array(2.0, np.float32), "i": np.int32(3),
           "e": np.zeros((0,), BF16), "e2": np.zeros((2, 0), np.float32),
           "j": jnp.asarray(np.array(3.0, BF16)), "jf": jnp.float32(1.0)}
    new = {"s": np.array(-1.5, BF16), "f": np.array(-2.0, np.float32), "i": np.int32(4),
           "e": np.zeros((0,), BF16), "e2": np.zeros((2, 0), np.float32),
           "j": jnp.asarray(np.array(-3.0, BF16)), "jf": jnp.float32(-1.0)}
    payload = sync.Payload.from_bytes(sync.encode(old, new, base_version=0, version=1,
                                                  codec=codec).to_bytes())
    for on_device in (False, True):
        out = sync.apply(payload, old, version=0, on_device=on_device)
        assert {k: np.shape(v) for k, v in out.items()} == {
            "s": (), "f": (), "i": (), "e": (0,), "e2": (2, 0), "j": (), "jf": ()}
        assert_identical(out, new)
        assert isinstance(out["j"], jax.Array) and isinstance(out["jf"], jax.Array)


# -- malformed input ------------------------------------------------------------------------

def _setup():
    old, new = adversarial_pair()
    payload = sync.encode(old, new, base_version=7, version=8, codec="auto")
    receiver = adversarial_pair()[0]
    return payload, receiver, tree_bits(receiver)


def _reseal(header: dict | bytes, body: bytes, version_byte: int = fmt.FORMAT_VERSION) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob = fmt.PREFIX + bytes([version_byte]) + struct.pack("<I", len(head)) + head + body
    return blob + hashlib.blake2b(blob, digest_size=16).digest()


def _split(wire: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<I", wire, len(fmt.MAGIC))
    start = len(fmt.MAGIC) + 4
    return json.loads(wire[start: start + n]), wire[start + n: -16]


def _rejected(data, receiver, before, match, version=7):
    with pytest.raises(sync.PayloadError, match=match):
        payload = data if isinstance(data, sync.Payload) else sync.Payload.from_bytes(data)
        sync.apply(payload, receiver, version=version, inplace=True)
    assert tree_bits(receiver) == before


@pytest.mark.parametrize("data", [None, "JFSYNC", 17, [1, 2], np.zeros(40, np.uint8)])
def test_from_bytes_rejects_non_bytes(data):
    with pytest.raises(sync.PayloadError, match="payload must be bytes, bytearray or "
                                                f"memoryview, got {type(data).__name__}"):
        sync.Payload.from_bytes(data)


def test_from_bytes_accepts_memoryviews_and_bytearrays():
    payload, _, _ = _setup()
    wire = payload.to_bytes()
    assert sync.Payload.from_bytes(bytearray(wire)) == payload
    assert sync.Payload.from_bytes(memoryview(wire)) == payload
    assert sync.Payload.from_bytes(memoryview(np.frombuffer(wire, np.uint8))) == payload
    with pytest.raises(sync.PayloadError, match="not a contiguous byte buffer"):
        sync.Payload.from_bytes(memoryview(wire)[::2])


def test_deeply_nested_header_rejected_before_parsing():
    payload, receiver, before = _setup()
    header, body = _split(payload.to_bytes())
    deep = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _rejected(_reseal(deep, body), receiver, before, "header nests at least 100001 deep; "
                                                      "the format allows 4")
    header["sections"][0]["meta"]["count"] = [[[0]]]  # depth 7 in an otherwise valid header
    _rejected(_reseal(header, body), receiver, before, "header nests at least 7 deep")


def test_json_depth_ignores_brackets_and_escaped_quotes_in_strings():
    for text in ['{"a": "[[[{{"}', '["\\"[[[", []]', '{"k\\\\": [["\\\\\\"]]"]]}',
                 '"no brackets"', '[[[1], [2, [3]]]]', '{}']:
        expected = _depth_by_parsing(json.loads(text))
        assert fmt.json_depth(text.encode()) == expected, text


def _depth_by_parsing(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth_by_parsing(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth_by_parsing(v) for v in value), default=0)
    return 0


def test_oversized_header_length_rejected():
    payload, receiver, before = _setup()
    wire = bytearray(payload.to_bytes())
    struct.pack_into("<I", wire, len(fmt.MAGIC), fmt.MAX_HEADER_BYTES + 1)
    blob = bytes(wire[:-16])
    _rejected(blob + hashlib.blake2b(blob, digest_size=16).digest(), receiver, before,
              f"header length {fmt.MAX_HEADER_BYTES + 1} exceeds MAX_HEADER_BYTES")


def test_format_version_byte_checked():
    payload, receiver, before = _setup()
    wire = payload.to_bytes()
    assert wire[: len(fmt.MAGIC)] == b"JFSYNC\x00\x02" and fmt.FORMAT_VERSION == 2
    header, body = _split(wire)
    _rejected(_reseal(header, body, version_byte=1), receiver, before,
              "payload format version 1 is not supported; this reader reads version 2")
    _rejected(b"JFSYNC\x01\x02" + wire[8:], receiver, before, "bad magic")


@pytest.mark.parametrize("base,version", [(7, 7), (7, 6), (-2, 8)])
def test_target_version_must_exceed_base(base, version):
    payload, receiver, before = _setup()
    header, body = _split(payload.to_bytes())
    header.update(base_version=base, version=version)
    match = (f"target version {version} must exceed base version {base}" if base >= -1
             else f"base_version {base} invalid")
    _rejected(_reseal(header, body), receiver, before, match, version=base)
    replica = sync.Replica(adversarial_pair()[0], version=7)
    with pytest.raises(sync.PayloadError, match=match):
        replica.receive(_reseal(header, body))
    assert replica.version == 7 and tree_bits(replica.params) == before
    with pytest.raises(sync.PayloadError, match=match):  # a Payload built in code, too
        sync.apply(sync.Payload(**{**payload.__dict__, "base_version": base,
                                   "version": version}), receiver, version=base)
    with pytest.raises(ValueError, match=f"version {version} must exceed base_version {base}"):
        sync.encode(*adversarial_pair(), base_version=base, version=version)


@pytest.mark.parametrize("field,value,match", [
    ("version", "8", "version must be an int, got '8'"),
    ("base_version", True, "base_version must be an int, got True"),
    ("base_digest", 5, "base_digest 5 invalid"),
    ("base_digest", "ab", "base_digest 'ab' invalid"),
    ("codec", "zip", "unknown codec 'zip'"),
    ("treedef", ["x"], "treedef must be a str"),
    ("leaves", {"a": 1}, "header leaves must be a list, got dict"),
    ("sections", None, "header sections must be a list, got NoneType"),
    ("extra", 1, "header keys .* invalid"),
])
def test_header_field_types_checked(field, value, match):
    payload, receiver, before = _setup()
    header, body = _split(payload.to_bytes())
    header[field] = value
    _rejected(_reseal(header, body), receiver, before, match)


@pytest.mark.parametrize("mutate,match", [
    (lambda h: h["leaves"][0].__setitem__(1, "floaty"), "dtype 'floaty' is not a numpy dtype"),
    (lambda h: h["leaves"][0].__setitem__(2, [-1]), r"dim -1 invalid"),
    (lambda h: h["leaves"][0].__setitem__(2, [2**62, 4]), "elements exceed"),
    (lambda h: h["leaves"].__setitem__(0, ["a", "int32"]), "need \\[name, dtype, shape\\]"),
    (lambda h: h["sections"][0].__setitem__("leaves", []), "section leaf ids \\(\\) invalid"),
    (lambda h: h["sections"][0].__setitem__("kind", "zip"), "unknown section kind 'zip'"),
    (lambda h: h["sections"][0]["meta"].__setitem__("count", 1.5), "meta must map names to "
                                                                   "ints"),
    (lambda h: h["sections"][0].pop("meta"), "section keys"),
])
def test_header_entries_checked(mutate, match):
    payload, receiver, before = _setup()
    header, body = _split(payload.to_bytes())
    mutate(header)
    _rejected(_reseal(header, body), receiver, before, match)


def test_non_json_constants_and_bad_utf8_rejected():
    payload, receiver, before = _setup()
    header, body = _split(payload.to_bytes())
    text = json.dumps(header).replace('"version": 8', '"version": NaN').encode()
    _rejected(_reseal(text, body), receiver, before, "non-JSON constant NaN")
    _rejected(_reseal(b'{"\xff": 1}', body), receiver, before, "not valid JSON")


def test_apply_rejects_non_payloads_and_bad_versions():
    _, receiver, before = _setup()
    for bad in (None, b"JFSYNC", {"version": 8}):
        with pytest.raises(sync.PayloadError, match="expected a Payload, got"):
            sync.apply(bad, receiver, version=7)
    payload, _, _ = _setup()
    with pytest.raises(sync.PayloadError, match="version must be an int, got '7'"):
        sync.apply(payload, receiver, version="7")
    assert tree_bits(receiver) == before


def _flip_every_bit(x):
    a = np.asarray(x)
    return (a.reshape(-1).view(np.uint8) ^ np.uint8(0xFF)).view(a.dtype).reshape(a.shape)


def test_largest_encoder_outputs_fit_max_payload_bytes():
    old, _ = adversarial_pair()
    new = jax.tree.map(_flip_every_bit, old)  # every element changed: the largest deltas
    treedef, _, specs = tree_layout(old)
    bound = fmt.max_payload_bytes(treedef, specs)
    dense = sync.encode(old, new, base_version=0, version=1, codec="dense").num_bytes
    sizes = {c: sync.encode(old, new, base_version=0, version=1, codec=c,
                            bucket_elems=b).num_bytes for c in CODECS for b in (1, 1 << 26)}
    assert max(sizes.values()) <= bound < 4 * dense


def _random_value(rnd, depth=0):
    choices = [0, 1, -1, 2**31, 2**64, -(2**70), 1.5, "x", "", "bfloat16", None, True, [],
               {}, [0], {"count": 0}]
    if depth < 2 and rnd.random() < 0.2:
        return [_random_value(rnd, depth + 1) for _ in range(rnd.randrange(3))]
    return rnd.choice(choices)


def _mutate(rnd, node):
    """Replaces one random field anywhere in a JSON tree by a random value."""
    path = []
    while isinstance(node, (dict, list)) and node and (not path or rnd.random() < 0.7):
        key = rnd.choice(list(node)) if isinstance(node, dict) else rnd.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if path:
        parent, key = path[-1]
        parent[key] = _random_value(rnd)


@pytest.mark.parametrize("codec", ["auto", "dense"])
def test_random_header_mutations_raise_only_payload_error(codec):
    """An adversary reseals mutated headers: each either applies or raises PayloadError
    (never another exception), and a rejected one leaves the receiver bit-identical."""
    import random

    rnd = random.Random(codec)
    old, new = adversarial_pair()
    header, body = _split(sync.encode(old, new, base_version=0, version=1, codec=codec,
                                      bucket_elems=1000).to_bytes())
    receiver = adversarial_pair()[0]
    before = tree_bits(receiver)
    rejected = 0
    for _ in range(150):
        h = json.loads(json.dumps(header))
        for _ in range(rnd.randrange(1, 3)):
            _mutate(rnd, h)
        try:
            out = sync.apply(sync.Payload.from_bytes(_reseal(h, body)), receiver, version=0)
        except sync.PayloadError:
            rejected += 1
            assert tree_bits(receiver) == before
        else:
            assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(receiver)
    assert rejected > 100


def test_json_depth_is_the_same_in_any_slicing():
    """The scan carries quote parity, backslash runs and depth across slices (bounded memory);
    on random JSON with escapes it equals the parsed depth for every slice size."""
    import random

    rnd = random.Random(0)

    def value(level):
        r = rnd.random()
        if level < 6 and r < 0.35:
            return [value(level + 1) for _ in range(rnd.randrange(3))]
        if level < 6 and r < 0.6:
            return {rnd.choice(['a', '"[', '\\\\', 'k{']) + str(i): value(level + 1)
                    for i in range(rnd.randrange(3))}
        return rnd.choice(['x', '\\', '\\\\"', '"]]', '}{', 1, None, '\\\\\\[', '\u00e9['])

    for _ in range(40):
        doc = value(0)
        text = json.dumps(doc, ensure_ascii=rnd.random() < 0.5).encode()
        expected = _depth_by_parsing(doc)
        for chunk in (1, 2, 3, 7, 64, 1 << 20):
            assert fmt.json_depth(text, chunk=chunk) == expected, (text, chunk)
