"""The metadata service's ends of one chain: its StepStream to stage 0 (steps go out in order; what
comes back is errors) and the last stage's StepResults (every step's reply, in order). A reader
thread on each posts what arrives to the chain's event queue, as it does the end of a stream (a dead
or cancelled stage)."""
from __future__ import annotations

import queue
import threading

import grpc

from minipaged.v1 import worker_pb2

_END = object()


class StepChannel:
    def __init__(self, stub, metadata, events: queue.SimpleQueue):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._events = events
        self._cancelled = False
        self._call = stub.StepStream(self._iter(), metadata=metadata)
        threading.Thread(target=self._read, name="step-channel", daemon=True).start()

    def _iter(self):
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    def send(self, request: worker_pb2.StepRequest) -> None:
        self._requests.put(request)

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._events.put(("reply", reply))
            why = "the stage-0 stream ended"
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
        if not self._cancelled:
            self._events.put(("broken", f"step stream to stage 0 broke: {why}"))

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
        self._requests.put(_END)


class ResultsChannel:
    """The last stage's StepResults stream: every step's reply, whatever the chain's length."""

    def __init__(self, stub, epoch: int, metadata, events: queue.SimpleQueue, timeout_s: float = 30.0):
        self._events = events
        self._cancelled = False
        self._call = stub.StepResults(worker_pb2.StepResultsRequest(cache_epoch=epoch), metadata=metadata)
        ready = threading.Event()
        self._error: str | None = None
        threading.Thread(target=self._read, args=(ready,), name="step-results", daemon=True).start()
        if not ready.wait(timeout_s) or self._error:
            self.cancel()
            raise ConnectionError(self._error or f"the last stage did not subscribe within {timeout_s:.0f}s")

    def _read(self, ready: threading.Event) -> None:
        try:
            first = True
            for reply in self._call:
                if first:                      # the stage's acknowledgement: it will publish now
                    first = False
                    ready.set()
                    continue
                self._events.put(("reply", reply))
            why = "the last stage's results stream ended"
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
            self._error = why
        ready.set()
        if not self._cancelled:
            self._events.put(("broken", f"results stream from the last stage broke: {why}"))

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()
