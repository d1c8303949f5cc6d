"""One stage's stream to the next stage: Steps go down in order, replies come back in order.

A StepStream handler that forwards opens one of these per upstream stream. `send` never blocks
(the stage goes on computing its next micro-batch while the next stage works on this one); a relay
thread reads the downstream replies and hands each to `on_reply`, which passes it up. If the next
stage breaks the stream (it died, hung and was cancelled, or refused a step wholesale), every step
still down there is answered with UNAVAILABLE, in order, so no upstream step waits forever."""
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
        self._outstanding: list[int] = []          # step ids sent, reply not yet back (in order)
        self._direct_sent = False
        self._lock = threading.Lock()
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

    def send(self, request: pb.StepRequest, ready_at: float = 0.0, track: bool = True,
             hidden: bytes | None = None) -> None:
        """`track`: a reply comes back on this stream (not so for reply_direct steps, whose last
        stage answers the metadata service itself)."""
        if hidden is not None:
            request.hidden_states = payload_bytes(hidden)    # this link carries them inside the message
        with self._lock:
            if track:
                self._outstanding.append(request.step_id)
            else:
                self._direct_sent = True
        self._requests.put((request, ready_at))

    def _run(self) -> None:
        try:
            for reply in self._call:
                with self._lock:
                    if self._outstanding and self._outstanding[0] == reply.step_id:
                        self._outstanding.pop(0)
                    elif reply.step_id in self._outstanding:
                        self._outstanding.remove(reply.step_id)
                self._on_reply(reply)
            code, why, broke = grpc.StatusCode.UNAVAILABLE, "the stream ended with steps outstanding", False
        except grpc.RpcError as e:
            code, why, broke = e.code(), e.details() or e.code().name, True
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                code = grpc.StatusCode.UNAVAILABLE
        with self._lock:
            lost, self._outstanding = self._outstanding, []
            if broke and self._direct_sent:
                lost.append(0)   # steps whose replies go direct were lost too: 0 = "the chain broke"
        for step_id in lost:
            self._on_failed(step_id, grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.CANCELLED else code,
                            f"next stage {self.address}: {why}")

    def close(self, wait_s: float = 0.0) -> None:
        """Half-close: the next stage finishes what it has, then the stream ends."""
        self._requests.put(_END)
        if wait_s:
            self._relay.join(wait_s)

    def cancel(self) -> None:
        self._call.cancel()
        self._requests.put(_END)
