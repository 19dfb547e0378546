"""Experience store under faults: one writer, an append-only index, damaged files named, no row
lost or doubled, O(1) bytes per put."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxflow.marl.store import ExperienceStore, SampleId, StoreError, StoreLockedError

AGENTS = ("solver", "verifier")


def filled(path, n=10, agent="solver"):
    store = ExperienceStore(AGENTS, str(path))
    for i in range(n):
        store.put(agent, SampleId(i, 0, 0), version=0, payload={"value": np.int64(i)})
    return store


def consume_all(store, agent="solver", micro=3, seen=None):
    """Takes and commits until nothing is ready; each commit's consumer state holds every value
    seen so far (``seen``, kept across calls when given). Returns the values of this call."""
    seen = [] if seen is None else seen
    got = []
    while rows := store.take(agent, micro):
        got += [int(r.payload["value"]) for r in rows]
        seen += [int(r.payload["value"]) for r in rows]
        store.commit(agent, [r.sample_id for r in rows], {"seen": np.asarray(seen)})
    return got


def test_second_open_in_this_process_is_refused(tmp_path):
    store = filled(tmp_path)
    with pytest.raises(StoreLockedError, match=f"open by another writer \\(pid {os.getpid()}\\)"):
        ExperienceStore.open(str(tmp_path))
    with pytest.raises(StoreError, match="already holds an experience store"):
        ExperienceStore(AGENTS, str(tmp_path))
    assert len(consume_all(store)) == 10  # the first store is unaffected
    store.close()
    with ExperienceStore.open(str(tmp_path)) as again:
        assert again.count("solver", "consumed") == 10 and again.count("solver", "ready") == 0


def test_second_open_from_another_process_is_refused(tmp_path):
    store = filled(tmp_path)
    module = os.path.join(os.path.dirname(__file__), "..", "jaxflow", "marl", "store.py")
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('s', sys.argv[1]);"
            "m = importlib.util.module_from_spec(spec); sys.modules['s'] = m; spec.loader.exec_module(m)\n"
            "try:\n    m.ExperienceStore.open(sys.argv[2])\nexcept m.StoreLockedError as e:\n"
            "    print(e); sys.exit(3)")
    res = subprocess.run([sys.executable, "-c", code, module, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert f"pid {os.getpid()}" in res.stdout
    assert store.count("solver", "ready") == 10
    store.close()


def test_producer_and_consumer_threads_lose_and_double_nothing(tmp_path):
    store = filled(tmp_path, n=10)
    seen = []

    def produce():
        for i in range(10, 20):
            store.put("solver", SampleId(i, 0, 0), version=0, payload={"value": np.int64(i)})

    producer = threading.Thread(target=produce)
    producer.start()
    state = []  # one consumer: its committed state accumulates over the loop's calls
    while producer.is_alive() or store.count("solver", "ready"):
        seen += consume_all(store, micro=2, seen=state)
    producer.join()
    seen += consume_all(store, seen=state)
    store.close()
    assert sorted(seen) == list(range(20))
    with ExperienceStore.open(str(tmp_path)) as again:
        assert again.count("solver") == 20 == again.count("solver", "consumed")
        assert sorted(again.consumer_state("solver")["seen"].tolist()) == list(range(20))


def test_put_writes_o1_bytes_in_the_number_of_rows(tmp_path):
    store = ExperienceStore(AGENTS, str(tmp_path))
    log = tmp_path / "log.jsonl"

    def written_by_put(i):
        with open("/proc/self/io") as f:
            before = dict(line.split(": ") for line in f.read().splitlines())
        size = log.stat().st_size
        store.put("solver", SampleId(i, 0, 0), version=0, payload={"value": np.int64(i)})
        with open("/proc/self/io") as f:
            after = dict(line.split(": ") for line in f.read().splitlines())
        return int(after["wchar"]) - int(before["wchar"]), log.stat().st_size - size

    early = [written_by_put(i) for i in range(1000, 1010)]
    for i in range(1010, 1400):
        store.put("solver", SampleId(i, 0, 0), version=0, payload={"value": np.int64(i)})
    late = [written_by_put(i) for i in range(1400, 1410)]
    store.close()
    # same digits in every key, so the same bytes: nothing grows with the 400 rows stored
    assert max(w for w, _ in late) <= min(w for w, _ in early) + 16, (early, late)
    assert {d for _, d in early} == {d for _, d in late} and max(d for _, d in late) < 128


def test_consumer_state_files_are_removed_after_commit(tmp_path):
    store = filled(tmp_path, n=30)
    consume_all(store, micro=1)  # 30 commits
    store.close()
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("consumer.")) == ["consumer.solver.30.npz"]


@pytest.mark.parametrize("record, expected", [
    ('{"op":"put","agent":"solver","key":"99-0-0","version":0,"status":"archived"}',
     "line 12: unknown status 'archived' for 'put'; valid: 'ready'"),
    ('{"op":"delete","agent":"solver","key":"1-0-0"}', "line 12: unknown record"),
    ('{"op":"put","agent":"critic","key":"1-0-0","version":0,"status":"ready"}',
     "line 12: unknown agent 'critic'"),
    ('{"op":"commit","agent":"solver","keys":["77-0-0"],"status":"consumed","state":null}',
     "commit of solver/77-0-0, which was never put"),
])
def test_unknown_statuses_and_records_are_rejected_at_open(tmp_path, record, expected):
    filled(tmp_path).close()
    with open(tmp_path / "log.jsonl", "a") as f:
        f.write(record + "\n")
    with pytest.raises(StoreError, match=expected.replace("(", "\\(").replace(")", "\\)")):
        ExperienceStore.open(str(tmp_path))
    with open(tmp_path / "log.jsonl") as f:  # nothing rewritten, and the lock is free again
        assert f.read().splitlines()[-1] == record
    with pytest.raises(StoreError):
        ExperienceStore.open(str(tmp_path))


def test_torn_last_record_is_dropped_and_the_rest_is_usable(tmp_path):
    filled(tmp_path).close()
    log = tmp_path / "log.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[:-20])  # the 10th put's line cut short by a crash
    with pytest.warns(UserWarning, match="dropped an incomplete last record"):
        store = ExperienceStore.open(str(tmp_path))
    assert store.count("solver", "ready") == 9  # that put never completed
    store.put("solver", SampleId(9, 0, 0), version=0, payload={"value": np.int64(9)})
    assert sorted(consume_all(store)) == list(range(10))
    store.close()
    with ExperienceStore.open(str(tmp_path)) as again:
        assert again.count("solver", "consumed") == 10


def test_damaged_index_line_missing_index_and_damaged_consumer_state_are_named(tmp_path):
    with pytest.raises(StoreError, match="log.jsonl does not exist"):
        ExperienceStore.open(str(tmp_path))
    store = filled(tmp_path)
    consume_all(store)
    store.close()
    state = tmp_path / "consumer.solver.4.npz"
    state.write_bytes(state.read_bytes()[:30])
    with pytest.raises(StoreError, match="consumer state .*consumer.solver.4.npz of agent 'solver' is unreadable"):
        ExperienceStore.open(str(tmp_path))
    lines = (tmp_path / "log.jsonl").read_bytes().split(b"\n")
    lines[3] = lines[3][:10]
    (tmp_path / "log.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(StoreError, match="log.jsonl line 4 is damaged"):
        ExperienceStore.open(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_row_file_is_reported_by_name_and_the_rest_is_usable(tmp_path, damage):
    filled(tmp_path).close()
    row = tmp_path / "rows" / "solver.4-0-0.npz"
    if damage == "truncate":
        row.write_bytes(row.read_bytes()[:25])
    else:
        row.unlink()
    with pytest.warns(UserWarning, match="row file .*solver.4-0-0.npz is damaged"):
        store = ExperienceStore.open(str(tmp_path))
    assert list(store.damaged) == [("solver", SampleId(4, 0, 0))]
    assert not store.has("solver", SampleId(4, 0, 0))
    assert sorted(consume_all(store)) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    store.put("solver", SampleId(4, 0, 0), version=0, payload={"value": np.int64(4)})  # re-produced
    assert consume_all(store) == [4]
    store.close()
    with ExperienceStore.open(str(tmp_path)) as again:
        assert again.count("solver") == 10 == again.count("solver", "consumed") and not again.damaged
