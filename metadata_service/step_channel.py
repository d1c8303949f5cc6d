"""The metadata service's ends of one chain: its StepStream to stage 0 (steps go out in order; what
comes back is errors) and the last stage's StepResults (every step's reply, in order). A reader
thread on each posts what arrives to the chain's event queue, as it does the end of a stream (a dead
or cancelled stage).

Two transports for the same messages: gRPC streams, and the workers' TCP data link
(minipaged/step_frames.py) when the stages offer one (no TLS). `open_channels` picks the data link
when it can: each streamed gRPC message costs ~0.3 ms of CPU in this process's interpreter (its
request-iterator, channel-spin and reader threads), a frame one serialization and one send."""
from __future__ import annotations

import logging
import queue
import socket
import threading

import grpc

from minipaged import step_frames
from minipaged.v1 import worker_pb2

log = logging.getLogger("metadata_service.step_channel")
_END = object()


def data_address(stage) -> str:
    """host:data_port of a registered worker's data link, "" when it offers none."""
    port = stage.info.data_port
    return f"{stage.address.rsplit(':', 1)[0]}:{port}" if port else ""


def open_channels(stages, channel_factory, epoch: int, token: str, events: queue.SimpleQueue):
    """(step channel to stage 0, results channel from the last stage): on the data link when both
    ends offer it and it answers, else on gRPC."""
    first, last = data_address(stages[0]), data_address(stages[-1])
    if first and last:
        try:
            return _both(lambda: SocketStepChannel(first, token, epoch, events),
                         lambda: SocketResultsChannel(last, token, epoch, events))
        except (OSError, ConnectionError) as e:
            log.warning("data link of %s / %s refused (%s): steps go on gRPC", first, last, e)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    return _both(lambda: StepChannel(stages[0].connect(channel_factory), metadata, events),
                 lambda: ResultsChannel(stages[-1].connect(channel_factory), epoch, metadata, events))


def _both(make_steps, make_results):
    """Open the results channel, then the step channel; neither is left open if the other fails."""
    results = make_results()
    try:
        return make_steps(), results
    except BaseException:
        results.cancel()
        raise


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

    def send(self, request: worker_pb2.StepRequest) -> int:
        """Queue one Step; its size in bytes (the Stats figure)."""
        self._requests.put(request)
        return request.ByteSize()

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


class _SocketChannel:
    """A data-link connection whose replies (StepReply frames) go to the chain's events; its end
    (closed, reset, a frame that does not parse) is a broken chain unless we cancelled it."""
    what = ""

    def __init__(self, address: str, magic: bytes, token: str, epoch: int, events: queue.SimpleQueue,
                 timeout_s: float = 10.0):
        self.sock, _ = step_frames.connect(address, magic, token, epoch, timeout_s)
        self._events = events
        self._cancelled = False
        threading.Thread(target=self._read, name=self.what.replace(" ", "-"), daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                self._events.put(("reply", worker_pb2.StepReply.FromString(step_frames.read_reply(self.sock))))
        except Exception as e:
            why = str(e) or type(e).__name__
        if not self._cancelled:
            self._events.put(("broken", f"{self.what} broke: {why}"))

    def cancel(self) -> None:
        self._cancelled = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SocketStepChannel(_SocketChannel):
    """StepChannel on stage 0's data link: frames out, in-band errors back. The chain's thread
    sends a frame itself when the socket takes all of it at once (the usual case: no thread hop);
    whatever does not fit goes to a sender thread, and so does every frame after it until that one
    has drained, so a stage that stops reading never blocks the chain's thread and order holds."""
    what = "step link to stage 0"

    def __init__(self, address: str, token: str, epoch: int, events: queue.SimpleQueue):
        super().__init__(address, step_frames.STEPS_MAGIC, token, epoch, events)
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0                   # frames (or their rests) the sender thread still holds
        threading.Thread(target=self._send, name="step-link-send", daemon=True).start()

    def send(self, request: worker_pb2.StepRequest) -> int:
        """Send one Step (see the class); its size in bytes (the Stats figure)."""
        data = request.SerializeToString()
        frame = step_frames.step_frame(data)
        with self._lock:
            if not self._queued:
                try:
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return len(data)       # the reader reports the break
                if sent == len(frame):
                    return len(data)
                frame = memoryview(frame)[sent:]
            self._queued += 1
        self._frames.put(frame)
        return len(data)

    def _send(self) -> None:
        while True:
            frame = self._frames.get()
            if frame is _END:
                return
            try:
                self.sock.sendall(frame)
            except OSError:
                return                     # the reader reports the break
            with self._lock:
                self._queued -= 1

    def cancel(self) -> None:
        self._frames.put(_END)
        super().cancel()


class SocketResultsChannel(_SocketChannel):
    """ResultsChannel on the last stage's data link; the server's b"OK" is the subscription."""
    what = "results link from the last stage"

    def __init__(self, address: str, token: str, epoch: int, events: queue.SimpleQueue):
        super().__init__(address, step_frames.RESULTS_MAGIC, token, epoch, events)
