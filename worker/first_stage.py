"""The last stage's line back to stage 0 of its chain: the sampled tokens of first_gets_tokens steps.

With async scheduling across a pipeline, the metadata service sends a micro-batch's next step before
its tokens are known (input -1), and stage 0, which embeds them, waits for them. The last stage
samples them, so it sends them to stage 0 itself (InitCache's first_stage_address), one small message
per step, as soon as they exist; the reply goes to the metadata service on StepResults.

The messages go as frames on stage 0's data link (InitCache's first_stage_data_address, hello
TOKENS_MAGIC at the chain's epoch) when it offers one, else on one SampledTokenStream. They are on
the pipeline's critical path (stage 0 waits for them), and a gRPC streamed message costs ~0.3 ms of
interpreter time on each side. A link that does not answer falls back to gRPC. If the line breaks,
the next send opens a new one; a token that never arrives makes stage 0's step fail
FAILED_PRECONDITION after its wait, and the chain is re-formed.

A host device's tokens exist when its step returns (ready_at already past). Once the data link is
up and nothing is queued before them, they go on it from the step's own thread: a hand-off to the
sender thread waits for the interpreter lock, which the step thread takes straight back for its
next step, and stage 0 waits for these tokens (on 2 tiny CPU stages, ~0.2 ms a step)."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from minipaged.step_frames import REPLY, TOKENS_MAGIC, connect
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.step_stream import wait_until

log = logging.getLogger("worker.first_stage")
_END = object()


class FirstStageLink:
    def __init__(self):
        self.address, self.data_address, self.token, self.epoch, self.meta = "", "", "", 0, ()
        self._channel: grpc.Channel | None = None
        self._queue: queue.SimpleQueue | None = None
        self._inline = None          # the data link's socket, once the sender thread has drained
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()   # inline sends (never taken by close: a send may block)

    def connect(self, address: str, token: str, channel_factory, options, data_address: str = "",
                epoch: int = 0) -> None:
        """Point at stage 0 ("" = this stage is not the last of a multi-stage chain)."""
        self.close()
        self.address, self.data_address, self.token, self.epoch = address, data_address, token, epoch
        self.meta = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = channel_factory(address, options) if address else None

    def send(self, step_id: int, epoch: int, sequence_ids: bytes, token_ids: bytes, ready_at: float) -> None:
        """One step's tokens for stage 0: sent now, or queued for the sender thread."""
        if self._channel is None:
            return
        msg = pb.SampledTokens(step_id=step_id, cache_epoch=epoch, sequence_ids=sequence_ids, token_ids=token_ids)
        with self._lock:
            sock = self._inline if ready_at <= time.monotonic() else None
            if sock is None:
                if self._queue is None:
                    self._queue = self._open()
                self._queue.put((msg, ready_at))
                self._inline = None       # until the thread has sent this one: order is kept
                return
        data = msg.SerializeToString()
        try:
            with self._send_lock:
                sock.sendall(REPLY.pack(len(data)) + data)
        except OSError as e:          # as on the sender thread: this message is lost, a new line opens
            log.warning("sampled tokens to stage 0 on the data link: %s", e)
            with self._lock:
                if self._inline is sock:
                    self._inline = None
                    if self._queue is not None:
                        self._queue.put(_END)     # its thread closes the socket
                        self._queue = None

    def _open(self) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, args=(q,), name="tokens-to-first", daemon=True).start()
        return q

    def _run(self, q: queue.SimpleQueue) -> None:
        sock = None
        if self.data_address:
            try:
                sock, _ = connect(self.data_address, TOKENS_MAGIC, self.token, self.epoch, 10.0)
                log.info("sampled tokens to stage 0 on the data link %s", self.data_address)
            except (OSError, ConnectionError) as e:
                log.info("sampled tokens to stage 0: data link %s: %s; on gRPC", self.data_address, e)
        try:
            self._frames(sock, q) if sock is not None else self._stream(q)
        finally:
            with self._lock:
                if self._queue is q:
                    self._queue = None    # the next send opens a new line

    @staticmethod
    def _messages(q: queue.SimpleQueue):
        """The queued messages, each once its tokens exist (an asynchronous device: at ready_at)."""
        while (item := q.get()) is not _END:
            msg, ready_at = item
            wait_until(ready_at)
            yield msg

    def _frames(self, sock, q: queue.SimpleQueue) -> None:
        self._drained(sock, q)
        try:
            for msg in self._messages(q):
                data = msg.SerializeToString()
                sock.sendall(REPLY.pack(len(data)) + data)
                self._drained(sock, q)
        except OSError as e:
            log.warning("sampled tokens to stage 0 on the data link: %s", e)
        finally:
            with self._lock:
                if self._inline is sock:
                    self._inline = None
            sock.close()

    def _drained(self, sock, q: queue.SimpleQueue) -> None:
        """Nothing queued is still unsent: later sends may go on the socket themselves, in order."""
        with self._lock:
            if self._queue is q and q.empty():
                self._inline = sock

    def _stream(self, q: queue.SimpleQueue) -> None:
        try:
            pb_grpc.WorkerServiceStub(self._channel).SampledTokenStream(self._messages(q),
                                                                        metadata=self.meta or None)
        except grpc.RpcError as e:
            log.warning("sampled tokens to stage 0 (%s): %s %s", self.address, e.code().name, e.details())

    def close(self) -> None:
        with self._lock:
            self._inline = None
            if self._queue is not None:
                self._queue.put(_END)
                self._queue = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
