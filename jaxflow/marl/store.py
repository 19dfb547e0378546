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

On disk (``path``): ``rows/<agent>.<key>.npz`` per row (written to a temporary name, then
renamed), consumer states ``consumer.<agent>.<n>.npz`` (the previous one removed once the new
one is committed), and ``log.jsonl``, an append-only index: a header line, then one line per
``put`` and per ``commit`` (fsynced), so a put writes O(1) bytes however many rows the store
holds, and a crash mid-append loses only that unfinished line. One writer per store: the
``store.lock`` file is locked (``flock``) while a store object is open; a second open fails
with :class:`StoreLockedError` naming the holder. :meth:`open` rejects unknown records and
statuses, names damaged files; a damaged row file is reported (``damaged``) and its row left
out, so the producer can put it again, while the rest stays usable.

Replaying the index is idempotent: a record read twice (a duplicated line, the header
included) leaves the same state as read once. A ``put`` of a key already in the table is the
re-put of a row whose file was damaged while still unconsumed (the only way :meth:`put` takes
a key twice): the row stays "ready" with the newer of the two versions. A ``put`` of a key
already consumed is a no-op, so a consumed row is never made "ready" again; a ``commit`` marks
rows consumed whatever came before it, and the consumer state is the one named by the commit
with the highest sequence number (``seq``), wherever its line is.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from jaxflow.errors import DataError

STATUSES = ("ready", "leased", "consumed")
#: Statuses a log record may carry ("leased" is never persisted: a reopen makes it "ready").
LOGGED_STATUSES = {"put": "ready", "commit": "consumed"}
FORMAT = "jaxflow.experience/1"


class StoreError(RuntimeError):
    """The store on disk is damaged or not a store; the message names the file."""


class StoreLockedError(StoreError):
    """Another writer holds the store's lock."""


class SampleId(NamedTuple):
    """A trajectory's identity: (input, turn, trajectory within the group)."""
    input_id: int
    turn: int
    trajectory: int

    def key(self) -> str:
        """The id as a string key ``"input-turn-trajectory"``."""
        return f"{self.input_id}-{self.turn}-{self.trajectory}"


@dataclasses.dataclass
class Row:
    """One stored trajectory: its id, the policy version that produced it, its status and its arrays."""
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

    def __init__(self, agents: tuple[str, ...] | list[str], path: str | None = None, *,
                 _reopen: bool = False):
        self.agents = tuple(agents)
        bad = [a for a in self.agents if not isinstance(a, str) or not _AGENT.fullmatch(a)]
        if bad:  # agent names become file names under the store directory
            raise DataError(f"agent names {bad!r}; valid: letters, digits, '_' and '-' (file "
                            "names inside the store directory)")
        self.path = path
        self._tables: dict[str, dict[SampleId, Row]] = {a: {} for a in self.agents}
        self._consumer_state: dict[str, dict[str, np.ndarray]] = {}
        self._commit_seq = 0
        self._state_files: dict[str, str] = {}
        self._cond = threading.Condition()
        self._lock_fd: int | None = None
        self._log = None
        #: (agent, sample id) -> why its row file could not be read (found by :meth:`open`).
        self.damaged: dict[tuple[str, SampleId], str] = {}
        if path is not None:
            if not _reopen and (os.path.exists(self._log_path())
                                or os.path.exists(os.path.join(path, "meta.json"))):
                raise StoreError(f"{path} already holds an experience store; reopen it with "
                                 "ExperienceStore.open(path) or pick another directory")
            os.makedirs(os.path.join(path, "rows"), exist_ok=True)
            self._acquire_lock()
            if not _reopen:
                self._append({"format": FORMAT, "agents": list(self.agents)})

    def close(self) -> None:
        """Closes the index and releases the writer lock (also on ``with`` exit)."""
        with self._cond:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def __enter__(self) -> "ExperienceStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- producer ------------------------------------------------------------------------

    def put(self, agent: str, sample_id: SampleId, version: int,
            payload: dict[str, np.ndarray]) -> None:
        """Adds a "ready" row; a sample id may be put once per table."""
        sample_id = check_sample_id(sample_id, f"agent {agent!r}: sample id")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise DataError(f"agent {agent!r}: version {version!r} is not an int; valid: the "
                            "policy version (an int)")
        payload = {k: np.asarray(v) for k, v in payload.items()}
        with self._cond:
            table = self._table(agent)
            if sample_id in table:
                raise ValueError(f"agent {agent!r}: sample {sample_id} already stored")
            if self.path is not None:
                self._check_open()
                _save_npz(self._row_file(agent, sample_id), payload)
                self._append({"op": "put", "agent": agent, "key": sample_id.key(),
                              "version": int(version), "status": "ready"})
            self.damaged.pop((agent, sample_id), None)
            table[sample_id] = Row(sample_id, int(version), "ready", payload)
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
        """Whether ``agent``'s table holds ``sample_id``."""
        with self._cond:
            return SampleId(*map(int, sample_id)) in self._table(agent)

    def get(self, agent: str, sample_id: SampleId) -> Row:
        """The row of ``sample_id`` in ``agent``'s table (KeyError if absent)."""
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
            state = None if consumer_state is None else {k: np.asarray(v)
                                                           for k, v in consumer_state.items()}
            if self.path is not None:
                self._persist_commit(agent, [SampleId(*s) for s in sample_ids], state)
            for s in sample_ids:
                table[SampleId(*s)].status = "consumed"
            if state is not None:
                self._consumer_state[agent] = state
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
        """The trainer state last committed with ``agent``'s consumed rows, or None."""
        with self._cond:
            return self._consumer_state.get(agent)

    def count(self, agent: str, status: str | None = None, version: int | None = None) -> int:
        """Rows in ``agent``'s table, optionally only those of one status and / or version."""
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
        """Reopens a persisted store; rows leased by a stopped consumer are "ready" again.

        Raises:
          StoreLockedError: another store object (this process or another) has it open.
          StoreError: no index, an unknown record or status, a damaged consumer-state file
            (each named). A damaged row file is not an error: see ``damaged``.
        """
        log_path = os.path.join(path, "log.jsonl")
        if not os.path.exists(log_path) and os.path.exists(os.path.join(path, "meta.json")):
            raise StoreError(f"{path} holds a store in the older meta.json format, which this "
                             f"version does not read; valid: a store with {log_path}")
        if not os.path.exists(log_path):
            raise StoreError(f"{log_path} does not exist: {path!r} is not an experience store "
                             "(create one with ExperienceStore(agents, path))")
        with open(log_path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: b"" unless a crash cut an append short
        records = []
        for number, raw in enumerate(lines, 1):
            try:
                records.append(json.loads(raw))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise StoreError(f"{log_path} line {number} is damaged ({e}); the store cannot "
                                 "be reopened safely") from None
        if not records or not isinstance(records[0], dict) or records[0].get("format") != FORMAT:
            raise StoreError(f"{log_path}: the first line is not a {FORMAT} header")
        store = cls(records[0]["agents"], path, _reopen=True)
        try:
            store._replay(records[1:], log_path, records[0])
        except BaseException:
            store.close()
            raise
        store._remove_stray_files()
        if torn:  # the unfinished append of a stopped writer: it never took effect
            warnings.warn(f"{log_path}: dropped an incomplete last record ({len(torn)} bytes)",
                          stacklevel=2)
            with open(log_path, "r+b") as f:
                f.truncate(len(data) - len(torn))
        for (agent, sid), reason in store.damaged.items():
            warnings.warn(f"experience store {path}: row file {store._row_file(agent, sid)} is "
                          f"damaged ({reason}); row {agent}/{sid.key()} left out, put it again",
                          stacklevel=2)
        return store

    def _replay(self, records: list, log_path: str, header: dict) -> None:
        """Rebuilds the tables from the index records after the header (idempotent: see the
        module docstring)."""
        last_state: dict[str, tuple[int, str]] = {}  # agent -> (commit seq, state file)
        for number, rec in enumerate(records, 2):
            if rec == header:
                continue  # a duplicated header line changes nothing
            op = rec.get("op") if isinstance(rec, dict) else None
            if op not in LOGGED_STATUSES:
                raise StoreError(f"{log_path} line {number}: unknown record {rec!r}; valid ops: "
                                 f"{', '.join(LOGGED_STATUSES)}")
            status = rec.get("status")
            if status != LOGGED_STATUSES[op]:
                raise StoreError(f"{log_path} line {number}: unknown status {status!r} for "
                                 f"{op!r}; valid: {LOGGED_STATUSES[op]!r} (statuses: "
                                 f"{', '.join(STATUSES)})")
            agent = rec.get("agent")
            if agent not in self._tables:
                raise StoreError(f"{log_path} line {number}: unknown agent {agent!r}; tables: "
                                 f"{', '.join(self.agents)}")
            table = self._tables[agent]
            if op == "put":
                sid = _parse_key(rec.get("key"), log_path, number)
                version = _parse_int(rec.get("version"), "version", log_path, number)
                row = table.get(sid)
                if row is None:
                    table[sid] = Row(sid, version, "ready", None)
                elif row.status == "ready":  # a re-put after a damaged row file, or a duplicate
                    row.version = max(row.version, version)
                continue  # a put of a consumed row never makes it ready again
            keys = rec.get("keys")
            if not isinstance(keys, list):
                raise StoreError(f"{log_path} line {number}: commit without a list of 'keys' "
                                 f"({keys!r}); valid: a list of 'input-turn-trajectory' keys")
            for key in keys:
                sid = _parse_key(key, log_path, number)
                if sid not in table:
                    raise StoreError(f"{log_path} line {number}: commit of {agent}/{key}, "
                                     "which was never put")
                table[sid].status = "consumed"
            seq = _parse_int(rec.get("seq", 0), "seq", log_path, number)
            if rec.get("state") is not None:
                _check_state_name(rec["state"], agent, log_path, number)
            if rec.get("state") is not None and (agent not in last_state
                                                 or seq >= last_state[agent][0]):
                last_state[agent] = (seq, rec["state"])
            self._commit_seq = max(self._commit_seq, seq)
        for agent, table in self._tables.items():
            for sid, row in list(table.items()):
                try:
                    row.payload = _load_npz(self._row_file(agent, sid))
                except (OSError, ValueError, EOFError) as e:  # missing, truncated, not a zip
                    self.damaged[(agent, sid)] = f"{type(e).__name__}: {e}"
                    if row.status == "consumed":
                        row.payload = {}  # its experience is in the committed consumer state
                    else:
                        del table[sid]
        self._state_files = {agent: name for agent, (_, name) in last_state.items()}
        for agent, name in self._state_files.items():
            file = os.path.join(self.path, name)
            try:
                self._consumer_state[agent] = _load_npz(file)
            except (OSError, ValueError, EOFError) as e:
                raise StoreError(f"consumer state {file} of agent {agent!r} is unreadable "
                                 f"({type(e).__name__}: {e}); the rows it covers are committed, "
                                 "so this consumer cannot resume exactly once") from None

    def _table(self, agent: str) -> dict[SampleId, Row]:
        if agent not in self._tables:
            raise KeyError(f"unknown agent table {agent!r}; tables: {self.agents}")
        return self._tables[agent]

    def _row_file(self, agent: str, sample_id: SampleId) -> str:
        return os.path.join(self.path, "rows", f"{agent}.{sample_id.key()}.npz")

    def _remove_stray_files(self) -> None:
        """Consumer states no commit line names (superseded, or written by a commit that never
        reached the log) and temporary files of interrupted writes."""
        keep = set(self._state_files.values())
        for folder in (self.path, os.path.join(self.path, "rows")):
            for name in os.listdir(folder):
                stray_state = folder == self.path and name.startswith("consumer.") and name not in keep
                if stray_state or name.endswith(".tmp.npz"):
                    os.remove(os.path.join(folder, name))

    def _log_path(self) -> str:
        return os.path.join(self.path, "log.jsonl")

    def _acquire_lock(self) -> None:
        lock = os.path.join(self.path, "store.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(f"experience store {self.path} is open by another writer "
                                   f"(pid {holder}); close that store first (one writer per "
                                   "store)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise StoreError(f"experience store {self.path} is closed")

    def _append(self, record: dict) -> None:
        """One index line, flushed and fsynced before the caller's change is visible."""
        if self._log is None:
            self._log = open(self._log_path(), "ab")
        self._log.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._log.flush()
        os.fsync(self._log.fileno())

    def _persist_commit(self, agent: str, sample_ids: list[SampleId],
                        state: dict[str, np.ndarray] | None) -> None:
        """A new consumer state goes to a fresh file first, then the commit line names it (the
        commit point), then the previous state file is removed."""
        self._check_open()
        self._commit_seq += 1
        name = None
        if state is not None:
            name = f"consumer.{agent}.{self._commit_seq}.npz"
            _save_npz(os.path.join(self.path, name), state)
        self._append({"op": "commit", "agent": agent, "keys": [s.key() for s in sample_ids],
                      "status": "consumed", "state": name, "seq": self._commit_seq})
        if name is not None:
            old = self._state_files.get(agent)
            self._state_files[agent] = name
            if old is not None and old != name:
                try:
                    os.remove(os.path.join(self.path, old))
                except FileNotFoundError:
                    pass


_AGENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_KEY = re.compile(r"[0-9]{1,18}-[0-9]{1,18}-[0-9]{1,18}")


def check_sample_id(sample_id: Any, what: str = "sample id") -> SampleId:
    """``sample_id`` as a SampleId of three ints in [0, 10**18) (its key names a file);
    DataError naming ``what`` and the value otherwise (floats and bools are refused, not cast)."""
    parts = tuple(sample_id) if isinstance(sample_id, (tuple, list)) else None
    if parts is None or len(parts) != 3 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
            and 0 <= x < 10 ** 18 for x in parts):
        raise DataError(f"{what} {sample_id!r}; valid: (input, turn, trajectory), three ints in "
                        "[0, 10**18)")
    return SampleId(*map(int, parts))


def _check_state_name(name: Any, agent: str, log_path: str, number: int) -> None:
    """A commit's consumer-state file must be a name the store writes, inside its directory (a
    log line naming any other path is refused: that file is never read nor deleted)."""
    if not isinstance(name, str) or not re.fullmatch(rf"consumer\.{re.escape(agent)}\.[0-9]+\.npz",
                                                     name):
        raise StoreError(f"{log_path} line {number}: consumer state {name!r} is not a file of this "
                         f"store; valid: 'consumer.{agent}.<seq>.npz' inside the store directory")


def _parse_key(key: str, log_path: str, number: int) -> SampleId:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise StoreError(f"{log_path} line {number}: bad sample key {key!r}; valid: "
                         "'input-turn-trajectory' (three ints >= 0)")
    return SampleId(*map(int, key.split("-")))


def _parse_int(value: Any, field: str, log_path: str, number: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreError(f"{log_path} line {number}: bad {field} {value!r}; valid: an integer")
    return value


def _save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Written under a temporary name, then renamed: a reader never sees half a file."""
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def _load_npz(path: str) -> dict[str, np.ndarray]:
    import zipfile

    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    except zipfile.BadZipFile as e:
        raise ValueError(f"not a valid .npz ({e})") from None
