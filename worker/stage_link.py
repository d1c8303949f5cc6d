"""One stage's stream to the next stage: Steps go down in order; what comes back is errors.

A StepStream handler that forwards opens one of these per upstream stream. `send` never blocks
(the stage goes on computing its next micro-batch while the next stage works on this one); a relay
thread reads what comes back (the errors of stages further down: their results go to the metadata
service on StepResults) and hands each to `on_reply`, which passes it up. If the next stage breaks
the stream (it died, hung and was cancelled, or refused a step wholesale) after steps went down,
`on_failed(0, ...)` says the chain broke: the steps down there will never be answered."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from minipaged.v1 import worker_pb2 as pb
from worker.data_link import payload_bytes
from worker.step_stream import wait_until

log = logging.getLogger("worker.stage_link")
_END = object()


class StageLink:
    def __init__(self, stub, address: str, metadata, on_reply: Callable[[pb.StepReply], None],
                 on_failed: Callable[[int, grpc.StatusCode, str], None]):
        self.address = address
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._on_reply, self._on_failed = on_reply, on_failed
        self._sent = self._closed = False
        self._call = stub.StepStream(self._iter(), metadata=metadata or None)
        self._relay = threading.Thread(target=self._run, name="stage-link-relay", daemon=True)
        self._relay.start()

    def _iter(self):
        while True:
            item = self._requests.get()
            if item is _END:
                return
            request, ready_at = item
            wait_until(ready_at)   # hidden states leave an asynchronous device once they exist
            yield request

    def send(self, request: pb.StepRequest, ready_at: float = 0.0, hidden: bytes | None = None, done=None) -> None:
        if hidden is not None:
            request.hidden_states = payload_bytes(hidden)    # this link carries them inside the message
        if done is not None:
            done()                                           # (copied into it)
        self._sent = True
        self._requests.put((request, ready_at))

    def _run(self) -> None:
        try:
            for reply in self._call:
                self._on_reply(reply)
            if self._closed:
                return
            code, why = grpc.StatusCode.UNAVAILABLE, "the stream ended before this stage closed it"
        except grpc.RpcError as e:
            code, why = e.code(), e.details() or e.code().name
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                code = grpc.StatusCode.UNAVAILABLE
        if self._sent:
            self._on_failed(0, code, f"next stage {self.address}: {why}")   # 0: "the chain broke"

    def close(self, wait_s: float = 0.0) -> None:
        """Half-close: the next stage finishes what it has, then the stream ends."""
        self._closed = True
        self._requests.put(_END)
        if wait_s:
            self._relay.join(wait_s)

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()
        self._requests.put(_END)
