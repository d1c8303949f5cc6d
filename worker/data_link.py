"""The TCP data link: hidden states from one stage to the next on a plain socket, beside gRPC.

A forward through gRPC copies a step's hidden states about seven times (protobuf, serialization,
grpc's buffers, on both sides) and costs ~1.4 ms of round trip for a 1.6 MB decode step and ~17 ms
for a 16 MB prefill chunk on this machine; a socket copies them once per side (0.4 ms and 3.4 ms).
NCCL plays this part between GPUs; this is the host path. The control side is unchanged: the
same StepRequest (without its hidden_states bytes) leads each frame, the same ordered pipe runs the
steps (worker/step_stream.py), errors come back on the same connection, and the last stage of a
multi-stage chain still answers the metadata service on StepResults.

Frames (little endian). Client hello: b"MPD1", u32 token length, token, u64 cache epoch; the server
answers b"OK" or closes. Then steps: b"S", u32 header length, u64 hidden length, the StepRequest
bytes, the hidden bytes. Back: u32 length, a StepReply. The hello carries the worker token (compared
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
from worker.step_stream import StepPipe, wait_until

log = logging.getLogger("worker.data_link")
_HELLO, _STEP, _REPLY = struct.Struct("<4sI"), struct.Struct("<cIQ"), struct.Struct("<I")
_END = object()


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
            if magic != b"MPD1" or n > 4096:
                return
            token = bytes(_recv_exact(conn, n))
            (epoch,) = struct.unpack("<Q", _recv_exact(conn, 8))
            if not hmac.compare_digest(token, self.token) or epoch != self.s.epoch or not epoch:
                conn.sendall(b"NO")       # wrong token or a stale epoch: nothing runs
                return
            conn.sendall(b"OK")
        except (OSError, ConnectionError, struct.error):
            conn.close()
            return
        pipe = StepPipe(self.s)
        self.s.streams.add(pipe)
        writer = threading.Thread(target=self._write_replies, args=(conn, pipe), name="data-replies", daemon=True)
        writer.start()
        try:
            pipe.pump(self._frames(conn, pipe))
        finally:
            self.s.streams.discard(pipe)
            writer.join(5)
            conn.close()

    @staticmethod
    def _frames(conn: socket.socket, pipe: StepPipe):
        while not pipe.cancelled.is_set():
            try:
                kind, hlen, blen = _STEP.unpack(_recv_exact(conn, _STEP.size))
                header = _recv_exact(conn, hlen)
                hidden = bytes(_recv_exact(conn, blen)) if blen else None
            except (OSError, ConnectionError):
                return                    # the previous stage hung up (or was cancelled)
            yield pb.StepRequest.FromString(bytes(header)), hidden

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
    """The sending side; the interface of StageLink (send, close, cancel, relayed replies)."""

    def __init__(self, address: str, token: str, epoch: int, on_reply, on_failed, timeout_s: float = 30.0):
        host, port = address.rsplit(":", 1)
        self.address = address
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = token.encode()
        self.sock.sendall(_HELLO.pack(b"MPD1", len(t)) + t + struct.pack("<Q", epoch))
        if bytes(_recv_exact(self.sock, 2)) != b"OK":
            self.sock.close()
            raise ConnectionError(f"the next stage {address} refused the data link (token or epoch)")
        self.sock.settimeout(None)
        self._on_reply, self._on_failed = on_reply, on_failed
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding: list[int] = []
        self._direct_sent, self._closed = False, False
        self._lock = threading.Lock()
        threading.Thread(target=self._write, name="data-link-send", daemon=True).start()
        self._reader = threading.Thread(target=self._read, name="data-link-recv", daemon=True)
        self._reader.start()

    def send(self, request: pb.StepRequest, ready_at: float = 0.0, track: bool = True,
             hidden: bytes | None = None) -> None:
        with self._lock:
            if track:
                self._outstanding.append(request.step_id)
            else:
                self._direct_sent = True
        self._q.put((request, ready_at, hidden))

    def _write(self) -> None:
        while True:
            item = self._q.get()
            if item is _END:
                try:
                    self.sock.shutdown(socket.SHUT_WR)    # the next stage finishes what it has
                except OSError:
                    pass
                return
            request, ready_at, hidden = item
            wait_until(ready_at)          # hidden states leave an asynchronous device once they exist
            header = request.SerializeToString()
            try:
                self.sock.sendall(_STEP.pack(b"S", len(header), len(hidden or b"")) + header)
                if hidden:
                    self.sock.sendall(hidden)   # no copy in Python: the kernel reads the bytes
            except OSError:
                return                    # the reader reports the break

    def _read(self) -> None:
        broke = False
        try:
            while True:
                (n,) = _REPLY.unpack(_recv_exact(self.sock, _REPLY.size))
                reply = pb.StepReply.FromString(bytes(_recv_exact(self.sock, n)))
                with self._lock:
                    if reply.step_id in self._outstanding:
                        self._outstanding.remove(reply.step_id)
                self._on_reply(reply)
        except (OSError, ConnectionError, struct.error):
            broke = not self._closed
        with self._lock:
            lost, self._outstanding = self._outstanding, []
            if broke and self._direct_sent:
                lost.append(0)   # steps whose replies go direct were lost too: 0 = "the chain broke"
        for step_id in lost:
            self._on_failed(step_id, grpc.StatusCode.UNAVAILABLE, f"next stage {self.address}: data link closed")

    def close(self, wait_s: float = 0.0) -> None:
        self._closed = True
        self._q.put(_END)
        if wait_s:
            self._reader.join(wait_s)

    def cancel(self) -> None:
        self._closed = True
        self._q.put(_END)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
