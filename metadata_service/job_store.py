"""Durable jobs: requests are written to SQLite (WAL) before SubmitJob answers, results as they finish.

After a crash the service reloads every unfinished job and recomputes its unfinished requests from
the prompt, so GetJob/WatchJob work across restarts and every result is stored exactly once.

Durability is asked for (`--db PATH`); without it the store lives in memory and dies with the
process, so unrelated runs never adopt each other's pending work. A file store belongs to one
process at a time: exclusive flocks on the database file (whatever link names it) and on
`REALPATH.lock`, held for the process's life (the kernel drops them when the process dies, even by
kill -9); the lock file names its holder for whoever comes second. Another application's SQLite
file is refused untouched; a request row that no longer parses ends with an error result."""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import socket
import sqlite3
import threading
import logging
import time

from minipaged.v1 import metadata_pb2

log = logging.getLogger("metadata_service.job_store")

MEMORY = ":memory:"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
  job_id TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL, result BLOB,
  PRIMARY KEY (job_id, idx));
"""
# added after the first release: stores written before them get them on open (old jobs: '' / NULL)
_ADDED_COLUMNS = (("model_name", "TEXT NOT NULL DEFAULT ''"), ("model_fingerprint", "TEXT NOT NULL DEFAULT ''"),
                  ("finished", "REAL"))
UNFINISHED = ("queued", "running")


class JobStoreError(Exception):
    """The store cannot be opened: one line that names the file and says what to do."""


def _lock(path: str, owner: str) -> tuple:
    """Take the store for this process's life, or raise naming the process that holds it: an
    exclusive flock on the database file itself (one inode, whatever name a symlink or hard link
    gives it) and on REALPATH.lock, which holds the owner's words for whoever comes second."""
    real = os.path.realpath(path)
    lock_path = real + ".lock"
    handles = []
    for name, mode in ((lock_path, "a+"), (real, "ab")):   # (an empty file: SQLite makes a new store of it)
        try:
            handles.append(open(name, mode))
        except OSError as e:
            for h in handles:
                h.close()
            raise JobStoreError(f"--db {path}: cannot open {name} ({e.strerror}); give a writable location") from None
    f, db = handles
    for handle in (f, db):
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process (through another name of the same file)"
            f.close()
            db.close()
            raise JobStoreError(f"job store {path} is in use by {holder} (lock {lock_path}); stop that service, "
                                f"or give this one another --db (or none: an in-memory store)") from None
    _write_owner(f, owner)
    return f, db


def _write_owner(f, owner: str) -> None:
    f.seek(0)
    f.truncate()
    f.write(owner)
    f.flush()


class JobStore:
    def __init__(self, path: str = MEMORY, owner: str = ""):
        """`path` "" or ":memory:": a store in memory. `owner`: who holds the lock, in words."""
        self.path = path or MEMORY
        self.durable = self.path != MEMORY
        self._lock = threading.Lock()
        self._batch = threading.local()            # .ops: writes deferred by `deferred()`
        self._lockfile = None
        if self.durable:
            folder = os.path.dirname(os.path.abspath(self.path))
            if not os.path.isdir(folder):
                raise JobStoreError(f"--db {self.path}: the directory {folder} does not exist (create it first)")
            if os.path.isdir(self.path):
                raise JobStoreError(f"--db {self.path} is a directory; give a file path, e.g. {self.path}/jobs.db")
            self._lockfile = _lock(self.path, owner or f"pid {os.getpid()} on {socket.gethostname()}")
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._refuse_foreign()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            self._migrate()
        except sqlite3.Error as e:
            self._release()
            raise JobStoreError(f"--db {self.path} is not a usable SQLite job store ({e})") from None

    def _refuse_foreign(self) -> None:
        """Another application's SQLite database is left as it was (no WAL switch, no tables added)."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables - {"jobs", "meta", "requests"}:
            self._db.close()
            raise sqlite3.DatabaseError(f"a SQLite database of something else (tables: {', '.join(sorted(tables))}); "
                                        f"nothing was changed: give a new path")

    def _migrate(self) -> None:
        cols = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if not {"job_id", "created", "state", "total"} <= cols:
            raise sqlite3.DatabaseError("a SQLite file, but its jobs table is not MiniPaged's")
        for name, decl in _ADDED_COLUMNS:
            if name not in cols:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")

    def set_owner(self, owner: str) -> None:
        """Rewrite the lock file's words (the port is known only once bound)."""
        if self._lockfile is not None:
            _write_owner(self._lockfile[0], owner)

    def create(self, job_id: str, requests: list[metadata_pb2.GenerateRequest], model_name: str = "",
               model_fingerprint: str = "") -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:  # a taken id (a caller-chosen one) leaves the store as it was
                self._db.execute("INSERT INTO jobs (job_id, created, state, total, model_name, model_fingerprint) "
                                 "VALUES (?, ?, 'queued', ?, ?, ?)",
                                 (job_id, time.time(), len(requests), model_name, model_fingerprint))
                self._db.executemany("INSERT INTO requests VALUES (?, ?, ?, NULL)",
                                     [(job_id, i, r.SerializeToString()) for i, r in enumerate(requests)])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextlib.contextmanager
    def deferred(self):
        """Result and state writes this thread makes inside go to the file in one transaction at the
        end: a step that finishes many requests costs one commit, not one per request (each commit
        is a write to the WAL). Nested uses join the outer one."""
        if getattr(self._batch, "ops", None) is not None:
            yield
            return
        self._batch.ops = []
        try:
            yield
        finally:
            ops, self._batch.ops = self._batch.ops, None
            if ops:
                with self._lock:
                    self._db.execute("BEGIN")
                    for sql, group in itertools.groupby(ops, key=lambda op: op[0]):   # runs of one statement
                        self._db.executemany(sql, [args for _, args in group])
                    self._db.execute("COMMIT")

    def _write(self, sql: str, args: tuple):
        """Execute now, or queue inside `deferred()` (then None)."""
        ops = getattr(self._batch, "ops", None)
        if ops is not None:
            ops.append((sql, args))
            return None
        with self._lock:
            return self._db.execute(sql, args)

    def save_result(self, job_id: str, result: metadata_pb2.GenerationResult) -> bool:
        """Store a result once; a second save of the same index is ignored (returns False; inside
        `deferred()` the answer is not known yet: True)."""
        cur = self._write("UPDATE requests SET result = ? WHERE job_id = ? AND idx = ? AND result IS NULL",
                          (result.SerializeToString(), job_id, result.index))
        return cur is None or cur.rowcount == 1

    def set_state(self, job_id: str, state: str) -> None:
        finished = None if state in UNFINISHED else time.time()
        self._write("UPDATE jobs SET state = ?, finished = ? WHERE job_id = ?", (state, finished, job_id))

    def job(self, job_id: str):
        """(state, total, {index: GenerationResult}) or None."""
        with self._lock:
            row = self._db.execute("SELECT state, total FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            rows = self._db.execute("SELECT idx, result FROM requests WHERE job_id = ? AND result IS NOT NULL",
                                    (job_id,)).fetchall()
        results = {i: metadata_pb2.GenerationResult.FromString(b) for i, b in rows}
        return row[0], row[1], results

    def list_jobs(self, limit: int, states: tuple[str, ...] = ()):
        """[(job_id, created, state, total, completed)], newest first; `states`: only those (the
        column says queued for every unfinished job: running is known in memory)."""
        where = f" WHERE j.state IN ({', '.join('?' * len(states))})" if states else ""
        q = ("SELECT j.job_id, j.created, j.state, j.total, "
             "(SELECT COUNT(*) FROM requests r WHERE r.job_id = j.job_id AND r.result IS NOT NULL) "
             "FROM jobs j" + where + " ORDER BY j.created DESC LIMIT ?")
        with self._lock:
            return self._db.execute(q, tuple(states) + (limit,)).fetchall()

    def delete(self, job_id: str) -> bool:
        return self.delete_many([job_id]) == 1

    def delete_many(self, job_ids: list[str]) -> int:
        """Jobs with their requests and results, in one transaction (all or none)."""
        with self._lock:
            self._db.execute("BEGIN")
            n = 0
            for job_id in job_ids:
                n += self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,)).rowcount
                self._db.execute("DELETE FROM requests WHERE job_id = ?", (job_id,))
            self._db.execute("COMMIT")
            return n

    def finished_before(self, cutoff: float) -> list[str]:
        """Done or cancelled jobs that finished before `cutoff` (unix time; jobs stored before the
        finished column: by submission time)."""
        with self._lock:
            rows = self._db.execute("SELECT job_id FROM jobs WHERE state IN ('done', 'cancelled') "
                                    "AND COALESCE(finished, created) < ?", (cutoff,)).fetchall()
        return [r[0] for r in rows]

    def created(self, job_id: str) -> float:
        with self._lock:
            row = self._db.execute("SELECT created FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return row[0] if row else 0.0

    def unfinished(self):
        """[(job_id, model_name, model_fingerprint, [(idx, GenerateRequest)])] for every job that was
        not done or cancelled, oldest first. Jobs stored before the model columns: the store's model."""
        default = (self.get_meta("model_name") or "", self.get_meta("model_fingerprint") or "")
        with self._lock:
            jobs = self._db.execute("SELECT job_id, model_name, model_fingerprint FROM jobs "
                                    "WHERE state IN ('queued', 'running') ORDER BY created").fetchall()
            out = []
            for job_id, name, fp in jobs:
                rows = self._db.execute("SELECT idx, request FROM requests WHERE job_id = ? AND result IS NULL "
                                        "ORDER BY idx", (job_id,)).fetchall()
                out.append((job_id, name or default[0], fp or default[1], self._readable(job_id, rows)))
        return out

    def _readable(self, job_id: str, rows) -> list:
        """[(idx, GenerateRequest)]; a row that no longer parses (a damaged file) gets its result at
        once, an error, so its job can finish and the service start (caller holds the lock)."""
        out = []
        for i, blob in rows:
            try:
                out.append((i, metadata_pb2.GenerateRequest.FromString(blob)))
            except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
                log.warning("job %s request %d in %s is damaged (%s): it ends with an error", job_id, i, self.path, e)
                bad = metadata_pb2.GenerationResult(index=i, finish_reason="error",
                                                    error=f"this request was damaged in the job store ({e})")
                self._db.execute("UPDATE requests SET result = ? WHERE job_id = ? AND idx = ?",
                                 (bad.SerializeToString(), job_id, i))
        return out

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def _release(self) -> None:
        if self._lockfile is not None:
            for handle in self._lockfile:   # closing the descriptors drops the flocks
                handle.close()
            self._lockfile = None

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._release()
