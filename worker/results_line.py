"""The last stage's replies to the metadata service on the TCP data link (StepResults,
RESULTS_MAGIC), in step order.

A host device's reply exists when its step returns (ready_at already past). Handed to a writer
thread, it waits for the interpreter lock, and takes it from the step thread just as that thread
starts checking its next step: on 2 tiny CPU stages that check took ~125 us on the last stage
against ~18 us on stage 0. So while nothing is queued before it, such a reply goes on the socket
from the step's own thread. An asynchronous device's reply (the simulator: ready_at ahead) goes
through the queue; the writer thread waits until it exists, and while it holds one, later
replies queue behind it, so the order stays the steps' order.

`put(None)` ends the line (a newer subscriber, a new epoch, the subscriber gone, a failed send):
it never waits for a send, so a re-initialisation is not held up by a peer that stopped reading;
the writer then unsubscribes and closes the socket, which fails a send still blocked on it."""
from __future__ import annotations

import logging
import queue
import threading
import time

from minipaged.step_frames import REPLY
from worker.step_stream import wait_until

log = logging.getLogger("worker.results_line")


class ResultsLine:
    """Stands where StepRpcs.results keeps its subscriber queue (put / get)."""

    def __init__(self, conn):
        self.conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()   # inline sends, and `queued`
        self._queued = 0                # replies put on the queue and not yet written
        self._broken = False
        self._writing = False           # nothing goes out before the subscriber's b"OK"

    def put(self, item) -> None:
        if item is None:
            self._q.put(None)
            return
        reply, ready_at = item
        with self._lock:
            if self._writing and self._queued == 0 and ready_at <= time.monotonic():
                if not self._broken:
                    self._send(reply)
                return
            self._queued += 1
        self._q.put(item)

    def get(self):
        return self._q.get()

    def write(self) -> None:
        """The writer thread, once the subscriber has its b"OK": queued replies, each once its
        device has it, until the line ends."""
        with self._lock:
            self._writing = True
        while (item := self._q.get()) is not None:
            reply, ready_at = item
            wait_until(ready_at)
            with self._lock:
                self._queued -= 1
                if not self._broken:
                    self._send(reply)

    def _send(self, reply) -> None:
        data = reply.SerializeToString()
        try:
            self.conn.sendall(REPLY.pack(len(data)) + data)
        except OSError as e:             # the subscriber left: the line ends (later replies find no
            log.info("step results on the data link: %s", e)   # subscriber and go back as errors)
            self._broken = True
            self._q.put(None)
