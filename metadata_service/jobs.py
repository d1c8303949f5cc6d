"""Jobs: many requests under one id, persisted in the JobStore, watched as a progress stream."""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from minipaged.v1 import metadata_pb2

from .job_store import JobStore
from .requests import result as make_result
from .requests import to_sequence
from .sequence import Sequence

log = logging.getLogger("metadata_service.jobs")


@dataclass(eq=False)
class JobState:
    job_id: str
    total: int
    state: str = "queued"
    results: dict = field(default_factory=dict)     # index -> GenerationResult
    order: list = field(default_factory=list)       # indices in finishing order (WatchJob)
    seqs: dict = field(default_factory=dict)        # index -> live Sequence
    cond: threading.Condition = field(default_factory=threading.Condition)
    created: float = 0.0

    @property
    def visible_state(self) -> str:
        """'queued' only until a chain has started one of its requests."""
        if self.state == "queued" and any(s.num_computed_tokens or s.output_token_ids for s in self.seqs.values()):
            return "running"
        return self.state

    def proto(self, with_results: bool) -> metadata_pb2.Job:
        job = metadata_pb2.Job(job_id=self.job_id, state=self.visible_state, total=self.total,
                               completed=len(self.results), created=self.created)
        if with_results:
            job.results.extend(self.results[i] for i in sorted(self.results))
        return job


class JobManager:
    def __init__(self, engine, store: JobStore):
        self.engine = engine
        self.store = store
        self.jobs: dict[str, JobState] = {}
        self.lock = threading.Lock()

    def submit(self, requests: list[metadata_pb2.GenerateRequest]) -> str:
        """Requests must already be normalised. Persisted before the id is returned."""
        job_id = uuid.uuid4().hex
        self.store.create(job_id, requests)
        self._start(job_id, len(requests), {}, list(enumerate(requests)))
        return job_id

    def resume(self) -> int:
        """After a restart: recompute every unfinished request of every unfinished job."""
        n = 0
        for job_id, pending in self.store.unfinished():
            state, total, results = self.store.job(job_id)
            self._start(job_id, total, results, pending)
            n += len(pending)
        if n:
            log.info("resumed %d unfinished requests", n)
        return n

    def _start(self, job_id, total, results, pending) -> None:
        job = JobState(job_id, total, results=dict(results), order=sorted(results),
                       created=self.store.created(job_id))
        job.state = "done" if len(results) == total else ("running" if results else "queued")
        with self.lock:
            self.jobs[job_id] = job
        for idx, req in pending:
            seq = to_sequence(req, self.engine, sink=self._on_finish, tag=(job, idx))
            job.seqs[idx] = seq
        for seq in job.seqs.values():
            self.engine.add(seq)
        if job.state == "done":
            self.store.set_state(job_id, "done")

    def _on_finish(self, seq: Sequence, event) -> None:
        """Engine thread: a job's sequence ended (finished, cancelled or failed)."""
        job, idx = seq.tag
        result = make_result(seq, event, idx, self.engine)
        self.store.save_result(job.job_id, result)
        with job.cond:
            job.seqs.pop(idx, None)
            if idx not in job.results:
                job.results[idx] = result
                job.order.append(idx)
            if job.state == "queued":
                job.state = "running"
            if len(job.results) == job.total and job.state != "cancelled":
                job.state = "done"
                self.store.set_state(job.job_id, "done")
            job.cond.notify_all()

    def get(self, job_id: str) -> JobState | None:
        with self.lock:
            job = self.jobs.get(job_id)
        if job is not None:
            return job
        row = self.store.job(job_id)  # a job finished before this process started
        if row is None:
            return None
        state, total, results = row
        return JobState(job_id, total, state=state, results=results, order=sorted(results),
                        created=self.store.created(job_id))

    def list(self, limit: int, state: str = "") -> list[metadata_pb2.Job]:
        out = []
        for job_id, created, st, total, completed in self.store.list_jobs(limit, state):
            with self.lock:
                live = self.jobs.get(job_id)
            if live is not None:
                with live.cond:
                    out.append(live.proto(with_results=False))
            else:
                out.append(metadata_pb2.Job(job_id=job_id, state=st, total=total, completed=completed,
                                            created=created))
        return out

    def delete(self, job_id: str) -> JobState | None:
        """Cancel it if unfinished, then forget it (memory and store)."""
        job = self.cancel(job_id)
        if job is None:
            return None
        with self.lock:
            self.jobs.pop(job_id, None)
        self.store.delete(job_id)
        return job

    def cancel(self, job_id: str) -> JobState | None:
        job = self.get(job_id)
        if job is None:
            return None
        with job.cond:
            if job.state in ("done", "cancelled"):
                return job
            job.state = "cancelled"
            live = list(job.seqs.values())
        self.store.set_state(job_id, "cancelled")
        for seq in live:
            self.engine.abort(seq)
        return job
