"""Jobs: many requests under one id, persisted in the JobStore, watched as a progress stream."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from minipaged.v1 import metadata_pb2

from .backlog import Backlog, resumed_line
from .job_store import JobStore
from .results import result as make_result
from .requests import RequestError, reprepare, to_sequence
from .sequence import Sequence

log = logging.getLogger("metadata_service.jobs")
CANCEL_SETTLE_S = 5.0   # CancelJob waits at most this for its aborted requests to report


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
    model_name: str = ""                            # the model it was admitted for
    model_fingerprint: str = ""

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
        engine.finish_batch = store.deferred     # a step's finished results: one store transaction
        self.jobs: dict[str, JobState] = {}
        self.lock = threading.Lock()
        self.cancel_command = "minipaged jobs --cancel-all"  # main() adds --address when not the default
        self._before_model: list = []     # (seq, request) made before the model was known (resumed jobs)
        engine.on_model_known.append(self._model_known)

    def submit(self, requests: list[metadata_pb2.GenerateRequest], job_id: str = "") -> str:
        """Requests must already be normalised. Persisted before the id is returned."""
        job_id = job_id or uuid.uuid4().hex
        model = (self.engine.model_name, self.engine.model_fingerprint)
        self.store.create(job_id, requests, *model)
        self._start(job_id, len(requests), {}, list(enumerate(requests)), model)
        return job_id

    def resume(self) -> int:
        """After a restart: recompute every unfinished request of every unfinished job, and say
        which model's workers they wait for."""
        n = 0
        for job_id, name, fp, pending in self.store.unfinished():
            state, total, results = self.store.job(job_id)
            self._start(job_id, total, results, pending, (name, fp))
            n += len(pending)
        for b in self.backlog():
            log.warning("%s", resumed_line(b, self.cancel_command))
        return n

    def _start(self, job_id, total, results, pending, model=("", "")) -> None:
        job = JobState(job_id, total, results=dict(results), order=sorted(results),
                       created=self.store.created(job_id), model_name=model[0], model_fingerprint=model[1])
        job.state = "done" if len(results) == total else ("running" if results else "queued")
        with self.lock:
            self.jobs[job_id] = job
        for idx, req in pending:
            seq = to_sequence(req, self.engine, sink=self._on_finish, tag=(job, idx))
            job.seqs[idx] = seq
            if not self.engine.model_known.is_set():   # parked now (they pin the model); made right later
                with self.lock:
                    self._before_model.append((seq, req))
        for seq in list(job.seqs.values()):       # a copy: the first ones may finish (and leave) meanwhile
            self.engine.add(seq)
        if job.state == "done":
            self.store.set_state(job_id, "done")

    def _model_known(self) -> None:
        """The first chain named the model: the resumed requests made without it (their grammar's
        vocabulary, EOS ids for min tokens and beams, stop strings' tokenizer) are made right before
        that chain takes them."""
        with self.lock:
            made, self._before_model = self._before_model, []
        for seq, req in made:
            if seq.status.value == "finished" or seq.abort_requested:
                continue
            try:
                reprepare(seq, req, self.engine)
            except Exception as e:  # noqa: BLE001 - one request's problem (its constraint on this model) is its own
                why = e.message if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
                log.warning("a resumed request cannot run on this model: %s", why)
                self.engine.fail_parked(seq, f"resumed on this model, the request cannot run: {why}",
                                        "INVALID_ARGUMENT")

    def _unfinished(self) -> list[JobState]:
        with self.lock:
            return [j for j in self.jobs.values() if j.state in ("queued", "running")]

    def backlog(self) -> list[Backlog]:
        """Unfinished requests per model, oldest model first."""
        by_model: dict[tuple, Backlog] = {}
        for job in self._unfinished():
            with job.cond:
                left = len(job.seqs)
            if not left:
                continue
            b = by_model.setdefault((job.model_name, job.model_fingerprint),
                                    Backlog(job.model_name, job.model_fingerprint, 0, 0, job.created))
            b.jobs, b.requests, b.oldest = b.jobs + 1, b.requests + left, min(b.oldest, job.created)
        return sorted(by_model.values(), key=lambda b: b.oldest)

    def cancel_pending(self, model: str = "") -> tuple[int, int]:
        """Cancel every unfinished job (of `model`: its name, or >= 8 leading hex digits of its
        fingerprint). Returns (jobs, requests cancelled). Finished results stay stored."""
        jobs = requests = 0
        cancelled: list[JobState] = []
        for job in self._unfinished():
            if model and job.model_name != model and not (len(model) >= 8 and job.model_fingerprint.startswith(model)):
                continue
            with job.cond:
                left = len(job.seqs)
            if self.cancel(job.job_id, settle=False) is not None:
                jobs, requests = jobs + 1, requests + left
                cancelled.append(job)
        self._settle(cancelled)
        if jobs:
            log.warning("cancelled %d unfinished job(s), %d pending requests%s", jobs, requests,
                        f" of model {model}" if model else "")
        return jobs, requests

    def purge(self, older_than_s: float) -> int:
        """Forget done and cancelled jobs that finished at least `older_than_s` ago."""
        ids = self.store.finished_before(time.time() - older_than_s)
        with self.lock:
            live = [self.jobs.get(i) for i in ids]
            # a cancelled job whose aborted sequences have not reported yet is not finished
            ids = [i for i, j in zip(ids, live) if j is None or not j.seqs]
            for i in ids:
                self.jobs.pop(i, None)
        n = self.store.delete_many(ids)
        if n:
            log.info("purged %d finished job(s) older than %.0fs", n, older_than_s)
        return n

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
        """Newest first; `state` filters on what GetJob would say (queued and running are told
        apart in memory: the store has both as unfinished, so all of those are read, then cut)."""
        unfinished = state in ("queued", "running")
        rows = self.store.list_jobs(-1 if unfinished else limit,
                                    ("queued", "running") if unfinished else ((state,) if state else ()))
        out = []
        for job_id, created, st, total, completed in rows:
            with self.lock:
                live = self.jobs.get(job_id)
            if live is not None:
                with live.cond:
                    job = live.proto(with_results=False)
            else:
                job = metadata_pb2.Job(job_id=job_id, state=st, total=total, completed=completed, created=created)
            if not state or job.state == state:
                out.append(job)
            if len(out) == limit:
                break
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

    def cancel(self, job_id: str, settle: bool = True) -> JobState | None:
        """Cancel it; with `settle`, return once every aborted request has reported (at its chain's
        next step; at most CANCEL_SETTLE_S), so a GetJob right after sees a final state whose
        results and counts add up, not a cancelled job still missing some."""
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
        if settle:
            self._settle([job])
        return job

    @staticmethod
    def _settle(jobs: list[JobState]) -> None:
        end = time.monotonic() + CANCEL_SETTLE_S
        for job in jobs:
            with job.cond:
                job.cond.wait_for(lambda: not job.seqs, timeout=max(0.0, end - time.monotonic()))
