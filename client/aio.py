"""The asyncio SDK: `AsyncClient`, the same surface as `Client` on grpc.aio.

Types, request building and job-result assembly are shared with the sync client (client.messages), so
the two cannot drift apart."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

import grpc
import grpc.aio

from minipaged.tls import channel_credentials
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

from .errors import Unavailable, from_rpc_error
from .messages import (CHANNEL_OPTIONS, TERMINAL_STATES, Deadline, GenerateResult, JobCollector, JobStatus,
                  ResultAssembler, Stats, StreamChunk, build_generate_request, build_submit_request,
                  chunk_from_proto, job_from_proto)


class AsyncClient:
    """Non-blocking client. Create it inside a running event loop (grpc.aio binds to it)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 timeout: float | None = None, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        self.address, self.timeout = address, timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        creds = channel_credentials(tls_ca, tls_cert, tls_key)
        self._channel = (grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS) if creds else
                         grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
        self._stub = pb_grpc.MetadataServiceStub(self._channel)

    def _kw(self, timeout: float | None) -> dict:
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self._metadata}

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, **self._kw(timeout))
        except grpc.RpcError as e:  # AioRpcError is a grpc.RpcError
            raise from_rpc_error(e) from None

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                     **params) -> AsyncIterator[StreamChunk]:
        """Async iterator of chunks; leaving the loop early (aclose) cancels the request."""
        request = build_generate_request(prompt, **params)
        call = self._stub.Generate(request, **self._kw(timeout))
        try:
            async for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **params) -> GenerateResult:
        acc = ResultAssembler()
        async for chunk in self.stream(prompt, timeout=timeout, **params):
            acc.add(chunk)
        return acc.result()

    async def submit(self, requests: Sequence[dict], *, timeout: float | None = None) -> str:
        return (await self._unary(self._stub.SubmitJob, build_submit_request(requests), timeout)).job_id

    async def get_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(await self._unary(self._stub.GetJob, pb.JobRequest(job_id=job_id), timeout))

    async def cancel(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(await self._unary(self._stub.CancelJob, pb.JobRequest(job_id=job_id), timeout))

    async def stats(self, *, timeout: float | None = None) -> Stats:
        return Stats.from_proto(await self._unary(self._stub.Stats, pb.StatsRequest(), timeout))

    async def wait(self, job_id: str, progress: bool = False, *,
                   timeout: float | None = None) -> list[GenerateResult]:
        """Follow WatchJob until the job is finished, then GetJob once to fill any gap."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        acc = JobCollector(progress, job_id)
        try:
            while True:
                call = self._stub.WatchJob(pb.JobRequest(job_id=job_id), timeout=deadline.left(),
                                           metadata=self._metadata)
                try:
                    async for msg in call:
                        acc.update(job_from_proto(msg))
                    acc.update(await self.get_job(job_id, timeout=deadline.left()))
                except (grpc.RpcError, Unavailable) as e:
                    err = from_rpc_error(e) if isinstance(e, grpc.RpcError) else e
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
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
