"""The synchronous SDK: `Client`. Result types and request building live in client/messages.py
(shared with the async client and the CLI) and are re-exported here."""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import grpc

from minipaged.tls import make_channel
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

from .errors import Unavailable, from_rpc_error
from .messages import (CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, REQUEST_KEYS, TERMINAL_STATES,  # noqa: F401
                       Deadline, GenerateResult, JobCollector, JobStatus, ResultAssembler, Stats, StreamChunk,
                       Usage, build_generate_request, build_submit_request, chunk_from_proto, job_from_proto,
                       result_from_proto)

class Client:
    """Blocking client of the metadata service. `timeout` is the default per-call deadline (s)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 timeout: float | None = None, *, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        self.address, self.timeout = address, timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        # TLS when given the CA that signed the service's certificate (+ a client cert for mTLS)
        self._channel = make_channel(address, CHANNEL_OPTIONS, tls_ca, tls_cert, tls_key)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)

    def _kw(self, timeout: float | None) -> dict:
        return {"timeout": self.timeout if timeout is None else timeout, "metadata": self._metadata}

    def _unary(self, method, request, timeout):
        try:
            return method(request, **self._kw(timeout))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **params) -> Iterator[StreamChunk]:
        """Chunks as the service produces them; leaving the loop early cancels the request.
        `params`: prompt_token_ids, max_new_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, return_logprobs (see build_generate_request)."""
        request = build_generate_request(prompt, **params)
        call = self._stub.Generate(request, **self._kw(timeout))
        try:
            for chunk in call:
                yield chunk_from_proto(chunk)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op once finished; frees the sequence if the caller stopped early

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **params) -> GenerateResult:
        """One request, blocking: stream() collected into a GenerateResult."""
        acc = ResultAssembler()
        for chunk in self.stream(prompt, timeout=timeout, **params):
            acc.add(chunk)
        return acc.result()

    def submit(self, requests: Sequence[dict], *, timeout: float | None = None) -> str:
        return self._unary(self._stub.SubmitJob, build_submit_request(requests), timeout).job_id

    def get_job(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(self._unary(self._stub.GetJob, pb.JobRequest(job_id=job_id), timeout))

    def cancel(self, job_id: str, *, timeout: float | None = None) -> JobStatus:
        return job_from_proto(self._unary(self._stub.CancelJob, pb.JobRequest(job_id=job_id), timeout))

    def stats(self, *, timeout: float | None = None) -> Stats:
        return Stats.from_proto(self._unary(self._stub.Stats, pb.StatsRequest(), timeout))

    def wait(self, job_id: str, progress: bool = False, *,
             timeout: float | None = None) -> list[GenerateResult]:
        """Follow WatchJob until the job is finished, then GetJob once to fill any gap.
        `timeout` bounds the whole wait, not each message."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        acc = JobCollector(progress, job_id)
        try:
            while True:
                call = self._stub.WatchJob(pb.JobRequest(job_id=job_id), timeout=deadline.left(),
                                           metadata=self._metadata)
                try:
                    for msg in call:
                        acc.update(job_from_proto(msg))
                    acc.update(self.get_job(job_id, timeout=deadline.left()))  # the stream may end early
                except (grpc.RpcError, Unavailable) as e:
                    err = from_rpc_error(e) if isinstance(e, grpc.RpcError) else e
                    if not isinstance(err, Unavailable):
                        raise err from None
                    # the service restarted (jobs are durable): reconnect until the deadline
                    if deadline.left() is not None and deadline.left() <= 0.5:
                        raise err from None
                    time.sleep(0.5)
                    continue
                if acc.state in TERMINAL_STATES:
                    return acc.ordered()
                time.sleep(0.1)  # the watch ended before the job did: watch again, politely
        finally:
            acc.close()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
