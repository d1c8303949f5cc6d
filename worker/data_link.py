"""The TCP data link: hidden states from one stage to the next on a plain socket, beside gRPC.

A forward through gRPC copies a step's hidden states about seven times (protobuf, serialization,
grpc's buffers, on both sides) and costs ~1.4 ms of round trip for a 1.6 MB decode step and ~17 ms
for a 16 MB prefill chunk on this machine; a socket copies them once per side (0.4 ms and 3.4 ms).
NCCL plays this part between GPUs; this is the host path. The control side is unchanged: the
same StepRequest (without its hidden_states bytes) leads each frame, the same ordered pipe runs the
steps (worker/step_stream.py), errors come back on the same connection, and the last stage of a
multi-stage chain still answers the metadata service on StepResults.

Between stages on one host the bytes themselves go through a shared-memory ring
(worker/shm_ring.py: one memcpy a side instead of the kernel's socket copies); the socket still
carries every frame, in order.

Frames (little endian). Client hello: b"MPD2", u32 token length, token, u64 cache epoch, u32 ring
name length, ring name (empty: none); the server answers b"OS" (ring opened), b"OK" (inline bytes)
or b"NO" and closes. Then steps: b"S", u32 header length, u64 hidden length, the StepRequest bytes,
the hidden bytes; or b"M", the same lengths, the StepRequest bytes, u64 ring offset, u64 ring end.
Back: u32 length, a StepReply. The hello carries the worker token (compared
in constant time); the link is offered only without TLS (with TLS, hidden states stay on the gRPC
stream, which is encrypted)."""
from __future__ import annotations

import hmac
import logging
import queue
import socket
import struct
import threading

import grpc

from minipaged.v1 import worker_pb2 as pb
from worker.shm_ring import ShmRingReader, ShmRingWriter, capacity_from_env
from worker.step_stream import StepPipe, wait_until

log = logging.getLogger("worker.data_link")
_HELLO, _STEP, _REPLY = struct.Struct("<4sI"), struct.Struct("<cIQ"), struct.Struct("<I")
_RING = struct.Struct("<QQ")
_END = object()


def payload_parts(payload) -> tuple:
    """Hidden states leave a stage as bytes, a bytearray, a memoryview or a tuple of them (the
    simulator's ids + shared zeros): sent part by part, never joined in Python."""
    return payload if isinstance(payload, tuple) else (payload,)


def payload_bytes(payload) -> bytes:
    """One bytes object, for the paths that put hidden states inside a protobuf message."""
    return payload if isinstance(payload, bytes) else b"".join(payload_parts(payload))


def _recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    buf = into if into is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if k == 0:
            raise ConnectionError("the peer closed the data link")
        got += k
    return buf


class DataServer:
    """Accepts the previous stage's data link; each connection is one ordered pipe of steps."""

    def __init__(self, servicer, host: str, port: int, token: str):
        self.s, self.token = servicer, token.encode()
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name="data-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            magic, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic != b"MPD2" or n > 4096:
                return
            token = bytes(_recv_exact(conn, n))
            epoch, m = struct.unpack("<QI", _recv_exact(conn, 12))
            name = bytes(_recv_exact(conn, m)).decode("ascii", "replace") if m <= 256 else ""
            if not hmac.compare_digest(token, self.token) or epoch != self.s.epoch or not epoch or m > 256:
                conn.sendall(b"NO")       # wrong token or a stale epoch: nothing runs
                return
            ring = None
            if name:
                try:
                    ring = ShmRingReader(name)
                except (OSError, ValueError):
                    ring = None           # another host or another /dev/shm: the bytes come inline
            conn.sendall(b"OS" if ring is not None else b"OK")
        except (OSError, ConnectionError, struct.error):
            conn.close()
            return
        pipe = StepPipe(self.s)
        self.s.streams.add(pipe)
        writer = threading.Thread(target=self._write_replies, args=(conn, pipe), name="data-replies", daemon=True)
        writer.start()
        try:
            pipe.pump(self._frames(conn, pipe, ring))
        finally:
            self.s.streams.discard(pipe)
            writer.join(5)
            conn.close()

    @staticmethod
    def _frames(conn: socket.socket, pipe: StepPipe, ring: ShmRingReader | None):
        while not pipe.cancelled.is_set():
            try:
                kind, hlen, blen = _STEP.unpack(_recv_exact(conn, _STEP.size))
                header = _recv_exact(conn, hlen)
                release = None
                if kind == b"M" and ring is not None:
                    offset, end = _RING.unpack(_recv_exact(conn, _RING.size))
                    hidden, release = ring.hold(offset, blen, end)   # freed once the step is done with it
                elif kind == b"S":
                    hidden = _recv_exact(conn, blen) if blen else None   # a bytearray: no second copy
                else:
                    return                # not a frame of this protocol: drop the link
            except (OSError, ConnectionError, struct.error):
                return                    # the previous stage hung up (or was cancelled)
            yield pb.StepRequest.FromString(bytes(header)), hidden, release

    @staticmethod
    def _write_replies(conn: socket.socket, pipe: StepPipe) -> None:
        while True:
            item = pipe.out.get()
            if item is None:
                return
            reply, ready_at = item
            wait_until(ready_at)
            data = reply.SerializeToString()
            try:
                conn.sendall(_REPLY.pack(len(data)) + data)
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()


class TcpStageLink:
    """The sending side; the interface of StageLink (send, close, cancel, relayed errors)."""

    def __init__(self, address: str, token: str, epoch: int, on_reply, on_failed, timeout_s: float = 30.0):
        host, port = address.rsplit(":", 1)
        self.address = address
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ring = None
        capacity = capacity_from_env()
        if capacity:
            try:
                self.ring = ShmRingWriter(capacity)
            except OSError as e:          # no /dev/shm, or not room for the ring in it
                log.info("no shared-memory ring for %s (%s): hidden states go inline", address, e)
        t, name = token.encode(), (self.ring.name.encode() if self.ring else b"")
        try:
            self.sock.sendall(_HELLO.pack(b"MPD2", len(t)) + t + struct.pack("<QI", epoch, len(name)) + name)
            answer = bytes(_recv_exact(self.sock, 2))
        finally:
            if self.ring is not None:
                self.ring.unlink()        # opened by the next stage or never: the name is not needed
        if answer not in (b"OK", b"OS"):
            self.sock.close()
            raise ConnectionError(f"the next stage {address} refused the data link (token or epoch)")
        if answer == b"OK":
            self.ring = None              # the next stage cannot see our /dev/shm
        log.info("data link to %s: %s", address, f"shared-memory ring of {self.ring.capacity >> 20} MiB"
                 if self.ring is not None else "hidden states inline")
        self.sock.settimeout(None)
        self._on_reply, self._on_failed = on_reply, on_failed
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._sent, self._closed, self._broken = False, False, False
        threading.Thread(target=self._write, name="data-link-send", daemon=True).start()
        self._reader = threading.Thread(target=self._read, name="data-link-recv", daemon=True)
        self._reader.start()

    def send(self, request: pb.StepRequest, ready_at: float = 0.0, hidden: bytes | None = None, done=None) -> None:
        """`done()` runs once `hidden` is no longer needed (its bytes are sent or copied on)."""
        self._sent = True
        self._q.put((request, ready_at, hidden, done))

    def _write(self) -> None:
        while True:
            item = self._q.get()
            if item is _END:
                try:
                    self.sock.shutdown(socket.SHUT_WR)    # the next stage finishes what it has
                except OSError:
                    pass
                return
            request, ready_at, hidden, done = item
            wait_until(ready_at)          # hidden states leave an asynchronous device once they exist
            try:
                self._frame(request, hidden)
            except (OSError, ConnectionError):
                return                    # the reader reports the break
            finally:
                if done is not None:
                    done()                # the bytes are in the next ring or the socket: free ours

    def _frame(self, request: pb.StepRequest, hidden) -> None:
        header = request.SerializeToString()
        parts = payload_parts(hidden) if hidden is not None else ()
        length = sum(len(p) for p in parts)
        if self.ring is not None and 0 < length <= self.ring.capacity:
            offset, end = self.ring.put(parts, stopped=lambda: self._broken)
            self.sock.sendall(_STEP.pack(b"M", len(header), length) + header + _RING.pack(offset, end))
            return
        self.sock.sendall(_STEP.pack(b"S", len(header), length) + header)
        for part in parts:
            self.sock.sendall(part)     # no copy in Python: the kernel reads the bytes

    def _read(self) -> None:
        broke = False
        try:
            while True:
                (n,) = _REPLY.unpack(_recv_exact(self.sock, _REPLY.size))
                self._on_reply(pb.StepReply.FromString(bytes(_recv_exact(self.sock, n))))   # an error
        except (OSError, ConnectionError, struct.error):
            broke = not self._closed
        self._broken = True               # a writer waiting for ring space gives up
        if broke and self._sent:          # 0: "the chain broke", the steps down there are lost
            self._on_failed(0, grpc.StatusCode.UNAVAILABLE, f"next stage {self.address}: data link closed")

    def close(self, wait_s: float = 0.0) -> None:
        self._closed = True
        self._q.put(_END)
        if wait_s:
            self._reader.join(wait_s)

    def cancel(self) -> None:
        self._closed = self._broken = True
        self._q.put(_END)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
