"""The job RPCs of the sharded front (front.py): a job's requests are split into contiguous parts, one
per shard, each submitted under the same job id; reads merge the parts back.

The id says how the job was split (`<hex>_<n0>_<n1>_...`: requests per shard, in shard order), so
the front needs no table of jobs: part k's request i is the job's request sum(n[:k]) + i."""
from __future__ import annotations

import queue
import re
import threading
import uuid

import grpc

from minipaged.v1 import metadata_pb2

from .workers import clip

STATES = ("queued", "running", "done", "cancelled")


def split(total: int, weights: list[int]) -> list[int]:
    """Requests per shard, proportional to `weights` (largest remainders)."""
    w = sum(weights)
    counts = [total * x // w for x in weights]
    order = sorted(range(len(weights)), key=lambda k: (-(total * weights[k] % w), k))
    for k in order[:total - sum(counts)]:
        counts[k] += 1
    return counts


def new_job_id(counts: list[int]) -> str:
    return uuid.uuid4().hex + "".join(f"_{n}" for n in counts)


def parse_job_id(job_id: str, shards: int) -> list[int] | None:
    """Requests per shard, or None when the id is not a sharded job's of this many shards."""
    parts = job_id.split("_")
    if len(parts) != shards + 1 or not all(p.isdigit() for p in parts[1:]):
        return None
    counts = [int(p) for p in parts[1:]]
    return counts if any(counts) else None          # a job has a request somewhere


def merged_state(states: list[str]) -> str:
    if "cancelled" in states:
        return "cancelled"
    if all(s == "done" for s in states):
        return "done"
    if all(s == "queued" for s in states):
        return "queued"
    return "running"


def offsets(counts: list[int]) -> list[int]:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def shift(results, offset: int) -> list:
    out = []
    for r in results:
        r = metadata_pb2.GenerationResult.FromString(r.SerializeToString()) if offset else r
        r.index += offset
        out.append(r)
    return out


def merge_jobs(job_id: str, parts: list[tuple[int, metadata_pb2.Job]], counts: list[int]) -> metadata_pb2.Job:
    """One Job from its parts [(shard, part)]: totals summed, results re-indexed and in order."""
    at = offsets(counts)
    results = [r for k, p in parts for r in shift(p.results, at[k])]
    results.sort(key=lambda r: r.index)
    return metadata_pb2.Job(job_id=job_id, state=merged_state([p.state for _, p in parts]),
                            total=sum(p.total for _, p in parts), completed=sum(p.completed for _, p in parts),
                            results=results, created=min(p.created for _, p in parts))


def _lost_part(job_id: str, k: int, counts: list[int]) -> str:
    return (f"job {clip(job_id)}: its part on shard {k} ({counts[k]} requests) is gone: that shard restarted "
            f"without a job store (--db); delete the job and submit again")


class FrontJobRpcs:
    """SubmitJob .. WatchJob of FrontServicer; uses its `shards`, `_forward` and `_each`."""

    def SubmitJob(self, request, context):
        if not request.requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a job needs at least one request")
        if request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a sharded service picks job ids itself")
        counts = split(len(request.requests), self.shards.fresh_weights())
        job_id = new_job_id(counts)
        at = offsets(counts)
        calls = {k: metadata_pb2.SubmitJobRequest(requests=request.requests[at[k]:at[k] + n], job_id=job_id)
                 for k, n in enumerate(counts) if n}
        answers = self._each(calls, "SubmitJob", context, pass_note=True)
        failed = [e for e in answers.values() if isinstance(e, grpc.RpcError)]
        if failed:  # no part may outlive a refused job: the parts that were taken are deleted
            taken = {k: metadata_pb2.JobRequest(job_id=job_id) for k, a in answers.items()
                     if not isinstance(a, grpc.RpcError)}
            self._each(taken, "DeleteJob", context)
            k, e = next((k, a) for k, a in answers.items() if isinstance(a, grpc.RpcError))
            # a shard numbers its own part's requests: the caller's index is shifted by the part's start
            details = re.sub(r"^request (\d+):", lambda m: f"request {int(m.group(1)) + at[k]}:", e.details() or "")
            context.abort(e.code(), details)
        return metadata_pb2.SubmitJobReply(job_id=job_id)

    def _parts(self, job_id: str, method: str, context) -> tuple[list, list[int]]:
        counts = parse_job_id(job_id, len(self.shards))
        if counts is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(job_id)}")
        answers = self._each({k: metadata_pb2.JobRequest(job_id=job_id) for k, n in enumerate(counts) if n},
                             method, context)
        lost = [k for k, a in answers.items() if isinstance(a, grpc.RpcError) and a.code() == grpc.StatusCode.NOT_FOUND]
        partial = 0 < len(lost) < len(answers)   # the job is known; a shard restarted without --db forgot a part
        if partial and method != "DeleteJob":    # (deleting: the parts left go)
            context.abort(grpc.StatusCode.DATA_LOSS, _lost_part(job_id, lost[0], counts))
        for k, a in answers.items():
            if isinstance(a, grpc.RpcError) and not (partial and k in lost):
                context.abort(a.code(), a.details())
        return sorted((k, a) for k, a in answers.items() if not isinstance(a, grpc.RpcError)), counts

    def GetJob(self, request, context):
        return merge_jobs(request.job_id, *self._parts(request.job_id, "GetJob", context))

    def CancelJob(self, request, context):
        return merge_jobs(request.job_id, *self._parts(request.job_id, "CancelJob", context))

    def DeleteJob(self, request, context):
        job = merge_jobs(request.job_id, *self._parts(request.job_id, "DeleteJob", context))
        del job.results[:]
        return job

    def ListJobs(self, request, context):
        if request.limit < 0 or request.limit > 10000:      # the shards' own rule, before the state filter
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be in [0, 10000], got {request.limit}")
        if request.state not in ("",) + STATES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"state {clip(request.state)} is not one of queued, running, done, cancelled")
        # a part's state is not the job's: list every state, merge, then filter
        ask = metadata_pb2.ListJobsRequest(limit=10000 if request.state else request.limit)
        answers = self._each({k: ask for k in range(len(self.shards))}, "ListJobs", context)
        parts: dict[str, list] = {}
        for k, a in sorted(answers.items()):
            if isinstance(a, grpc.RpcError):
                context.abort(a.code(), a.details())
            for j in a.jobs:
                parts.setdefault(j.job_id, []).append((k, j))
        # the total is the id's (a part a restarted shard forgot still counts: it will never complete)
        jobs = [metadata_pb2.Job(job_id=i, state=merged_state([j.state for _, j in ps]),
                                 total=sum(parse_job_id(i, len(self.shards)) or [j.total for _, j in ps]),
                                 completed=sum(j.completed for _, j in ps),
                                 created=min(j.created for _, j in ps)) for i, ps in parts.items()]
        jobs = [j for j in jobs if not request.state or j.state == request.state]
        jobs.sort(key=lambda j: -j.created)
        return metadata_pb2.JobList(jobs=jobs[:request.limit or 100])

    def CancelPendingJobs(self, request, context):
        answers = self._each({k: request for k in range(len(self.shards))}, "CancelPendingJobs", context)
        ok = [a for a in answers.values() if not isinstance(a, grpc.RpcError)]
        return metadata_pb2.CancelPendingJobsReply(jobs=sum(a.jobs for a in ok), requests=sum(a.requests for a in ok))

    def PurgeJobs(self, request, context):
        answers = self._each({k: request for k in range(len(self.shards))}, "PurgeJobs", context)
        for a in answers.values():
            if isinstance(a, grpc.RpcError):
                context.abort(a.code(), a.details())
        return metadata_pb2.PurgeJobsReply(jobs=sum(a.jobs for a in answers.values()))

    def WatchJob(self, request, context):
        counts = parse_job_id(request.job_id, len(self.shards))
        if counts is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job id {clip(request.job_id)}")
        at = offsets(counts)
        inbox: queue.Queue = queue.Queue()
        streams = {k: self.shards.stubs[k].WatchJob(metadata_pb2.JobRequest(job_id=request.job_id),
                                                    metadata=self._metadata(context))
                   for k, n in enumerate(counts) if n}
        for k, s in streams.items():
            threading.Thread(target=_pump, args=(k, s, inbox), daemon=True).start()
        latest: dict[int, metadata_pb2.JobProgress] = {}
        open_parts = set(streams)
        try:
            while open_parts and context.is_active():
                try:
                    k, msg = inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if msg is None:
                    open_parts.discard(k)
                    continue
                if isinstance(msg, grpc.RpcError):
                    if msg.code() == grpc.StatusCode.NOT_FOUND and len(streams) > 1:
                        context.abort(grpc.StatusCode.DATA_LOSS, _lost_part(request.job_id, k, counts))
                    context.abort(msg.code(), msg.details())
                latest[k] = msg
                states = [latest[i].state if i in latest else "queued" for i in streams]
                yield metadata_pb2.JobProgress(job_id=request.job_id, state=merged_state(states), total=sum(counts),
                                               completed=sum(p.completed for p in latest.values()),
                                               new_results=shift(msg.new_results, at[k]))
        finally:
            for s in streams.values():
                s.cancel()


def _pump(k: int, stream, inbox: queue.Queue) -> None:
    try:
        for msg in stream:
            inbox.put((k, msg))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            inbox.put((k, e))
    inbox.put((k, None))
