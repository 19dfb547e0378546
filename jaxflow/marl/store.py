"""Experience store: one table per agent; every row is consumed exactly once.

A row carries its :class:`SampleId` (input, turn, trajectory), the policy version that
produced it, a status and a payload (a dict of numpy arrays, kept by reference: one ``.npz``
file per row when the store is on disk). Life of a row::

    put -> "ready" --take--> "leased" --commit--> "consumed"
                               \\--release / crash + reopen--> "ready"

``commit`` is the only transition to "consumed", and it is persisted atomically together with
the consumer's own state (e.g. its gradient accumulator), so a consumer stopped between
``take`` and ``commit`` re-takes the same rows after :meth:`ExperienceStore.open`, and a row is
never counted twice. Thread-safe; :meth:`wait_ready` blocks (with a timeout) for producers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any, NamedTuple

import numpy as np

STATUSES = ("ready", "leased", "consumed")


class SampleId(NamedTuple):
    input_id: int
    turn: int
    trajectory: int

    def key(self) -> str:
        return f"{self.input_id}-{self.turn}-{self.trajectory}"


@dataclasses.dataclass
class Row:
    sample_id: SampleId
    version: int
    status: str
    payload: dict[str, np.ndarray]


class ExperienceStore:
    """Per-agent tables of rows; optionally persisted under ``path`` (a directory).

    Args:
      agents: table names.
      path: directory for durability (None: in memory only).
    """

    def __init__(self, agents: tuple[str, ...] | list[str], path: str | None = None):
        self.agents = tuple(agents)
        self.path = path
        self._tables: dict[str, dict[SampleId, Row]] = {a: {} for a in self.agents}
        self._consumer_state: dict[str, dict[str, np.ndarray]] = {}
        self._commit_seq = 0
        self._state_files: dict[str, str] = {}
        self._cond = threading.Condition()
        if path is not None:
            os.makedirs(os.path.join(path, "rows"), exist_ok=True)

    # -- producer ------------------------------------------------------------------------

    def put(self, agent: str, sample_id: SampleId, version: int,
            payload: dict[str, np.ndarray]) -> None:
        """Adds a "ready" row; a sample id may be put once per table."""
        sample_id = SampleId(*map(int, sample_id))
        payload = {k: np.asarray(v) for k, v in payload.items()}
        with self._cond:
            table = self._table(agent)
            if sample_id in table:
                raise ValueError(f"agent {agent!r}: sample {sample_id} already stored")
            if self.path is not None:
                np.savez(self._row_file(agent, sample_id), **payload)
            table[sample_id] = Row(sample_id, int(version), "ready", payload)
            self._persist()
            self._cond.notify_all()

    # -- consumer ------------------------------------------------------------------------

    def take(self, agent: str, n: int, *, version: int | None = None) -> list[Row]:
        """Leases up to ``n`` ready rows (of ``version`` when given), in insertion order."""
        with self._cond:
            rows = [r for r in self._table(agent).values() if r.status == "ready"
                    and (version is None or r.version == version)][:n]
            for r in rows:
                r.status = "leased"
            return rows

    def take_ids(self, agent: str, sample_ids: list[SampleId], timeout: float) -> list[Row] | None:
        """Waits until every row in ``sample_ids`` is "ready", then leases them and returns
        them in the given order; None after ``timeout`` seconds (nothing leased)."""
        ids = [SampleId(*map(int, s)) for s in sample_ids]
        with self._cond:
            table = self._table(agent)
            for s in ids:
                if s in table and table[s].status != "ready":
                    raise ValueError(f"agent {agent!r}: row {s} is {table[s].status!r}, "
                                     "cannot take it again")
            if not self._cond.wait_for(lambda: all(s in table and table[s].status == "ready"
                                                   for s in ids), timeout):
                return None
            rows = [table[s] for s in ids]
            for r in rows:
                r.status = "leased"
            return rows

    def has(self, agent: str, sample_id: SampleId) -> bool:
        with self._cond:
            return SampleId(*map(int, sample_id)) in self._table(agent)

    def get(self, agent: str, sample_id: SampleId) -> Row:
        with self._cond:
            return self._table(agent)[SampleId(*map(int, sample_id))]

    def commit(self, agent: str, sample_ids: list[SampleId],
               consumer_state: dict[str, Any] | None = None) -> None:
        """Marks leased rows consumed and stores ``consumer_state``, atomically on disk."""
        with self._cond:
            table = self._table(agent)
            for s in sample_ids:
                row = table.get(SampleId(*s))
                if row is None or row.status != "leased":
                    raise ValueError(f"agent {agent!r}: cannot commit {s}: status "
                                     f"{None if row is None else row.status!r}, need 'leased'")
            for s in sample_ids:
                table[SampleId(*s)].status = "consumed"
            if consumer_state is not None:
                self._consumer_state[agent] = {k: np.asarray(v)
                                               for k, v in consumer_state.items()}
            self._persist(state_agent=agent if consumer_state is not None else None)
            self._cond.notify_all()

    def release(self, agent: str, sample_ids: list[SampleId]) -> None:
        """Returns leased rows to "ready" (a consumer giving up without consuming)."""
        with self._cond:
            for s in sample_ids:
                row = self._table(agent)[SampleId(*s)]
                if row.status == "leased":
                    row.status = "ready"
            self._cond.notify_all()

    def consumer_state(self, agent: str) -> dict[str, np.ndarray] | None:
        with self._cond:
            return self._consumer_state.get(agent)

    def count(self, agent: str, status: str | None = None, version: int | None = None) -> int:
        if status is not None and status not in STATUSES:
            raise ValueError(f"unknown status {status!r}; valid: {STATUSES}")
        with self._cond:
            return sum(1 for r in self._table(agent).values()
                       if (status is None or r.status == status)
                       and (version is None or r.version == version))

    def wait_ready(self, agent: str, version: int | None, timeout: float) -> bool:
        """Blocks until a ready row (of ``version``) exists; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(
                lambda: any(r.status == "ready" and (version is None or r.version == version)
                            for r in self._table(agent).values()), timeout)

    # -- durability ----------------------------------------------------------------------

    @classmethod
    def open(cls, path: str) -> "ExperienceStore":
        """Reopens a persisted store; rows leased by a stopped consumer are "ready" again."""
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        store = cls(meta["agents"], path)
        store._commit_seq = meta["commit_seq"]
        for agent, rows in meta["tables"].items():
            for key, version, status in rows:
                sid = SampleId(*map(int, key.split("-")))
                with np.load(store._row_file(agent, sid)) as z:
                    payload = {k: z[k] for k in z.files}
                store._tables[agent][sid] = Row(sid, version,
                                                "ready" if status == "leased" else status,
                                                payload)
        store._state_files = dict(meta["consumer_state"])
        for agent, name in meta["consumer_state"].items():
            with np.load(os.path.join(path, name)) as z:
                store._consumer_state[agent] = {k: z[k] for k in z.files}
        return store

    def _table(self, agent: str) -> dict[SampleId, Row]:
        if agent not in self._tables:
            raise KeyError(f"unknown agent table {agent!r}; tables: {self.agents}")
        return self._tables[agent]

    def _row_file(self, agent: str, sample_id: SampleId) -> str:
        return os.path.join(self.path, "rows", f"{agent}.{sample_id.key()}.npz")

    def _persist(self, state_agent: str | None = None) -> None:
        """meta.json written to a temp file then renamed (atomic); a new consumer state goes to
        a fresh file first, so meta.json only ever names complete files."""
        if self.path is None:
            return
        self._commit_seq += 1
        if state_agent is not None:
            name = f"consumer.{state_agent}.{self._commit_seq}.npz"
            np.savez(os.path.join(self.path, name), **self._consumer_state[state_agent])
            self._state_files[state_agent] = name
        files = self._state_files
        meta = {"agents": list(self.agents), "commit_seq": self._commit_seq,
                "tables": {a: [[r.sample_id.key(), r.version, r.status] for r in t.values()]
                           for a, t in self._tables.items()},
                "consumer_state": {a: files[a] for a in files}}
        tmp = os.path.join(self.path, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(self.path, "meta.json"))
