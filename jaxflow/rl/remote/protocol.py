"""The wire between a GRPO trainer job and a rollout job (two separate ``jax.distributed`` jobs).

Weights cross ONLY as SparseRL-Sync payloads (``jaxflow.sync.transport.tcp``: each rollout
process runs a :class:`~jaxflow.sync.transport.tcp.ReplicaServer` holding its bf16 replica).
Beside it each rollout process serves this small control protocol on its ``listen`` address,
frames as in the sync transport (``jaxflow.sync.transport.frames``: a hello each way, then
``kind (4 bytes) | length (u64 LE) | body | MAC`` under the job's secret, ``jaxflow.job_auth``)::

    trainer -> rollout   STAT                     rollout -> trainer  OK   {"sync_port", "version", ...}
    trainer -> rollout   RSET {"origin", "version"}                    OK   {"version", "reset"}
    trainer -> rollout   ROLL {"version", "digest", "prompts", "key"}  BTCH <header json> <npz>
    trainer -> rollout   DONE                                          OK   {"rollouts_served", ...}
                                                              or       ERR  {"error"}

RSET starts a new lineage: the replica goes back to FRESH (so the next sync is a full payload)
when the trainer's ``origin`` (the digest of the params its run started from) is not the one
the replica holds, or when the replica is ahead of the trainer's ``version`` (a trainer that
resumed from an older checkpoint). ROLL samples G responses per prompt with the replica at
exactly ``version`` whose digest must be ``digest`` (else ERR): the rollout's tokens depend only
on the replica's bits, the prompts and the key. A BTCH body is a 4-byte little-endian header
length, the JSON header (version, digest, array names / shapes / dtypes) and the arrays as an
``.npz``; the trainer checks every shape and dtype (and the range of the id arrays) against what
it asked for before using it (:func:`expected_batch`, :func:`decode_batch`). Beside the
:data:`BATCH_FIELDS` a batch carries the :data:`RECORD_FIELDS` its sampler records (the
behaviour policy's top-K for ``sis_b``, the MoE routing for R3), exactly when the trainer's
:class:`jaxflow.rl.rollout.RolloutSpec` asks for them.

Only peers holding the job's secret are answered at all. The trainer's session (the random id
its connections present) is bound by its RSET: only that session may ROLL or say DONE, and the
replica server takes payloads only from it. Every request is checked field by field
(:func:`parse_reset`, :func:`parse_roll`); a malformed one is an ERR reply, never the end of
the job.
"""

from __future__ import annotations

import dataclasses
import io
import json
import struct

import numpy as np

from jaxflow import job_auth
from jaxflow.config import ConfigError
from jaxflow.config_domains import POSITIVE, domains

ROLES = ("local", "trainer", "rollout")
#: frame kinds of the control protocol (the sync frames are the transport's own)
KINDS = (b"STAT", b"RSET", b"ROLL", b"DONE", b"OK  ", b"BTCH", b"ERR ")
#: the arrays of a rollout batch, in :class:`jaxflow.rl.rollout.RolloutBatch` order
BATCH_FIELDS = ("prompts", "prompt_lengths", "tokens", "mask", "behaviour_logp", "rewards",
                "versions")
#: the optional records of a rollout batch, in RolloutBatch order after :data:`BATCH_FIELDS`
RECORD_FIELDS = ("behaviour_topk_logp", "behaviour_topk_ids", "routing_experts", "routing_gates")
_LEN = struct.Struct("<I")


class RolloutLost(ConnectionError):
    """A rollout endpoint did not answer within the trainer's ``remote.timeout_s``."""


class RolloutRefused(RuntimeError):
    """A rollout endpoint answered ERR (e.g. its replica is not at the asked version)."""


def parse_endpoint(text: str, what: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> (host, port); ConfigError naming ``what`` and the bad text."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{what}={text!r}: expected HOST:PORT with a port in 0-65535, "
                          "e.g. 127.0.0.1:7100")
    return host.strip("[]"), int(port_text)


@domains(timeout_s=POSITIVE, start_timeout_s=POSITIVE)
@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """Where the flagship's roles run (``--set remote.role=...``).

    Attributes:
      role: "local" (trainer and rollout sub-meshes in this job, the default), "trainer"
        (this job trains; the rollouts come from the rollout job at ``rollout``) or
        "rollout" (this job samples; it serves ``listen`` until the trainer says DONE).
      rollout: trainer role: every rollout process's control address, comma-separated
        ``HOST:PORT,HOST:PORT`` (one per process of the rollout job, in process order).
      listen: rollout role: ``HOST:PORT`` this job's process i listens on at ``PORT + i``
        (its SparseRL-Sync replica server takes any free port, announced by STAT).
      timeout_s: how long either side waits for a lost peer (a killed rollout job restarting,
        a trainer resuming) before exiting 75 naming it.
      start_timeout_s: how long either side waits for the other at the start (the trainer's
        warm start, JAX start-up, compiles) before exiting 75 naming it.
    """

    role: str = "local"
    rollout: str = ""
    listen: str = ""
    timeout_s: float = 120.0
    start_timeout_s: float = 900.0

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"remote.role={self.role!r}; valid: {', '.join(ROLES)}")
        for name in ("timeout_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"remote.{name}={getattr(self, name)!r}: need > 0 seconds")
        if self.role == "trainer":
            if not self.rollout.strip():
                raise ConfigError("remote.role=trainer needs remote.rollout=HOST:PORT[,HOST:PORT...]"
                                  " (the rollout job's control addresses)")
            for host, _ in self.endpoints():
                _need_secret(host, "remote.rollout")
        if self.role == "rollout":
            if not self.listen.strip():
                raise ConfigError("remote.role=rollout needs remote.listen=HOST:PORT")
            _need_secret(parse_endpoint(self.listen, "remote.listen")[0], "remote.listen")

    def endpoints(self) -> list[tuple[str, int]]:
        """The rollout processes' control addresses (trainer role)."""
        return [parse_endpoint(t, "remote.rollout") for t in self.rollout.split(",") if t.strip()]


def _need_secret(host: str, what: str) -> None:
    """ConfigError when ``host`` is not loopback and no job secret is configured."""
    if not job_auth.is_loopback(host) and not job_auth.secret_configured():
        raise ConfigError(f"{what} host {host!r} is not loopback and no job secret is set; valid:"
                          f" --secret-file PATH or {job_auth.SECRET_ENV} (the same for both jobs),"
                          " or a 127.0.0.1 address")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_reset(req: dict) -> tuple[str, int]:
    """(origin, version) of an RSET request; RolloutRefused naming the bad field otherwise."""
    origin, version = req.get("origin"), req.get("version", 0)
    if not isinstance(origin, str) or len(origin) > 1024:
        raise RolloutRefused(f"RSET origin {repr(origin)[:60]}: need a string of at most 1024 "
                             "characters (the hex digest of the run's start)")
    if not _is_int(version) or not 0 <= version < 2 ** 62:
        raise RolloutRefused(f"RSET version {repr(version)[:60]}: need an int in [0, 2**62)")
    return origin, version


def parse_roll(req: dict, *, key_shape: tuple[int, ...], max_prompts: int
               ) -> tuple[int, str, list[str], np.ndarray]:
    """(version, digest, prompts, key data uint32[key_shape]) of a ROLL request, every field
    checked: version an int >= 0, digest a string, prompts 1..``max_prompts`` strings, key
    ints in [0, 2**32) of ``key_shape``. RolloutRefused naming the first bad field."""
    missing = [k for k in ("version", "digest", "prompts", "key") if k not in req]
    if missing:
        raise RolloutRefused(f"ROLL request lacks {missing}; valid: version, digest, prompts, key")
    version, digest, prompts, key = req["version"], req["digest"], req["prompts"], req["key"]
    if not _is_int(version) or not 0 <= version < 2 ** 62:
        raise RolloutRefused(f"ROLL version {repr(version)[:60]}: need an int in [0, 2**62)")
    if not isinstance(digest, str) or len(digest) > 256:
        raise RolloutRefused(f"ROLL digest {repr(digest)[:60]}: need a string (a tree digest)")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= max_prompts:
        raise RolloutRefused(f"ROLL prompts {repr(prompts)[:60]}: need a list of 1.."
                             f"{max_prompts} strings")
    bad = next((p for p in prompts if not isinstance(p, str)), None)
    if bad is not None:
        raise RolloutRefused(f"ROLL prompt {repr(bad)[:60]} is not a string (a "
                             f"{type(bad).__name__}); valid: strings")
    try:
        flat = np.asarray(key, dtype=object)
    except ValueError:  # a ragged list
        flat = np.zeros((0,), object)
    if flat.shape != tuple(key_shape) or not all(
            _is_int(x) and 0 <= x < 2 ** 32 for x in flat.reshape(-1)):
        raise RolloutRefused(f"ROLL key {repr(key)[:60]}: need ints in [0, 2**32) of shape "
                             f"{list(key_shape)} (jax.random.key_data)")
    return version, digest, prompts, flat.astype(np.uint32)


def json_body(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def parse_json(body, who: str) -> dict:
    """A JSON object from a control frame body; RolloutRefused naming ``who`` otherwise."""
    try:
        obj = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RolloutRefused(f"{who}: reply is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RolloutRefused(f"{who}: reply is not a JSON object")
    return obj


def batch_arrays(batch) -> dict[str, np.ndarray]:
    """The arrays a BTCH body carries for a :class:`jaxflow.rl.rollout.RolloutBatch` (or any
    sequence of its arrays in its order): the :data:`BATCH_FIELDS`, and the :data:`RECORD_FIELDS`
    of the records it holds (the top-K pair, the routing pair: not empty, i.e. recorded)."""
    named = dict(zip(BATCH_FIELDS + RECORD_FIELDS, batch))
    arrays = {k: named[k] for k in BATCH_FIELDS}
    for pair in (RECORD_FIELDS[:2], RECORD_FIELDS[2:]):
        if all(k in named and np.size(named[k]) for k in pair):
            arrays.update((k, named[k]) for k in pair)
    return arrays


def expected_batch(rows: int, prompt_width: int, max_new_tokens: int, *, behaviour_topk: int = 0,
                   vocab_size: int | None = None, routing: tuple[int, int, int] | None = None
                   ) -> dict[str, tuple]:
    """What a rollout of ``rows`` rows must return, name -> (shape, dtype) or (shape, dtype,
    bound) for id arrays (every value in [0, bound)).

    Args:
      rows, prompt_width, max_new_tokens: B, P (BOS included) and N.
      behaviour_topk: K > 0: the behaviour top-K [B, N, K] (log-probs float32, ids int32 below
        ``vocab_size`` when given).
      routing: (MoE layers L, top-k k, expert count E): the routing record [B, P + N - 1, L, k]
        (experts in the smallest unsigned int holding E, below E; gates float32).
    """
    n = max_new_tokens
    out: dict[str, tuple] = {
        "prompts": ((rows, prompt_width), "int32"), "prompt_lengths": ((rows,), "int32"),
        "tokens": ((rows, n), "int32"), "mask": ((rows, n), "float32"),
        "behaviour_logp": ((rows, n), "float32"), "rewards": ((rows,), "float32"),
        "versions": ((rows, n), "int32")}
    if behaviour_topk:
        out["behaviour_topk_logp"] = ((rows, n, behaviour_topk), "float32")
        out["behaviour_topk_ids"] = ((rows, n, behaviour_topk), "int32") + ((vocab_size,) if vocab_size else ())
    if routing is not None:
        layers, k, n_experts = routing
        shape = (rows, prompt_width + n - 1, layers, k)
        dtype = next(d for d in ("uint8", "uint16", "uint32") if n_experts - 1 <= np.iinfo(d).max)
        out["routing_experts"] = (shape, dtype, n_experts)
        out["routing_gates"] = (shape, "float32")
    return out


def encode_batch(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """A BTCH body: header (with each array's shape and dtype added) and the arrays."""
    head = dict(header, arrays={k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()})
    head_bytes = json_body(head)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return _LEN.pack(len(head_bytes)) + head_bytes + buf.getvalue()


def decode_batch(body, expected: dict[str, tuple], who: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a BTCH body whose arrays must be exactly ``expected`` (name ->
    (shape, dtype) or (shape, dtype, bound): ids in [0, bound), :func:`expected_batch`);
    RolloutRefused naming ``who`` and the first difference otherwise. Nothing is returned (so
    nothing can be used) unless every array passes."""
    view = memoryview(body)
    if view.nbytes < _LEN.size:
        raise RolloutRefused(f"{who}: batch frame of {view.nbytes} bytes has no header")
    (n,) = _LEN.unpack(view[:_LEN.size])
    header = parse_json(view[_LEN.size:_LEN.size + n], who)
    try:
        with np.load(io.BytesIO(view[_LEN.size + n:]), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError) as e:
        raise RolloutRefused(f"{who}: batch arrays unreadable ({e})") from None
    if set(arrays) != set(expected):
        raise RolloutRefused(f"{who}: batch has arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, (shape, dtype, *bound) in expected.items():
        got = arrays[name]
        if tuple(got.shape) != tuple(shape) or str(got.dtype) != dtype:
            raise RolloutRefused(f"{who}: batch array {name!r} is {got.dtype}{list(got.shape)}, "
                                 f"expected {dtype}{list(shape)}")
        if bound and got.size and not (0 <= got.min() and got.max() < bound[0]):
            bad = got[(got < 0) | (got >= bound[0])].reshape(-1)[0]
            raise RolloutRefused(f"{who}: batch array {name!r} holds id {bad}; valid: ids in [0, {bound[0]})")
    return header, arrays


__all__ = ["BATCH_FIELDS", "KINDS", "RECORD_FIELDS", "ROLES", "RemoteConfig", "RolloutLost", "RolloutRefused",
           "batch_arrays", "decode_batch", "encode_batch", "expected_batch", "parse_endpoint", "parse_reset",
           "parse_roll"]
