"""The asyncio SDK: `AsyncClient`, the same surface as `Client` on grpc.aio.

Types, request building and job-result assembly are shared with the sync client (client.messages), so
the two cannot drift apart."""
from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing
from typing import AsyncIterator, Sequence

import grpc
import grpc.aio

from minipaged.constants import DEFAULT_METADATA_ADDRESS
from minipaged.tls import channel_credentials, make_channel
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

from .channel import checked_seconds, checked_token, grpc_seconds
from .request import job_request
from .errors import (Cancelled, ClosedStub, MiniPagedError, Unavailable, explain_not_grpc, explain_unimplemented,
                     from_rpc_error)
from .messages import (CHANNEL_OPTIONS, TERMINAL_STATES, Deadline, GenerateResult, JobCollector, JobStatus,
                       PoolSnapshot, ResultAssembler, Stats, StreamChunk, batch_items, build_generate_request,
                       build_submit_request, chunk_from_proto, final_only, job_from_proto, normalize_address,
                       pool_snapshot_from_proto, refuse_unstreamable)
from .sdk import MAX_BATCH_CONCURRENCY, batch_concurrency, say_if_waiting

# Generate streams one AsyncClient keeps open at once; more wait here, in order. Thousands at once on
# one channel had gRPC end some CANCELLED, which nobody asked for (338 of 3,000 tiny requests).
MAX_OPEN_STREAMS = 512


class AsyncClient:
    """Non-blocking client. Create it inside a running event loop (grpc.aio binds to it).
    `wait_ready` and the address rules are those of `Client`."""

    def __init__(self, address: str = DEFAULT_METADATA_ADDRESS, token: str | None = None,
                 timeout: float | None = None, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, wait_ready: float | None = None):
        self.address = normalize_address(address)
        self.timeout, self.wait_ready = checked_seconds("timeout", timeout), checked_seconds("wait_ready", wait_ready)
        self._metadata = (("authorization", f"Bearer {token}"),) if checked_token(token) else None
        self._tls = (tls_ca, tls_cert, tls_key)
        self._creds = channel_credentials(tls_ca, tls_cert, tls_key)   # a bad file: refused here
        self._told_waiting = threading.Event()   # "waiting for a worker to register" said once
        self._loop = self._channel = self._live_stub = None   # made in the loop that first calls
        self._stream_slots: asyncio.Semaphore | None = None
        self._closed = False

    @property
    def _stub(self):
        """The stub of this event loop's channel. A grpc.aio channel belongs to one loop: it is made
        on first use (an AsyncClient built outside any loop works), and made again when that loop
        has closed (asyncio.run twice)."""
        if self._closed:
            return ClosedStub("AsyncClient")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("this AsyncClient's calls run in another event loop (another thread's): "
                                   "make one AsyncClient per loop")
            # the old loop has stopped: its channel cannot be closed from here and is dropped
            self._channel = (grpc.aio.secure_channel(self.address, self._creds, options=CHANNEL_OPTIONS)
                             if self._creds else grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS))
            self._live_stub, self._loop = pb_grpc.MetadataServiceStub(self._channel), loop
            self._stream_slots = asyncio.Semaphore(MAX_OPEN_STREAMS)
        return self._live_stub

    def _kw(self, timeout: float | None) -> dict:
        return {"timeout": grpc_seconds(self.timeout if timeout is None else checked_seconds("timeout", timeout)),
                "metadata": self._metadata}

    async def _error(self, e: grpc.RpcError) -> MiniPagedError:
        err = explain_not_grpc(from_rpc_error(e), self.address)  # AioRpcError is a grpc.RpcError
        if err.code != grpc.StatusCode.UNIMPLEMENTED:
            return err

        def probe():  # the health probe is a blocking call: keep it off the event loop
            with make_channel(self.address, CHANNEL_OPTIONS, *self._tls) as ch:
                return explain_unimplemented(err, self.address, ch)
        return await asyncio.get_running_loop().run_in_executor(None, probe)

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, **self._kw(timeout))
        except grpc.RpcError as e:
            raise (await self._error(e)) from None
        except asyncio.CancelledError:
            if self._closed_under():
                raise Cancelled("the AsyncClient was closed while this call ran") from None
            raise

    async def _await_ready(self, timeout: float | None) -> None:
        if not self.wait_ready:
            return
        budget = self.wait_ready if timeout is None else min(self.wait_ready, timeout)
        deadline, reason = Deadline(budget), "the service did not answer"
        while True:
            try:
                st = await self._stub.Stats(pb.StatsRequest(), timeout=deadline.poll(5.0),
                                            metadata=self._metadata, wait_for_ready=True)
                if st.ready:
                    return
                reason = st.not_ready_reason or "no worker chain is ready"
            except grpc.RpcError as e:
                err = await self._error(e)
                if not isinstance(err, Unavailable) and err.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise err from None
                reason = err.details or reason
            if deadline.expired():
                raise Unavailable(f"no ready worker chain at {self.address} after waiting {budget:g}s "
                                  f"(wait_ready): {reason}")
            await asyncio.sleep(deadline.poll(0.2))

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                     **params) -> AsyncIterator[StreamChunk]:
        """Async iterator of chunks; leaving the loop early (aclose), or cancelling the task that
        iterates, cancels the request and frees its blocks. best_of > n is refused (InvalidArgument)."""
        request = build_generate_request(prompt, **params)
        refuse_unstreamable(request)
        async with aclosing(self._chunks(request, timeout)) as inner:  # cancels the RPC now, not at GC
            async for chunk in inner:
                yield chunk

    async def chunks(self, prompt: str | None = None, *, timeout: float | None = None, whole: bool = False,
                     **params) -> AsyncIterator[StreamChunk]:
        """As stream(), but best_of > n is allowed: its n winners arrive whole at the end (what
        generate() and the gateway's non-streaming path read). `whole`: no chunk per token, one per
        choice at its end (GenerateRequest.final_only: what a caller that waits for the end wants)."""
        request = build_generate_request(prompt, **params)
        async with aclosing(self._chunks(final_only(request) if whole else request, timeout)) as inner:
            async for chunk in inner:
                yield chunk

    async def _chunks(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncIterator[StreamChunk]:
        await self._await_ready(timeout)
        generate = self._stub.Generate      # (binds this loop's channel and its stream slots; Cancelled when closed)
        async with self._stream_slots:
            call = generate(request, **self._kw(timeout))
            try:
                say_if_waiting(await call.initial_metadata(), self._told_waiting)
                async for chunk in call:
                    yield chunk_from_proto(chunk)
            except grpc.RpcError as e:
                raise (await self._error(e)) from None
            except asyncio.CancelledError:
                if self._closed_under():
                    raise Cancelled("the AsyncClient was closed while this call ran") from None
                raise
            finally:
                call.cancel()

    async def generate(self, prompt: str | Sequence | None = None, *, timeout: float | None = None,
                       max_concurrency: int = MAX_BATCH_CONCURRENCY, **params):
        """As Client.generate: one result, or a list of them for a list of prompts (run
        concurrently; the first failure cancels the rest)."""
        items = batch_items(prompt, params)
        if items is not None:
            for item in items:  # every type error before any RPC
                build_generate_request(**item)
            deadline = Deadline(self.timeout if timeout is None else checked_seconds("timeout", timeout))
            if len(items) > 1:   # (as Client's: no more in flight than the service's queue admits)
                await self._await_ready(deadline.remaining())
                try:
                    limit = (await self.stats(timeout=deadline.remaining())).max_waiting
                except MiniPagedError:
                    limit = 0
                max_concurrency = batch_concurrency(max_concurrency, limit)
            sem = asyncio.Semaphore(max_concurrency)

            async def one(item):
                async with sem:
                    return await self.generate(timeout=deadline.remaining(), **item)
            tasks = [asyncio.ensure_future(one(item)) for item in items]
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            for i, r in enumerate(results):
                r.index = i
                for c in r.choices or []:
                    c.index = i
            return list(results)
        acc = ResultAssembler()
        agen = self._chunks(final_only(build_generate_request(prompt, **params)), timeout)
        try:
            async for chunk in agen:
                acc.add(chunk)
        finally:
            await agen.aclose()  # on cancellation too: the stream's finally cancels the call
        return acc.result()

    async def submit(self, requests: Sequence[dict], *, timeout: float | None = None) -> str:
        request = build_submit_request(requests)
        await self._await_ready(timeout)
        call = self._stub.SubmitJob(request, **self._kw(timeout))
        try:
            say_if_waiting(await call.initial_metadata(), self._told_waiting)
            return (await call).job_id
        except grpc.RpcError as e:
            raise (await self._error(e)) from None

    async def list_jobs(self, limit: int = 100, state: str | None = None, *,
                        timeout: float | None = None) -> list[JobStatus]:
        reply = await self._unary(self._stub.ListJobs, pb.ListJobsRequest(limit=int(limit), state=state or ""),
                                  timeout)
        return [job_from_proto(j) for j in reply.jobs]

    async def delete_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(await self._unary(self._stub.DeleteJob, job_request(job_id), timeout))

    async def cancel_pending_jobs(self, model: str | None = None, *,
                                  timeout: float | None = None) -> tuple[int, int]:
        """As Client.cancel_pending_jobs: (jobs, requests) cancelled."""
        reply = await self._unary(self._stub.CancelPendingJobs, pb.CancelPendingJobsRequest(model=model or ""),
                                  timeout)
        return reply.jobs, reply.requests

    async def purge_jobs(self, older_than_s: float, *, timeout: float | None = None) -> int:
        """As Client.purge_jobs: the number of jobs deleted."""
        return (await self._unary(self._stub.PurgeJobs, pb.PurgeJobsRequest(older_than_s=float(older_than_s)),
                                  timeout)).jobs

    async def pool_snapshot(self, max_blocks: int = 0, max_sequences: int = 0, *,
                            timeout: float | None = None) -> PoolSnapshot:
        request = pb.PoolSnapshotRequest(max_blocks=max_blocks, max_sequences=max_sequences)
        return pool_snapshot_from_proto(await self._unary(self._stub.PoolSnapshot, request, timeout))

    async def get_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(await self._unary(self._stub.GetJob, job_request(job_id), timeout))

    async def cancel(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(await self._unary(self._stub.CancelJob, job_request(job_id), timeout))

    async def stats(self, *, timeout: float | None = None) -> Stats:
        return Stats.from_proto(await self._unary(self._stub.Stats, pb.StatsRequest(), timeout))

    async def wait(self, job_id: str, progress: bool = False, *,
                   timeout: float | None = None) -> list[GenerateResult]:
        """Follow WatchJob until the job is finished, then GetJob once to fill any gap."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        acc = JobCollector(progress, job_id)
        try:
            while True:
                call = self._stub.WatchJob(job_request(job_id), timeout=deadline.left(),  # None: none
                                           metadata=self._metadata)
                try:
                    async for msg in call:
                        acc.update(job_from_proto(msg))
                    acc.update(await self.get_job(job_id, timeout=deadline.remaining()))
                except (grpc.RpcError, Unavailable) as e:
                    err = (await self._error(e)) if isinstance(e, grpc.RpcError) else e
                    left = deadline.left()
                    if not isinstance(err, Unavailable) or (left is not None and left <= 0.5):
                        raise err from None
                    await asyncio.sleep(0.5)  # the service restarted (jobs are durable): reconnect
                    continue
                if acc.state in TERMINAL_STATES:
                    return acc.ordered()
                await asyncio.sleep(0.1)  # the watch ended before the job did: watch again
        finally:
            acc.close()

    async def close(self) -> None:
        """Calls still running end with Cancelled (not asyncio's CancelledError, which would read as
        the caller's task being cancelled)."""
        self._closed = True
        channel, loop = self._channel, self._loop
        if channel is None:
            return
        if loop is asyncio.get_running_loop():
            await channel.close()
        elif loop.is_running():    # bound to another thread's loop: close it there
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(channel.close(), loop))

    def _closed_under(self) -> bool:
        """A CancelledError that close() caused, not a cancellation of the running task."""
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)   # (Python 3.11+; on 3.10 a close is the only cause we can tell)
        return self._closed and not (cancelling is not None and cancelling())

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
