"""An ordered line of protobuf frames (u32 length, the message) on a socket: the last stage's
replies to the metadata service (StepResults, RESULTS_MAGIC) and its sampled tokens to stage 0
(TOKENS_MAGIC, worker/first_stage.py).

A host device's message exists when its step returns (ready_at already past). Handed to a writer
thread, it waits for the interpreter lock, and takes it from the step thread just as that thread
starts checking its next step: on 2 tiny CPU stages that check took ~125 us on the last stage
against ~18 us on stage 0. So while nothing is queued before it, such a message goes on the socket
from the caller's own thread. An asynchronous device's message (the simulator: ready_at ahead)
goes through the queue; the writer thread waits until it exists, and while it holds one, later
messages queue behind it, so the order stays the steps' order. Until `write` starts (the
subscriber's b"OK" sent, or the socket not yet connected) every message queues.

`put(None)` ends the line (a newer subscriber, a new epoch, the peer gone, a failed send): it
never waits for a send, so a re-initialisation is not held up by a peer that stopped reading; the
writer's caller then closes the socket, which fails a send still blocked on it."""
from __future__ import annotations

import logging
import queue
import threading
import time

from minipaged.step_frames import REPLY
from worker.step_stream import wait_until

log = logging.getLogger("worker.frame_line")


class FrameLine:
    """Stands where a queue of (message, ready_at) items would: put / get, and `write` to drain it
    onto the socket."""

    def __init__(self, what: str, conn=None):
        self.what, self.conn = what, conn   # what: for the log; conn: may come later (write)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()       # inline sends, and `_queued`
        self._queued = 0                    # messages put on the queue and not yet written
        self._broken = False
        self._writing = False

    def put(self, item) -> None:
        if item is None:
            self._q.put(None)
            return
        msg, ready_at = item
        with self._lock:
            if self._writing and self._queued == 0 and ready_at <= time.monotonic():
                if not self._broken:
                    self._send(msg)
                return
            self._queued += 1
        self._q.put(item)

    def get(self):
        return self._q.get()

    def write(self, conn=None) -> None:
        """The writer thread, once the socket may carry frames: queued messages, each once its
        device has it, then inline sends, until the line ends."""
        with self._lock:
            self.conn = conn or self.conn
            self._writing = True
        while (item := self._q.get()) is not None:
            msg, ready_at = item
            wait_until(ready_at)
            with self._lock:
                self._queued -= 1
                if not self._broken:
                    self._send(msg)

    def _send(self, msg) -> None:
        data = msg.SerializeToString()
        try:
            self.conn.sendall(REPLY.pack(len(data)) + data)
        except OSError as e:                # the peer left: the line ends (for the results, later
            log.info("%s on the data link: %s", self.what, e)   # replies find no subscriber and
            self._broken = True                                  # go back as errors)
            self._q.put(None)
