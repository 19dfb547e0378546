"""The ``bench_kernels`` cases: each Pallas kernel / attention backend and its XLA reference on
the same arrays, with the case's tolerance and its bytes / FLOP model (``iter_cases``).

Tolerances (per dtype): fused log-probs f32 1e-5 / bf16 1e-2 (the kernel reorders the vocab
sums), embedding bag f32 1e-6 / bf16 1e-2, attention f32 1e-5 / bf16 2e-2 (online softmax in
blocks vs one softmax), sync kernels exact (0 mismatches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import catalog

__all__ = ["FALLBACK_ATTENTION_BACKENDS", "KERNEL_FAMILIES", "TOLERANCE", "Case", "attention_cases",
           "attention_module", "iter_cases", "on_accelerator", "one_line"]

TOLERANCE = {
    "fused_logprobs": {"float32": 1e-5, "bfloat16": 1e-2},
    "embedding_bag": {"float32": 1e-6, "bfloat16": 1e-2},
    "attention": {"float32": 1e-5, "bfloat16": 2e-2},
    "sync_diff_compact": {"uint16": 0.0},
    "sync_scatter_apply": {"uint16": 0.0},
}
KERNEL_FAMILIES = tuple(TOLERANCE)
#: the attention backends' names when ``jaxflow.models.attention_backends`` is absent
FALLBACK_ATTENTION_BACKENDS = ("auto", "xla", "splash", "flash", "cudnn")


@dataclasses.dataclass
class Case:
    """One kernel-vs-reference comparison: both sides take ``args`` (device arrays)."""

    kernel: str  # family, a TOLERANCE key
    name: str  # row name, e.g. "attention[flash,T=8192]"
    shape: str
    dtype: str
    kernel_fn: Callable | None
    reference_fn: Callable | None
    args: tuple
    exact: bool = False
    bytes_moved: int | None = None  # per call, the bandwidth model
    flops: float | None = None  # per call, the FLOP model
    throughput_model: str = ""
    unavailable: str | None = None  # kernel side known missing before building
    extra: dict = dataclasses.field(default_factory=dict)
    reference_key: Any = None  # cases with the same key share one reference build


def one_line(e: BaseException, limit: int = 300) -> str:
    """``"<Type>: <message>"`` of ``e`` on one line, at most ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:limit]


# ------------------------------------------------------------------------------- cases


class _DeviceRandom:
    """Random arrays traced inside one jitted program (accelerators: made where they live)."""

    xp = jnp

    def __init__(self, key):
        self.key, self.i = key, 0

    def _next(self):
        self.i += 1
        return jax.random.fold_in(self.key, self.i)

    def normal(self, shape, dtype=jnp.float32):
        return jax.random.normal(self._next(), shape, jnp.float32).astype(dtype)

    def randint(self, shape, low, high):
        return jax.random.randint(self._next(), shape, low, high, jnp.int32)

    def bernoulli(self, p, shape):
        return jax.random.bernoulli(self._next(), p, shape)


class _HostRandom:
    """The same draws' kinds from numpy (the CPU: no compilation for a handful of arrays)."""

    xp = np

    def __init__(self, key):
        self.rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))

    def normal(self, shape, dtype=jnp.float32):
        return self.rng.standard_normal(shape, np.float32).astype(dtype)

    def randint(self, shape, low, high):
        return self.rng.integers(low, high, shape, dtype=np.int32)

    def bernoulli(self, p, shape):
        return self.rng.random(shape) < p


def on_accelerator() -> bool:
    """Whether the default backend is a GPU / TPU (arrays drawn on the device)."""
    return jax.default_backend() in ("gpu", "tpu")


def _make(make: Callable, key) -> tuple:
    """``make(random)`` -> a tuple of arrays on the default device: drawn by one jitted program
    on a GPU / TPU, by numpy (then placed) on the CPU."""
    if on_accelerator():
        return jax.jit(lambda k: make(_DeviceRandom(k)))(key)
    return tuple(jnp.asarray(x) for x in make(_HostRandom(key)))


def _fused_cases(p: dict, interpret: bool, key) -> list[Case]:
    from jaxflow.rl.logprobs import fused_logprobs_xla
    from pallas_kernels.fused_logprobs import fused_logprobs

    n, d, v, kk, dtype = p["n"], p["d"], p["vocab"], p["k"], p["dtype"]
    def make(r):
        return (r.normal((n, d), dtype), (r.normal((d, v)) / np.sqrt(d)).astype(dtype),
                r.randint((n,), 0, v), r.randint((n, kk), 0, v), r.normal((n,)),
                r.normal((n, kk)))

    h, w, t, topk, gt, gk = _make(make, key)

    def step(impl):
        def f(h, w, t, topk, gt, gk):
            def loss(h, w):
                out = impl(h, w, t, topk)
                return jnp.sum(gt * out.target_logp) + jnp.sum(gk * out.topk_logp), out
            (_, out), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)
            return out.target_logp, out.topk_logp, dh, dw
        return f

    name = jnp.dtype(dtype).name
    return [Case("fused_logprobs", "fused_logprobs_fwd_bwd", f"N={n} d={d} V={v} K={kk}", name,
                 step(lambda *a: fused_logprobs(*a, interpret=interpret)),
                 step(lambda *a: fused_logprobs_xla(*a)), (h, w, t, topk, gt, gk),
                 flops=6.0 * n * d * v,
                 throughput_model="6 N d V (logits 2NdV forward, dh and dW 4NdV backward)",
                 extra={"naive_logits_bytes": 4 * n * v,
                        "reference_is": "chunked XLA path (jaxflow.rl.logprobs)"})]


def _bag_cases(p: dict, interpret: bool, key) -> list[Case]:
    from pallas_kernels.embedding_bag import embedding_bag, embedding_bag_reference

    vocab, dim, bags, bag_len = p["vocab"], p["dim"], p["bags"], p["bag_len"]
    def make(r):
        ids = r.randint((bags, bag_len), 0, vocab)
        ids = r.xp.where(r.bernoulli(0.1, ids.shape), -1, ids)  # ~10% padding
        return r.normal((vocab, dim)), ids, r.normal((bags, dim))

    table, ids, g = _make(make, key)

    def step(impl):
        def f(table, ids, g):
            out, vjp = jax.vjp(lambda tb: impl(tb, ids), table)
            return out, vjp(g)[0]
        return f

    rows = bags * bag_len * dim * 4
    moved = 4 * bags * bag_len + rows + 4 * bags * dim + 4 * bags * dim + 4 * vocab * dim + 2 * rows
    return [Case("embedding_bag", "embedding_bag_fwd_bwd",
                 f"V={vocab} D={dim} bags={bags}x{bag_len} mean", "float32",
                 step(lambda tb, i: embedding_bag(tb, i, mode="mean", interpret=interpret)),
                 step(lambda tb, i: embedding_bag_reference(tb, i, "mean")), (table, ids, g),
                 bytes_moved=moved,
                 throughput_model="ids + gathered rows + bags out, then g in + the dense [V, D] "
                                  "gradient written + gathered rows scattered (read and write)",
                 extra={"reference_is": "jnp.take + masked sum over the bag; its gradient a "
                                        "scatter-add into a dense [V, D] table gradient"})]


def _sync_inputs(p: dict, change_fraction: float, key):
    n = p["n"]
    def make(r):
        old = r.randint((n,), 0, 2**16).astype(np.uint16)
        flip = r.randint((n,), 1, 2**16).astype(np.uint16)
        changed = r.bernoulli(change_fraction, (n,))
        return old, r.xp.where(changed, old ^ flip, old), r.xp.sum(changed, dtype=np.int32)

    return _make(make, key)


def _diff_cases(p: dict, interpret: bool, key, change_fraction: float) -> list[Case]:
    from pallas_kernels.sync_diff_compact import diff_compact, diff_compact_reference

    n, cap = p["n"], p["capacity"]
    old, new, changed = _sync_inputs(p, change_fraction, key)
    changed = int(changed)
    return [Case("sync_diff_compact", "sync_diff_compact", f"n={n} capacity={cap}", "uint16",
                 lambda a, b: diff_compact(a, b, capacity=cap, interpret=interpret),
                 lambda a, b: diff_compact_reference(a, b, capacity=cap), (old, new), exact=True,
                 bytes_moved=2 * 2 * n + cap * (4 + 2 + 2),
                 throughput_model="both uint16 versions read + capacity x (int32 position + "
                                  "2 uint16 values) written",
                 extra={"changed": changed, "change_fraction": changed / n,
                        "overflow": changed > cap})]


def _scatter_cases(p: dict, interpret: bool, key, change_fraction: float) -> list[Case]:
    from pallas_kernels.sync_diff_compact import diff_compact_reference
    from pallas_kernels.sync_scatter_apply import scatter_apply, scatter_apply_reference

    n, cap = p["n"], p["capacity"]
    old, new, _ = _sync_inputs(p, change_fraction, key)
    count, positions, _, values = jax.jit(diff_compact_reference,
                                          static_argnames="capacity")(old, new, capacity=cap)
    exact_apply = int(count) <= cap
    return [Case("sync_scatter_apply", "sync_scatter_apply", f"n={n} updates={cap}", "uint16",
                 lambda d, pos, val: scatter_apply(d, pos, val, interpret=interpret),
                 scatter_apply_reference, (old, positions, values), exact=True,
                 bytes_moved=2 * 2 * n + cap * (4 + 2),
                 throughput_model="uint16 destination read and written + capacity x (int32 "
                                  "position + uint16 value) read",
                 extra={"updates": int(min(int(count), cap)),
                        "reconstructs_new_version": exact_apply})]


def attention_module():
    """``jaxflow.models.attention_backends``, or None where this tree does not have it."""
    import importlib

    name = "jaxflow.models.attention_backends"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None  # another branch brings it; the rows say so
        raise


def attention_cases(a, interpret: bool, key) -> list[Case]:
    """One case per attention backend x sequence length of the config's ``attention`` section
    ``a``, each compared with ``attention(backend="xla")`` (one shared reference build per length)."""
    module = attention_module()
    dtype = jnp.dtype(a.dtype)
    out = []
    for tokens in a.tokens:
        shape = (f"B={a.batch} T={tokens} H={a.heads} K={a.kv_heads} D={a.head_dim} "
                 f"segments={a.segments}")
        # causal attention: 4 B H T^2 D / 2 forward; backward 2.5x forward (FlashAttention's count)
        flops = 3.5 * 4.0 * a.batch * a.heads * tokens * tokens * a.head_dim / 2 / a.segments
        model = "3.5 x causal forward 2 B H T^2 D / segments (backward = 2.5 x forward)"
        if module is None:
            for b in a.backends:
                out.append(Case("attention", f"attention[{b},T={tokens}]", shape, dtype.name,
                                None, None, (), flops=flops, throughput_model=model,
                                unavailable="unavailable: module missing "
                                            "(jaxflow.models.attention_backends)",
                                extra={"backend": b, "tokens": tokens}))
            continue
        def make(r, tokens=tokens):
            qs, kvs = (a.batch, tokens, a.heads, a.head_dim), (a.batch, tokens, a.kv_heads,
                                                               a.head_dim)
            seg = (1 + r.xp.arange(tokens) * a.segments // tokens).astype(np.int32)
            return (r.normal(qs, dtype), r.normal(kvs, dtype), r.normal(kvs, dtype),
                    r.normal(qs, dtype), r.xp.broadcast_to(seg, (a.batch, tokens)))

        q, k, v, g, seg = _make(make, jax.random.fold_in(key, tokens))

        def step(backend):
            def f(q, k, v, seg, g):
                o, vjp = jax.vjp(lambda q, k, v: module.attention(
                    q, k, v, seg, backend=backend, interpret=interpret), q, k, v)
                return (o, *vjp(g))
            return f

        for b in a.backends:
            known = getattr(module, "ATTENTION_BACKENDS", FALLBACK_ATTENTION_BACKENDS)
            out.append(Case("attention", f"attention[{b},T={tokens}]", shape, dtype.name,
                            step(b), step("xla"), (q, k, v, seg, g), flops=flops,
                            throughput_model=model,
                            unavailable=None if b in known else
                            f"unavailable: {b!r} not in ATTENTION_BACKENDS {tuple(known)}",
                            extra={"backend": b, "tokens": tokens,
                                   "reference_is": "attention(backend='xla')"},
                            reference_key=("attention", "xla", tokens)))
    return out


def iter_cases(config, interpret: bool):
    """Every case the config asks for, one kernel family at a time (its arrays allocated on the
    default device only while it is benchmarked). A family whose inputs cannot be made here
    (e.g. out of memory) yields one unavailable row."""
    key = jax.random.key(config.seed)
    sync_key = jax.random.fold_in(key, len(KERNEL_FAMILIES))
    sizes = {fam: catalog.SIZES[fam][config.size] for fam in catalog.SIZES}
    makers = {
        "fused_logprobs": lambda k: _fused_cases(sizes["fused_logprobs"], interpret, k),
        "embedding_bag": lambda k: _bag_cases(sizes["embedding_bag"], interpret, k),
        # both sync kernels see the same pair of versions: scatter applies diff's output
        "sync_diff_compact": lambda k: _diff_cases(sizes["sync"], interpret, sync_key,
                                                   config.change_fraction),
        "sync_scatter_apply": lambda k: _scatter_cases(sizes["sync"], interpret, sync_key,
                                                       config.change_fraction),
        "attention": lambda k: attention_cases(config.attention, interpret, k),
    }
    for fam in config.kernels:
        try:
            cases = makers[fam](jax.random.fold_in(key, KERNEL_FAMILIES.index(fam)))
        except Exception as e:  # noqa: BLE001 - e.g. inputs that do not fit this device
            dtype = next(iter(TOLERANCE[fam]))
            cases = [Case(fam, fam, "", dtype, None, None, (),
                          unavailable=f"unavailable: inputs: {one_line(e)}")]
        while cases:
            yield cases.pop(0)
