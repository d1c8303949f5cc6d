"""The last stage's line back to stage 0 of its chain: the sampled tokens of first_gets_tokens steps.

With async scheduling across a pipeline, the metadata service sends a micro-batch's next step before
its tokens are known (input -1), and stage 0, which embeds them, waits for them. The last stage
samples them, so it sends them to stage 0 itself (InitCache's first_stage_address), one small message
per step on one client stream, as soon as they exist; the reply goes to the metadata service on
StepResults. If the stream breaks, the next send opens a new one; a token that never arrives makes
stage 0's step fail FAILED_PRECONDITION after its wait, and the chain is re-formed."""
from __future__ import annotations

import logging
import queue
import threading

import grpc

from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.step_stream import wait_until

log = logging.getLogger("worker.first_stage")
_END = object()


class FirstStageLink:
    def __init__(self):
        self.address, self.meta = "", ()
        self._channel: grpc.Channel | None = None
        self._queue: queue.SimpleQueue | None = None
        self._lock = threading.Lock()

    def connect(self, address: str, token: str, channel_factory, options) -> None:
        """Point at stage 0 ("" = this stage is not the last of a multi-stage chain)."""
        self.close()
        self.address = address
        self.meta = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = channel_factory(address, options) if address else None

    def send(self, step_id: int, epoch: int, sequence_ids: bytes, token_ids: bytes, ready_at: float) -> None:
        """Queue one step's tokens for stage 0 (never blocks)."""
        if self._channel is None:
            return
        with self._lock:
            if self._queue is None:
                self._queue = self._open()
            self._queue.put((pb.SampledTokens(step_id=step_id, cache_epoch=epoch, sequence_ids=sequence_ids,
                                              token_ids=token_ids), ready_at))

    def _open(self) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        stub = pb_grpc.WorkerServiceStub(self._channel)

        def messages():
            while (item := q.get()) is not _END:
                msg, ready_at = item
                wait_until(ready_at)      # an asynchronous device: the tokens exist at ready_at
                yield msg

        def run():
            try:
                stub.SampledTokenStream(messages(), metadata=self.meta or None)
            except grpc.RpcError as e:
                log.warning("sampled tokens to stage 0 (%s): %s %s", self.address, e.code().name, e.details())
            with self._lock:
                if self._queue is q:
                    self._queue = None    # the next send opens a new stream
        threading.Thread(target=run, name="tokens-to-first", daemon=True).start()
        return q

    def close(self) -> None:
        with self._lock:
            if self._queue is not None:
                self._queue.put(_END)
                self._queue = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
