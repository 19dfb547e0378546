"""Replaying the experience store's index is idempotent: a duplicated line (a put, a commit, the
header, or every line) reopens to the same state as the original, and no row is consumed
twice."""

import numpy as np
import pytest

from jaxflow.marl.store import ExperienceStore, SampleId, StoreError
from tests.test_marl_store_faults import AGENTS, consume_all, filled


def state_of(path):
    """Every table's rows (key, version, status) and consumer state of the store at ``path``."""
    with ExperienceStore.open(str(path)) as store:
        rows = {a: sorted((r.sample_id.key(), r.version, r.status)
                          for r in store._tables[a].values()) for a in AGENTS}
        states = {a: None if store.consumer_state(a) is None
                  else store.consumer_state(a)["seen"].tolist() for a in AGENTS}
        return rows, states, store._commit_seq


def half_consumed(path):
    """10 rows put, the first 6 taken and committed (two commits of 3), the other 4 ready."""
    store = filled(path)
    seen = []
    for _ in range(2):
        rows = store.take("solver", 3)
        seen += [int(r.payload["value"]) for r in rows]
        store.commit("solver", [r.sample_id for r in rows], {"seen": np.asarray(seen)})
    store.close()
    return (path / "log.jsonl").read_text().splitlines(keepends=True)


def write_log(path, lines):
    (path / "log.jsonl").write_text("".join(lines))


def test_duplicated_put_after_its_commit_does_not_resurrect_the_row(tmp_path):
    lines = half_consumed(tmp_path)
    original = state_of(tmp_path)
    put_of_0 = next(line for line in lines if '"key":"0-0-0"' in line)
    write_log(tmp_path, lines + [put_of_0])  # the put of a consumed row, seen again
    assert state_of(tmp_path) == original
    with ExperienceStore.open(str(tmp_path)) as store:
        assert store.get("solver", SampleId(0, 0, 0)).status == "consumed"
        assert store.count("solver", "consumed") == 6 and store.count("solver", "ready") == 4
        assert sorted(consume_all(store, seen=list(store.consumer_state("solver")["seen"]))) \
            == [6, 7, 8, 9]  # the rest, each once; row 0 is not handed out again


def test_duplicated_commit_line_anywhere_keeps_the_newest_consumer_state(tmp_path):
    lines = half_consumed(tmp_path)
    original = state_of(tmp_path)
    first_commit = next(line for line in lines if '"op":"commit"' in line)
    write_log(tmp_path, lines + [first_commit])  # an older commit repeated after a newer one
    assert state_of(tmp_path) == original
    assert original[1]["solver"] == [0, 1, 2, 3, 4, 5]  # the second commit's state, not the first's
    last_commit = [line for line in lines if '"op":"commit"' in line][-1]
    write_log(tmp_path, lines + [last_commit, last_commit])
    assert state_of(tmp_path) == original


def test_every_line_duplicated_replays_to_the_original_state(tmp_path):
    lines = half_consumed(tmp_path)
    original = state_of(tmp_path)
    write_log(tmp_path, [line for line in lines for _ in range(2)])  # header included
    assert state_of(tmp_path) == original
    write_log(tmp_path, lines + lines)  # the whole log appended to itself
    assert state_of(tmp_path) == original
    with ExperienceStore.open(str(tmp_path)) as store:
        seen = list(store.consumer_state("solver")["seen"])
        consume_all(store, seen=seen)
        assert sorted(seen) == list(range(10))  # every row consumed exactly once
        assert store.count("solver", "consumed") == 10


def test_re_put_of_a_damaged_row_keeps_the_newer_version_even_if_duplicated(tmp_path):
    filled(tmp_path).close()
    (tmp_path / "rows" / "solver.4-0-0.npz").unlink()
    with pytest.warns(UserWarning, match="solver.4-0-0.npz is damaged"):
        store = ExperienceStore.open(str(tmp_path))
    store.put("solver", SampleId(4, 0, 0), version=3, payload={"value": np.int64(4)})
    store.close()
    lines = (tmp_path / "log.jsonl").read_text().splitlines(keepends=True)
    old_put = next(line for line in lines if '"key":"4-0-0","version":0' in line)
    write_log(tmp_path, lines + [old_put])  # the version-0 put seen again after the re-put
    with ExperienceStore.open(str(tmp_path)) as store:
        row = store.get("solver", SampleId(4, 0, 0))
        assert (row.version, row.status, int(row.payload["value"])) == (3, "ready", 4)
        assert store.count("solver", "ready") == 10 and store.count("solver", version=3) == 1


def test_a_record_with_a_bad_version_is_named(tmp_path):
    lines = half_consumed(tmp_path)
    bad = '{"op":"put","agent":"solver","key":"99-0-0","version":"x","status":"ready"}\n'
    write_log(tmp_path, lines + [bad])
    with pytest.raises(StoreError, match=f"line {len(lines) + 1}: bad version 'x'; valid: an integer"):
        ExperienceStore.open(str(tmp_path))
