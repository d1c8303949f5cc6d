"""The job RPCs of MetadataServicer (api.py): submit, watch, list, cancel, delete, purge.

A mixin of the servicer: admission (`_admit`, `_done`, --max-waiting) lives in api.py, the jobs
themselves in JobManager (jobs.py). Every handler validates before it changes anything."""
from __future__ import annotations

import math
import re
import sqlite3
import threading

import grpc

from minipaged.v1 import metadata_pb2

from .requests import RequestError
from .workers import clip

JOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class JobRpcs:
    """SubmitJob .. WatchJob; uses the servicer's `jobs`, `_admit` and `_done`."""

    def SubmitJob(self, request, context):
        if not request.requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one request")
        self._check_job_id(request.job_id, context)
        try:
            reqs = self._admit(request.requests, context)
        except RequestError as e:  # pragma: no cover - _admit aborts
            context.abort(e.code, e.message)
        if not context.is_active():      # gone while parked or checked: no job it never got the id of
            self._done(len(reqs))
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away before the job was created")
        try:
            job_id = self.jobs.submit(reqs, request.job_id)
        except sqlite3.IntegrityError:  # the same id submitted twice at once: the store keeps the first
            self._done(len(reqs))
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"job id {clip(request.job_id)} is taken")
        job = self.jobs.get(job_id)
        threading.Thread(target=self._release_when_done, args=(job,), daemon=True).start()
        return metadata_pb2.SubmitJobReply(job_id=job_id)

    def _check_job_id(self, job_id: str, context) -> None:
        """A caller-chosen id (the sharded front's): well-formed and unused."""
        if not job_id:
            return
        if not JOB_ID.fullmatch(job_id):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"job id {clip(job_id)} must be 1-128 letters, digits, '_' or '-'")
        if self.jobs.get(job_id) is not None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"job id {clip(job_id)} is taken")

    def _release_when_done(self, job) -> None:
        with job.cond:
            job.cond.wait_for(lambda: len(job.results) == job.total or job.state == "cancelled")
        self._done(job.total)

    def _job(self, job_id, context):
        job = self.jobs.get(job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(job_id)}")
        return job

    def GetJob(self, request, context):
        job = self._job(request.job_id, context)
        with job.cond:
            return job.proto(with_results=True)

    def CancelJob(self, request, context):
        return self._answer(self.jobs.cancel(request.job_id), request.job_id, context, with_results=True)

    @staticmethod
    def _answer(job, job_id: str, context, with_results: bool):
        """The job as it is now, or NOT_FOUND."""
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(job_id)}")
        with job.cond:
            return job.proto(with_results=with_results)

    def ListJobs(self, request, context):
        if request.limit < 0 or request.limit > 10000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be in [0, 10000], got {request.limit}")
        if request.state not in ("", "queued", "running", "done", "cancelled"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"state {clip(request.state)} is not one of queued, running, done, cancelled")
        return metadata_pb2.JobList(jobs=self.jobs.list(request.limit or 100, request.state))

    def CancelPendingJobs(self, request, context):
        model = request.model.strip()
        jobs, requests = self.jobs.cancel_pending(model)
        return metadata_pb2.CancelPendingJobsReply(jobs=jobs, requests=requests)

    def PurgeJobs(self, request, context):
        age = request.older_than_s
        if not math.isfinite(age) or age <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"older_than_s must be a number of seconds > 0, got {age}")
        return metadata_pb2.PurgeJobsReply(jobs=self.jobs.purge(age))

    def DeleteJob(self, request, context):
        return self._answer(self.jobs.delete(request.job_id), request.job_id, context, with_results=False)

    def WatchJob(self, request, context):
        job = self._job(request.job_id, context)
        sent = 0
        while context.is_active():
            with job.cond:
                job.cond.wait_for(lambda: len(job.order) > sent or self._settled(job), timeout=0.5)
                new = [job.results[i] for i in job.order[sent:]]
                sent += len(new)
                final = self._settled(job) and sent == len(job.order)
                msg = metadata_pb2.JobProgress(job_id=job.job_id, state=job.visible_state, total=job.total,
                                               completed=len(job.results), new_results=new)
            if new or final:
                yield msg
            if final:
                return

    @staticmethod
    def _settled(job) -> bool:
        """Done, or cancelled with every aborted sequence's partial result in."""
        return job.state in ("done", "cancelled") and not job.seqs
