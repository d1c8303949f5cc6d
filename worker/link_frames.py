"""The Step frames of the data link, both ends (the wire format is minipaged/step_frames.py's).

A stage on an asynchronous device (a GPU; the simulator) has a step's forward request at once and
its hidden states only at `ready_at`. Sent as one frame at `ready_at`, the next stage would then
parse and validate the request (~0.3 ms for 256 decode rows here) before it could compute: on the
critical path of every hop of the pipeline. So such a step is split: its header (b"H") goes at once,
the next stage checks it while this one computes, and its data (b"D" inline, b"R" in the ring) goes
when it exists. A step whose bytes already exist (a CPU stage) or carries none goes whole (b"S" /
b"M"), as before.

Order: a stream's steps run in the order of their headers. A whole frame waits for its `ready_at`,
so no header may overtake it: a split header goes early only when every step before it has had its
header sent."""
from __future__ import annotations

import collections
import logging
import queue
import socket
import struct
import time
from dataclasses import dataclass

from minipaged.step_frames import RING, STEP, recv_exact
from minipaged.v1 import worker_pb2 as pb
from worker.step_stream import PendingHidden

log = logging.getLogger("worker.link_frames")
END = object()          # put on a writer's queue: send what is left, then end the link


class FrameReader:
    """Yields (StepRequest, hidden, release) in stream order; `hidden` is bytes, a ring view, None,
    or a PendingHidden (a split step). Only the stream's pump thread reads."""

    def __init__(self, conn: socket.socket, ring, cancelled):
        self.conn, self.ring, self.cancelled = conn, ring, cancelled
        self.ready: collections.deque = collections.deque()    # steps read, not yet yielded
        self.waiting: collections.deque = collections.deque()  # PendingHidden without their data
        self.broken, self.why = False, ""

    def __iter__(self):
        while not self.cancelled.is_set():
            if not self.ready:
                if not self.advance():
                    return                    # the previous stage hung up, or sent no protocol's frame
                continue
            yield self.ready.popleft()

    def advance(self) -> bool:
        """Read one frame; False, for good, once the previous stage hung up (or was cancelled) or
        sent a frame of no protocol (the link is dropped)."""
        if self.broken:
            return False
        try:
            if self.read_frame():
                return True
            self.why = "a frame of no protocol"
        except (OSError, ConnectionError, struct.error) as e:
            self.why = str(e) or type(e).__name__
        self.broken = True
        if self.waiting:
            log.warning("the previous stage's link ended with %d split steps waiting for their hidden states (%s)",
                        len(self.waiting), self.why)
        return False

    def read_frame(self) -> bool:
        """One frame off the socket: a step onto `ready`, or the data of the oldest waiting split
        step. False for a frame of no protocol."""
        kind, hlen, blen = STEP.unpack(recv_exact(self.conn, STEP.size))
        if kind in (b"D", b"R"):
            if not self.waiting or hlen or blen != self.waiting[0].length:
                return False
            p = self.waiting.popleft()
            if kind == b"R":
                if self.ring is None:
                    return False
                p.data, p.release = self.ring.hold(*self._ring_at(blen))
            else:
                p.data = recv_exact(self.conn, blen)
            p.filled = True
            return True
        if kind not in (b"S", b"M", b"H"):
            return False
        header = recv_exact(self.conn, hlen)
        release = None
        if kind == b"M":
            if self.ring is None:
                return False
            hidden, release = self.ring.hold(*self._ring_at(blen))   # freed once the step is done with it
        elif kind == b"H":
            hidden = PendingHidden(blen, self)
            self.waiting.append(hidden)
        else:
            hidden = recv_exact(self.conn, blen) if blen else None   # a bytearray: no second copy
        self.ready.append((pb.StepRequest.FromString(bytes(header)), hidden, release))
        return True

    def _ring_at(self, blen: int):
        offset, end = RING.unpack(recv_exact(self.conn, RING.size))
        return offset, blen, end


@dataclass
class _Out:
    request: pb.StepRequest
    ready_at: float
    parts: tuple                # the hidden bytes, in parts
    length: int
    done: object                # called once the bytes have left (or None)
    header_sent: bool = False

    @property
    def splits(self) -> bool:
        return self.length > 0 and self.ready_at > time.monotonic()


class FrameWriter:
    """The sending loop of one link (TcpStageLink's thread): items (request, ready_at, parts, done)
    from `q`; headers early where they may go, every step's bytes at its `ready_at`, in order."""

    def __init__(self, sock: socket.socket, ring, q: queue.SimpleQueue, broken):
        self.sock, self.ring, self.q, self.broken = sock, ring, q, broken
        self.pending: collections.deque[_Out] = collections.deque()

    def run(self) -> None:
        """Until END (after the steps before it are sent) or a broken socket (the reader reports it)."""
        ending = False
        try:
            while True:
                if not ending:
                    item = self._next()
                    if item is END:
                        ending = True
                    elif item is not None:
                        self.pending.append(_Out(*item))
                        self._headers()
                while self.pending and (ending or self.pending[0].ready_at <= time.monotonic()):
                    out = self.pending[0]
                    delay = out.ready_at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)     # ending: each step's bytes still leave once they exist
                    self._data(self.pending.popleft())
                    self._headers()           # a whole frame sent: the headers behind it may go
                if ending:
                    return
        except (OSError, ConnectionError):
            return

    def _next(self):
        """The next item, waiting no longer than the oldest pending step's `ready_at`; None if none came."""
        if not self.pending:
            return self.q.get()
        wait = self.pending[0].ready_at - time.monotonic()
        try:
            return self.q.get(timeout=wait) if wait > 0 else self.q.get_nowait()
        except queue.Empty:
            return None

    def _headers(self) -> None:
        for out in self.pending:
            if out.header_sent:
                continue
            if not out.splits:
                return                        # a whole frame: nothing after it may overtake it
            header = out.request.SerializeToString()
            self.sock.sendall(STEP.pack(b"H", len(header), out.length) + header)
            out.header_sent = True

    def _data(self, out: _Out) -> None:
        try:
            if out.header_sent:
                self._send_bytes(out, b"R", b"D", b"")
            else:
                header = out.request.SerializeToString()
                self._send_bytes(out, b"M", b"S", header)
        finally:
            if out.done is not None:
                out.done()                    # the bytes are in the next ring or the socket: free ours

    def _send_bytes(self, out: _Out, ring_kind: bytes, inline_kind: bytes, header: bytes) -> None:
        if self.ring is not None and 0 < out.length <= self.ring.capacity:
            offset, end = self.ring.put(out.parts, stopped=self.broken)
            self.sock.sendall(STEP.pack(ring_kind, len(header), out.length) + header + RING.pack(offset, end))
            return
        self.sock.sendall(STEP.pack(inline_kind, len(header), out.length) + header)
        for part in out.parts:
            self.sock.sendall(part)           # no copy in Python: the kernel reads the bytes
