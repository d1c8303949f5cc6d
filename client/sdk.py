"""The synchronous SDK: `Client`. Result types and request building live in client/messages.py
(shared with the async client and the CLI) and are re-exported here."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Iterator, Sequence

import grpc

from minipaged.constants import DEFAULT_METADATA_ADDRESS, WAITING_KEY
from minipaged.tls import make_channel
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

from .channel import checked_seconds, checked_token, grpc_seconds
from .request import job_request
from .errors import Cancelled, ClosedStub, MiniPagedError, Unavailable, explain_unimplemented, from_rpc_error
from .messages import (CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, REQUEST_KEYS, TERMINAL_STATES,  # noqa: F401
                       Deadline, GenerateResult, JobCollector, JobStatus, PoolSnapshot, ResultAssembler, Stats,
                       StreamChunk, Usage, batch_items, build_generate_request, build_submit_request,
                       chunk_from_proto, final_only, job_from_proto, normalize_address, pool_snapshot_from_proto,
                       refuse_unstreamable, result_from_proto)

# generate([...]) runs this many requests at once by default: each open stream holds one of the
# service's RPC threads (128), so a large batch must not take them all.
MAX_BATCH_CONCURRENCY = 32


def batch_concurrency(asked: int, max_waiting: int) -> int:
    """Requests of a list in flight at once: no more than the service's queue admits (--max-waiting,
    from Stats; 0 when unknown), where more would be refused "queue full" however often retried."""
    return max(1, min(asked, max_waiting) if max_waiting > 0 else asked)
log = logging.getLogger("minipaged.client")  # warnings reach stderr even with logging unconfigured


def say_if_waiting(initial_metadata, told: threading.Event) -> None:
    """The service parks a call until its first worker registers, and says so in the initial
    metadata: tell the user (once per client), instead of a silent wait of up to --worker-wait s."""
    note = dict(initial_metadata or ()).get(WAITING_KEY)
    if note and not told.is_set():
        told.set()
        log.warning("%s", note)


class Client:
    """Blocking client of the metadata service. `timeout` is the default per-call deadline (s).

    `wait_ready=S`: calls that need a worker chain (generate, stream, submit) first wait up to S
    seconds for one (the channel to connect, then Stats().ready), and fail with Unavailable, saying
    why the service is not ready, only after that. `address` "HOST" means HOST:50051."""

    def __init__(self, address: str = DEFAULT_METADATA_ADDRESS, token: str | None = None,
                 timeout: float | None = None, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, wait_ready: float | None = None):
        self.address = normalize_address(address)
        self.timeout, self.wait_ready = checked_seconds("timeout", timeout), checked_seconds("wait_ready", wait_ready)
        self._metadata = (("authorization", f"Bearer {token}"),) if checked_token(token) else None
        # TLS when given the CA that signed the service's certificate (+ a client cert for mTLS)
        self._channel = make_channel(self.address, CHANNEL_OPTIONS, tls_ca, tls_cert, tls_key)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)
        self._told_waiting = threading.Event()  # "waiting for a worker to register" said once

    def _kw(self, timeout: float | None) -> dict:
        return {"timeout": grpc_seconds(self.timeout if timeout is None else checked_seconds("timeout", timeout)),
                "metadata": self._metadata}

    def _error(self, e: grpc.RpcError) -> MiniPagedError:
        return explain_unimplemented(from_rpc_error(e), self.address, self._channel)

    def _unary(self, method, request, timeout):
        try:
            return method(request, **self._kw(timeout))
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _await_ready(self, timeout: float | None) -> None:
        """wait_ready: poll Stats until a chain is ready, within min(wait_ready, timeout)."""
        if not self.wait_ready:
            return
        budget = self.wait_ready if timeout is None else min(self.wait_ready, timeout)
        deadline, reason = Deadline(budget), "the service did not answer"
        while True:
            try:
                st = self._stub.Stats(pb.StatsRequest(), timeout=deadline.poll(5.0),
                                      metadata=self._metadata, wait_for_ready=True)
                if st.ready:
                    return
                reason = st.not_ready_reason or "no worker chain is ready"
            except grpc.RpcError as e:
                err = self._error(e)
                if not isinstance(err, (Unavailable,)) and err.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise err from None
                reason = err.details or reason
            if deadline.expired():
                raise Unavailable(f"no ready worker chain at {self.address} after waiting {budget:g}s "
                                  f"(wait_ready): {reason}")
            time.sleep(deadline.poll(0.2))

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **params) -> Iterator[StreamChunk]:
        """Chunks as the service produces them; leaving the loop early cancels the request.
        With n > 1, chunks of the choices interleave (`chunk.index`).
        `params`: prompt_token_ids, max_new_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, logprobs (True or k alternatives; return_logprobs is an alias
        of logprobs=True), n, best_of, min_new_tokens, repetition_penalty, presence_penalty,
        frequency_penalty, min_p, structured outputs json_schema (dict or JSON text), regex, choice (list of
        str), json_object, beam_width, length_penalty, early_stopping (beam search sends its K choices
        at the end, best first), prompt_logprobs (k >= 0: every prompt token's logprob, and its k best
        alternatives, on the first chunk; max_new_tokens may then be 0) (see build_generate_request).
        best_of > n is refused (InvalidArgument)."""
        request = build_generate_request(prompt, **params)
        refuse_unstreamable(request)
        yield from self._chunks(request, timeout)

    def _chunks(self, request: pb.GenerateRequest, timeout: float | None, on_call=None) -> Iterator[StreamChunk]:
        """The Generate RPC's chunks (with best_of > n: the n winners, whole, at the end).
        `on_call(call)`: told the RPC as it starts (a batch cancels its others' RPCs on a failure)."""
        self._await_ready(timeout)
        call = self._stub.Generate(request, **self._kw(timeout))
        if on_call is not None:
            on_call(call)
        try:
            say_if_waiting(call.initial_metadata(), self._told_waiting)
            for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            call.cancel()  # no-op once finished; frees the sequence if the caller stopped early

    def generate(self, prompt: str | Sequence | None = None, *, timeout: float | None = None,
                 max_concurrency: int = MAX_BATCH_CONCURRENCY, **params):
        """One request, blocking: stream() collected into a GenerateResult (n > 1: `.choices`).
        A list of prompts (str, token-id lists or request dicts), or prompt_token_ids=[[...], ...],
        runs them concurrently and returns a list of GenerateResult in the same order; the first
        failure cancels the rest and is raised."""
        items = batch_items(prompt, params)
        if items is not None:
            return self._generate_batch(items, timeout, max_concurrency)
        acc = ResultAssembler()
        for chunk in self._chunks(final_only(build_generate_request(prompt, **params)), timeout):
            acc.add(chunk)
        return acc.result()

    def _generate_batch(self, items: list[dict], timeout, max_concurrency: int) -> list[GenerateResult]:
        for item in items:  # every type error before any RPC
            build_generate_request(**item)
        if not items:
            return []
        deadline = Deadline(self.timeout if timeout is None else checked_seconds("timeout", timeout))  # the list's
        failed = threading.Event()
        calls, lock = set(), threading.Lock()   # RPCs in flight: a failure cancels them at once (their
                                                # single final chunk may be minutes away)

        def started(call) -> None:
            with lock:
                calls.add(call)
            if failed.is_set():
                call.cancel()

        def cancel_all() -> None:
            failed.set()
            with lock:
                for call in calls:
                    call.cancel()

        def one(item: dict) -> GenerateResult:
            acc = ResultAssembler()
            if failed.is_set():
                raise Cancelled("not started: another request of the batch failed")
            try:
                for chunk in self._chunks(final_only(build_generate_request(**item)), deadline.remaining(), started):
                    acc.add(chunk)
            except MiniPagedError:
                if failed.is_set():
                    raise Cancelled("cancelled: another request of the batch failed") from None
                raise
            return acc.result()

        if len(items) > 1:   # no more in flight than the service's queue admits (--max-waiting)
            self._await_ready(deadline.remaining())      # (a starting service answers Stats only then)
            max_concurrency = batch_concurrency(max_concurrency, self._max_waiting(deadline.remaining()))
        with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(items)))) as pool:
            futures = [pool.submit(one, item) for item in items]
            try:
                wait_futures(futures, return_when=FIRST_EXCEPTION)
                first = next((f.exception() for f in futures if f.done() and f.exception()), None)
                if first is not None:
                    raise first
                results = [f.result() for f in futures]
            except BaseException:  # a failure, or Ctrl-C: the others' RPCs are cancelled now
                cancel_all()
                raise
        for i, r in enumerate(results):
            r.index = i
            for c in r.choices or []:
                c.index = i
        return results

    def _max_waiting(self, timeout) -> int:
        try:
            return self.stats(timeout=timeout).max_waiting
        except MiniPagedError:
            return 0

    def submit(self, requests: Sequence[dict], *, timeout: float | None = None) -> str:
        request = build_submit_request(requests)
        self._await_ready(timeout)
        try:    # a future: the "waiting for a worker" metadata comes before the reply
            call = self._stub.SubmitJob.future(request, **self._kw(timeout))
            say_if_waiting(call.initial_metadata(), self._told_waiting)
            return call.result().job_id
        except grpc.RpcError as e:
            raise self._error(e) from None

    def get_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(self._unary(self._stub.GetJob, job_request(job_id), timeout))

    def cancel(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(self._unary(self._stub.CancelJob, job_request(job_id), timeout))

    def list_jobs(self, limit: int = 100, state: str | None = None, *,
                  timeout: float | None = None) -> list[JobStatus]:
        """Newest first, without results; `state` filters ("queued", "running", "done", "cancelled")."""
        reply = self._unary(self._stub.ListJobs, pb.ListJobsRequest(limit=int(limit), state=state or ""), timeout)
        return [job_from_proto(j) for j in reply.jobs]

    def delete_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        """Cancel the job if unfinished, then forget it (its stored results too)."""
        return job_from_proto(self._unary(self._stub.DeleteJob, job_request(job_id), timeout))

    def cancel_pending_jobs(self, model: str | None = None, *, timeout: float | None = None) -> tuple[int, int]:
        """Cancel every unfinished job (only those admitted for `model`: its name or a fingerprint
        prefix of >= 8 hex digits); their finished results stay. Returns (jobs, requests) cancelled."""
        reply = self._unary(self._stub.CancelPendingJobs, pb.CancelPendingJobsRequest(model=model or ""), timeout)
        return reply.jobs, reply.requests

    def purge_jobs(self, older_than_s: float, *, timeout: float | None = None) -> int:
        """Delete done and cancelled jobs that finished at least `older_than_s` seconds ago."""
        return self._unary(self._stub.PurgeJobs, pb.PurgeJobsRequest(older_than_s=float(older_than_s)),
                           timeout).jobs

    def stats(self, *, timeout: float | None = None) -> Stats:
        return Stats.from_proto(self._unary(self._stub.Stats, pb.StatsRequest(), timeout))

    def pool_snapshot(self, max_blocks: int = 0, max_sequences: int = 0, *,
                      timeout: float | None = None) -> PoolSnapshot:
        """The block pool per chain, block by block (sampled with a stride past max_blocks)."""
        request = pb.PoolSnapshotRequest(max_blocks=max_blocks, max_sequences=max_sequences)
        return pool_snapshot_from_proto(self._unary(self._stub.PoolSnapshot, request, timeout))

    def wait(self, job_id: str, progress: bool = False, *,
             timeout: float | None = None) -> list[GenerateResult]:
        """Follow WatchJob until the job is finished, then GetJob once to fill any gap.
        `timeout` bounds the whole wait, not each message."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        acc = JobCollector(progress, job_id)
        try:
            while True:
                call = self._stub.WatchJob(job_request(job_id), timeout=deadline.left(),  # None: none
                                           metadata=self._metadata)
                try:
                    for msg in call:
                        acc.update(job_from_proto(msg))
                    acc.update(self.get_job(job_id, timeout=deadline.remaining()))  # the stream may end early
                except (grpc.RpcError, Unavailable) as e:
                    err = self._error(e) if isinstance(e, grpc.RpcError) else e
                    if not isinstance(err, Unavailable):
                        raise err from None
                    # the service restarted (jobs are durable): reconnect until the deadline
                    if deadline.left() is not None and deadline.left() <= 0.5:
                        raise err from None
                    time.sleep(0.5)
                    continue
                finally:
                    call.cancel()
                if acc.state in TERMINAL_STATES:
                    return acc.ordered()
                time.sleep(0.1)  # the watch ended before the job did: watch again, politely
        finally:
            acc.close()

    def close(self) -> None:
        self._stub = ClosedStub("Client")
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
