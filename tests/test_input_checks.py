"""Bad input at the rollout engine's entry, the ratings readers and the experience store: one
line naming the value (and the file and line) and what is valid, nothing half-done. Token ids
are refused before any program runs; a store log line cannot make the store read or delete a
file outside its directory."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.errors import DataError, FileFormatError
from jaxflow.marl.store import ExperienceStore, SampleId, StoreError
from jaxflow.models import PRESETS, SamplingConfig, Transformer
from jaxflow.recsys.readers import read_atomic_ratings, read_movielens
from jaxflow.rollout import EngineConfig, RolloutConfigError, RolloutEngine

TINY = PRESETS["tiny"]
V = TINY.vocab_size


@pytest.fixture(scope="module")
def engine():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state)  # no init ops to run
    return RolloutEngine(graphdef, state, EngineConfig(slots=2, page_size=8, num_pages=8,
                                                       max_seq_len=24),
                         SamplingConfig(max_new_tokens=4))


@pytest.mark.parametrize("prompt, problem", [
    ([1, -1, 2], "token id -1 at position 1"),
    ([1, V], f"token id {V} at position 1"),
    (np.array([3, 2 ** 32 + 3], np.int64), f"token id {2 ** 32 + 3} at position 1"),
    (np.array([1.0, 2.5]), "token ids of dtype float64"),
    ([1, 2 ** 70], "token ids of dtype object"),
    (np.array([True, False]), "token ids of dtype bool"),
])
def test_engine_refuses_token_ids_outside_the_vocab(engine, prompt, problem):
    keys = np.zeros((2, 2), np.uint32)  # key data of two PRNG keys
    with pytest.raises(RolloutConfigError, match=rf"{problem}.*valid: integers in \[0, {V}\)") as e:
        engine.add_request(prompt, keys)
    assert "\n" not in str(e.value) and engine.idle()
    rows = np.array([[1, 2, 3], [4, V + 7, 0]], np.int32)
    with pytest.raises(RolloutConfigError, match=rf"prompts\[1\]: token id {V + 7} at position 1"):
        engine.generate(rows, np.array([3, 2], np.int32), keys)
    assert engine.idle()  # row 0 was not queued either


@pytest.mark.parametrize("line, problem", [
    (b"1::10::nan::100", r"ratings.dat:2: rating 'nan' is not finite"),
    (b"1::10::inf::100", r"ratings.dat:2: rating 'inf' is not finite"),
    (b"1::10::4::1e300", r"ratings.dat:2: timestamp '1e300' is out of range; valid: seconds in"),
    (b"1::10::4::-5", r"ratings.dat:2: timestamp '-5' is out of range"),
    (b"1::10::4::nan", r"ratings.dat:2: timestamp 'nan' is out of range"),
    (b"--5::10::4::100", r"ratings.dat:2: cannot parse"),
])
def test_movielens_rejects_non_finite_ratings_and_far_timestamps(tmp_path, line, problem):
    f = tmp_path / "ratings.dat"
    f.write_bytes(b"5::6::4::100\n" + line + b"\n")
    with pytest.raises((DataError, FileFormatError), match=problem) as e:
        read_movielens(f)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("row, problem", [
    ("--5\t10\t4\t100", r"r.inter:4: user_id token '--5' is not an integer id"),
    ("5\t-1\t4\t100", r"r.inter:4: item_id token '-1' is not an integer id"),
    ("5\t2147483648\t4\t100", r"r.inter:4: item_id 2147483648 is out of range; valid: 0..2147483647"),
    ("5\t10\tinf\t100", r"r.inter:4: rating 'inf' is not finite"),
    ("5\t10\t\t100", r"r.inter:4: rating is missing"),
    ("5\t10\t4\t1e300", r"r.inter:4: timestamp '1e300' is out of range"),
    ("5\t10\t4\tsoon", r"r.inter:4: timestamp 'soon' is not a number"),
])
def test_recbole_ratings_name_file_and_line(tmp_path, row, problem):
    f = tmp_path / "r.inter"
    f.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\t3\t4\n\n"
                 + row + "\n")
    with pytest.raises((DataError, FileFormatError), match=problem):
        read_atomic_ratings(f)
    f.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t2\t3\t4\n")
    got = read_atomic_ratings(f)
    assert got["user"].tolist() == [1] and got["timestamp"].tolist() == [4]


@pytest.mark.parametrize("sid", [SampleId(-1, 0, 0), (1, 2), (1, 2.5, 0), (True, 0, 0),
                                 (0, 0, 10 ** 18), "1-2-3"])
def test_store_put_refuses_bad_ids_and_stays_reopenable(tmp_path, sid):
    with ExperienceStore(["solver"], str(tmp_path)) as store:
        with pytest.raises(DataError, match=r"sample id .*; valid: \(input, turn, trajectory\)"):
            store.put("solver", sid, 0, {"x": np.zeros(2)})
        store.put("solver", SampleId(1, 0, 0), 0, {"x": np.zeros(2)})
    with ExperienceStore.open(str(tmp_path)) as again:
        assert again.count("solver") == 1


def test_store_agent_names_must_be_file_names(tmp_path):
    with pytest.raises(DataError, match=r"agent names \['../x'\]"):
        ExperienceStore(["solver", "../x"], str(tmp_path))


@pytest.mark.parametrize("state", ["../victim.npz", "/tmp/victim.npz", "consumer.other.1.npz",
                                   "rows/../../victim.npz", 7])
def test_store_state_paths_stay_inside_the_store(tmp_path, state):
    root = tmp_path / "store"
    victim = tmp_path / "victim.npz"
    np.savez(victim, a=np.ones(1))
    with ExperienceStore(["solver"], str(root)) as store:
        store.put("solver", SampleId(0, 0, 0), 0, {"x": np.zeros(2)})
        store.take("solver", 1)
        store.commit("solver", [SampleId(0, 0, 0)], {"acc": np.ones(1)})
    log = root / "log.jsonl"
    lines = log.read_text().splitlines()
    rec = json.loads(lines[-1])
    rec["state"], rec["seq"] = (str(victim) if state == "/tmp/victim.npz" else state), 9
    log.write_text("\n".join(lines + [json.dumps(rec)]) + "\n")
    with pytest.raises(StoreError, match=r"log.jsonl line 4: consumer state .* is not a file of "
                                         r"this store; valid: 'consumer.solver.<seq>.npz'"):
        ExperienceStore.open(str(root))
    assert victim.exists() and os.listdir(root / "rows")
