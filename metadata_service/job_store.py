"""Durable jobs: requests are written to SQLite (WAL) before SubmitJob answers, results as they finish.

After a crash the service reloads every unfinished job and recomputes its unfinished requests from
the prompt, so GetJob/WatchJob work across restarts and every result is stored exactly once."""
from __future__ import annotations

import sqlite3
import threading
import time

from minipaged.v1 import metadata_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  job_id TEXT PRIMARY KEY, created REAL NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
  job_id TEXT NOT NULL, idx INTEGER NOT NULL, request BLOB NOT NULL, result BLOB,
  PRIMARY KEY (job_id, idx));
"""


class JobStore:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def create(self, job_id: str, requests: list[metadata_pb2.GenerateRequest]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO jobs VALUES (?, ?, 'queued', ?)", (job_id, time.time(), len(requests)))
            self._db.executemany("INSERT INTO requests VALUES (?, ?, ?, NULL)",
                                 [(job_id, i, r.SerializeToString()) for i, r in enumerate(requests)])
            self._db.execute("COMMIT")

    def save_result(self, job_id: str, result: metadata_pb2.GenerationResult) -> bool:
        """Store a result once; a second save of the same index is ignored (returns False)."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE requests SET result = ? WHERE job_id = ? AND idx = ? AND result IS NULL",
                (result.SerializeToString(), job_id, result.index))
            return cur.rowcount == 1

    def set_state(self, job_id: str, state: str) -> None:
        with self._lock:
            self._db.execute("UPDATE jobs SET state = ? WHERE job_id = ?", (state, job_id))

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

    def list_jobs(self, limit: int, state: str = ""):
        """[(job_id, created, state, total, completed)], newest first."""
        q = ("SELECT j.job_id, j.created, j.state, j.total, "
             "(SELECT COUNT(*) FROM requests r WHERE r.job_id = j.job_id AND r.result IS NOT NULL) "
             "FROM jobs j" + (" WHERE j.state = ?" if state else "") + " ORDER BY j.created DESC LIMIT ?")
        with self._lock:
            return self._db.execute(q, ((state,) if state else ()) + (limit,)).fetchall()

    def delete(self, job_id: str) -> bool:
        with self._lock:
            self._db.execute("BEGIN")
            cur = self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
            self._db.execute("DELETE FROM requests WHERE job_id = ?", (job_id,))
            self._db.execute("COMMIT")
            return cur.rowcount == 1

    def created(self, job_id: str) -> float:
        with self._lock:
            row = self._db.execute("SELECT created FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return row[0] if row else 0.0

    def unfinished(self):
        """[(job_id, [(idx, GenerateRequest)])] for every job that was not done or cancelled."""
        with self._lock:
            jobs = self._db.execute("SELECT job_id FROM jobs WHERE state IN ('queued', 'running') "
                                    "ORDER BY created").fetchall()
            out = []
            for (job_id,) in jobs:
                rows = self._db.execute("SELECT idx, request FROM requests WHERE job_id = ? AND result IS NULL "
                                        "ORDER BY idx", (job_id,)).fetchall()
                out.append((job_id, [(i, metadata_pb2.GenerateRequest.FromString(b)) for i, b in rows]))
        return out

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            self._db.close()
