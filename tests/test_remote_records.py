"""Remote rollouts carry the optional records: the behaviour policy's top-K (``sis_b``) and the
MoE routing record (R3).

* the protocol's encode / decode round trip keeps every field bit-exact, records included, and
  sends the records exactly when the batch holds them;
* a batch whose record has an unexpected dtype, shape or id range, or lacks / adds a record, is
  refused with one line before anything is returned (the trainer builds nothing from it);
* end to end: a rollout service sampling an MoE policy through the engine with both records on
  returns, through the trainer's own expectations (``RemoteRollout.expected_arrays``), the batch
  its worker returns locally.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.models.moe import expert_index_dtype
from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.remote import protocol as P
from jaxflow.rl.rollout import RolloutBatch, RolloutSpec

B, W, N, K = 4, 5, 3, 2
MOE = TransformerConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=32, max_seq_len=32,
                        n_experts=8, n_experts_per_token=2, d_ff_expert=16)
ROUTING = (2, 2, 8)  # MoE layers, top-k, experts of MOE


def _batch(records: bool = True) -> RolloutBatch:
    rng = np.random.default_rng(0)
    base = [rng.integers(0, 23, (B, W), dtype=np.int32), np.full((B,), 3, np.int32),
            rng.integers(0, 23, (B, N), dtype=np.int32), np.ones((B, N), np.float32),
            -rng.random((B, N), dtype=np.float32), rng.random(B, dtype=np.float32), np.zeros((B, N), np.int32)]
    if not records:
        return RolloutBatch(*base)
    shape = (B, W + N - 1, 2, 2)
    return RolloutBatch(*base, -rng.random((B, N, K), dtype=np.float32), rng.integers(0, 23, (B, N, K), dtype=np.int32),
                        rng.integers(0, 8, shape).astype(np.uint8), rng.random(shape, dtype=np.float32))


def _expected(records: bool = True) -> dict:
    if not records:
        return P.expected_batch(B, W, N)
    return P.expected_batch(B, W, N, behaviour_topk=K, vocab_size=23, routing=ROUTING)


def _round_trip(arrays: dict, records: bool = True) -> RolloutBatch:
    _, got = P.decode_batch(P.encode_batch({"version": 1}, arrays), _expected(records), "test")
    return RolloutBatch(*(got.get(k) for k in P.BATCH_FIELDS + P.RECORD_FIELDS))


def test_round_trip_keeps_the_records_bit_exact():
    assert P.BATCH_FIELDS + P.RECORD_FIELDS == RolloutBatch._fields
    assert P.expected_batch(1, 1, 1, routing=(1, 1, 300))["routing_experts"][1] == str(expert_index_dtype(300))
    for records in (True, False):
        batch = _batch(records)
        arrays = P.batch_arrays(batch)
        assert set(arrays) == set(P.BATCH_FIELDS + (P.RECORD_FIELDS if records else ()))
        back = _round_trip(arrays, records)
        for name, ours, theirs in zip(RolloutBatch._fields, batch, back):
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
            np.testing.assert_array_equal(theirs, ours, err_msg=name)
        assert back.has_routing == back.has_behaviour_topk == records


@pytest.mark.parametrize("name, bad, message", [
    ("routing_experts", lambda a: a.astype(np.int32),
     r"array 'routing_experts' is int32\[4, 7, 2, 2\], expected uint8\[4, 7, 2, 2\]$"),
    ("routing_experts", lambda a: a[:, :, :1], r"array 'routing_experts' is uint8\[4, 7, 1, 2\], expected uint8"),
    ("routing_experts", lambda a: np.where(a == a.flat[0], 9, a).astype(np.uint8),
     r"array 'routing_experts' holds id 9; valid: ids in \[0, 8\)$"),
    ("routing_gates", lambda a: a.astype(np.float64), r"array 'routing_gates' is float64"),
    ("behaviour_topk_ids", lambda a: a + 23, r"array 'behaviour_topk_ids' holds id \d+; valid: ids in \[0, 23\)$"),
    ("behaviour_topk_logp", lambda a: a[..., :1], r"array 'behaviour_topk_logp' is float32\[4, 3, 1\], expected"),
    ("routing_gates", None, r"has arrays \[.*\], expected \[.*'routing_gates'.*\]$"),
], ids=["experts-dtype", "experts-shape", "expert-id", "gates-dtype", "topk-id", "topk-shape", "missing"])
def test_a_corrupt_record_is_refused_in_one_line(name, bad, message):
    arrays = P.batch_arrays(_batch())
    if bad is None:
        del arrays[name]
    else:
        arrays[name] = bad(arrays[name])
    with pytest.raises(P.RolloutRefused, match="^test: batch " + message) as err:
        _round_trip(arrays)
    assert "\n" not in str(err.value)


def test_records_the_trainer_did_not_ask_for_are_refused():
    with pytest.raises(P.RolloutRefused, match=r"^test: batch has arrays .*'routing_experts'.*, expected \["):
        P.decode_batch(P.encode_batch({}, P.batch_arrays(_batch())), _expected(False), "test")


def test_the_client_refuses_a_corrupt_batch_before_returning_one():
    """RemoteRollout._roll hands nothing back when a rollout process sends a corrupt record."""
    from jaxflow.rl.remote.client import RemoteRollout

    spec = RolloutSpec(group_size=2, max_new_tokens=N, behaviour_topk=K, record_routing=True)
    task = SimpleNamespace(max_prompt_len=W - 1)
    with pytest.raises(ValueError, match=r"^RemoteRollout: spec.record_routing=True \(R3\) needs model="):
        RemoteRollout([("127.0.0.1", 1)], spec, task, None, None)
    client = RemoteRollout([("127.0.0.1", 1)], spec, task, None, None, model=MOE)
    expected = client.expected_arrays(B)
    assert expected == _expected()
    arrays = P.batch_arrays(_batch())
    arrays["routing_experts"] = arrays["routing_experts"].astype(np.uint16)
    body = P.encode_batch({}, arrays)

    class _Endpoint:
        name = "fake"

        def send(self, kind, body):
            pass

        def recv(self, bound):
            return b"BTCH", bytearray(body)

    client._endpoints = [_Endpoint()]
    with pytest.raises(P.RolloutRefused, match=r"^rollout fake: batch array 'routing_experts' is uint16"):
        client._roll(b"{}", expected, 1 << 24)


def test_service_returns_the_engines_records_as_the_worker_does():
    """The rollout job's answer to ROLL (MoE policy, engine, ``sis_b`` top-K and R3 on), decoded
    by the trainer's expectations, equals its worker's own batch bit for bit."""
    from jaxflow.data.tokenizer import CharTokenizer
    from jaxflow.mesh import role_meshes
    from jaxflow.rl.remote.client import RemoteRollout
    from jaxflow.rl.remote.server import RolloutService
    from jaxflow.rl.rollout import RolloutWorker
    from jaxflow.rl.tasks import AdditionRLTask
    from jaxflow.sync.replica import Replica
    from jaxflow.sync.wire import tree_digest
    from jaxflow.train.lm_state import init_params

    mesh = role_meshes({"trainer": 1, "rollout": 1}, devices=jax.devices()[:2])["rollout"]
    spec = RolloutSpec(group_size=2, max_new_tokens=N, sampler="engine", behaviour_topk=K, record_routing=True)
    task, tok = AdditionRLTask(max_digits=1), CharTokenizer()
    model = dataclasses.replace(MOE, vocab_size=tok.vocab_size)
    service = RolloutService(RolloutWorker(model, mesh, spec, task, tok))
    try:
        params = init_params(service.worker.fns, model, jax.random.key(2))
        host = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
        service.replica_server.replica = Replica(host, version=3)
        prompts, key = ["1+2=", "3+4="], jax.random.key(7)
        body = service._roll({"version": 3, "digest": tree_digest(host), "prompts": prompts,
                              "key": np.asarray(jax.random.key_data(key)).tolist()})
        client = RemoteRollout([("127.0.0.1", 1)], spec, task, tok, None, model=model)
        _, arrays = P.decode_batch(body, client.expected_arrays(len(prompts) * 2), "test")
        local = RolloutWorker(model, mesh, spec, task, tok)  # the same replica, sampled here
        want = local.generate(None, prompts, key, replica=Replica(host, version=3))
        assert want.has_routing and want.has_behaviour_topk
        for name, ours in zip(RolloutBatch._fields, want):
            np.testing.assert_array_equal(arrays[name], ours, err_msg=name)
    finally:
        service._sock.close()
