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

The frames are minipaged/step_frames.py's. The same socket protocol carries the metadata service's
Steps to stage 0 and the last stage's results back to it (RESULTS_MAGIC): the one step protocol,
on one transport. The hello carries the worker token (compared in constant time); the link is
offered only without TLS (with TLS, Steps, results and hidden states stay on the gRPC streams,
which are encrypted)."""
from __future__ import annotations

import hmac
import logging
import queue
import socket
import struct
import threading

import grpc
from google.protobuf.message import DecodeError

from minipaged.step_frames import HELLO as _HELLO, KV_MAGIC, REPLY as _REPLY, RESULTS_MAGIC, STEPS_MAGIC, \
    TOKENS_MAGIC, connect, read_reply, recv_exact as _recv_exact
from minipaged.v1 import worker_pb2 as pb
from worker.kv_move import serve_kv_read
from worker.link_frames import END, FrameReader, FrameWriter
from worker.frame_line import FrameLine
from worker.shm_ring import ShmRingReader, ShmRingWriter, capacity_from_env
from worker.step_stream import StepPipe, wait_until

log = logging.getLogger("worker.data_link")
HELLO_TIMEOUT_S = 10.0   # a data-link peer's hello must come within this


def payload_parts(payload) -> tuple:
    """Hidden states leave a stage as bytes, a bytearray, a memoryview or a tuple of them (the
    simulator's ids + shared zeros): sent part by part, never joined in Python."""
    return payload if isinstance(payload, tuple) else (payload,)


def payload_bytes(payload) -> bytes:
    """One bytes object, for the paths that put hidden states inside a protobuf message."""
    return payload if isinstance(payload, bytes) else b"".join(payload_parts(payload))


class DataServer:
    """Accepts data links: from the previous stage or the metadata service (STEPS_MAGIC: one
    ordered pipe of steps each), and the service's results subscription (RESULTS_MAGIC)."""

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
            # a peer that connects and never says who it is holds a thread and a descriptor: it has
            # HELLO_TIMEOUT_S for its hello, and the link is blocking again once it is accepted
            conn.settimeout(HELLO_TIMEOUT_S)
            magic, n = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if magic not in (STEPS_MAGIC, RESULTS_MAGIC, TOKENS_MAGIC, KV_MAGIC) or n > 4096:
                conn.close()
                return
            token = bytes(_recv_exact(conn, n))
            epoch, m = struct.unpack("<QI", _recv_exact(conn, 12))
            name = bytes(_recv_exact(conn, m)).decode("ascii", "replace") if m <= 256 else ""
            ok = hmac.compare_digest(token, self.token) and epoch == self.s.epoch and epoch and m <= 256
            if magic == RESULTS_MAGIC:
                ok = ok and self.s.runner.is_last
            elif magic == TOKENS_MAGIC:
                ok = ok and self.s.runner.is_first
            conn.settimeout(None)
            if not ok:
                conn.sendall(b"NO")       # wrong token, a stale epoch, results not from the last stage
                conn.close()              # or tokens to a stage that is not first
                return
            if magic == RESULTS_MAGIC:
                return self._serve_results(conn)
            if magic == TOKENS_MAGIC:
                return self._serve_tokens(conn)
            if magic == KV_MAGIC:
                return serve_kv_read(self.s, conn)
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
        self._serve_steps(conn, ring)

    def _serve_results(self, conn: socket.socket) -> None:
        """StepResults on the socket: this epoch's replies, in order, until the subscriber hangs
        up, a newer one takes over, or the epoch ends."""
        q = self.s.subscribe_results(FrameLine("step results", conn))
        try:
            conn.sendall(b"OK")          # subscribed: steps may flow now
        except OSError:
            q.put(None)
        # the subscriber sends nothing more: end of file (or an error) means it left
        threading.Thread(target=lambda: (_wait_closed(conn), q.put(None)), name="results-peer", daemon=True).start()
        try:
            q.write()
        finally:
            self.s.unsubscribe_results(q)
            conn.close()

    def _serve_tokens(self, conn: socket.socket) -> None:
        """SampledTokenStream on the socket: the last stage's tokens, until it hangs up."""
        try:
            conn.sendall(b"OK")
            while True:
                self.s.sampled_tokens(pb.SampledTokens.FromString(read_reply(conn)))
        except (OSError, ConnectionError, struct.error):
            pass
        except DecodeError:               # not a SampledTokens message: drop the link, as gRPC would
            log.warning("sampled tokens on the data link: an unreadable frame; link closed")
        finally:
            conn.close()

    def _serve_steps(self, conn: socket.socket, ring: ShmRingReader | None) -> None:
        pipe = StepPipe(self.s)
        self.s.streams.add(pipe)
        writer = threading.Thread(target=self._write_replies, args=(conn, pipe), name="data-replies", daemon=True)
        writer.start()
        try:
            pipe.pump(FrameReader(conn, ring, pipe.cancelled))
        finally:
            self.s.streams.discard(pipe)
            writer.join(5)
            conn.close()

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


def _wait_closed(conn: socket.socket) -> None:
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass


class TcpStageLink:
    """The sending side; the interface of StageLink (send, close, cancel, relayed errors)."""

    def __init__(self, address: str, token: str, epoch: int, on_reply, on_failed, timeout_s: float = 30.0):
        self.address = address
        self.ring = None
        capacity = capacity_from_env()
        if capacity:
            try:
                self.ring = ShmRingWriter(capacity)
            except OSError as e:          # no /dev/shm, or not room for the ring in it
                log.info("no shared-memory ring for %s (%s): hidden states go inline", address, e)
        try:
            self.sock, answer = connect(address, STEPS_MAGIC, token, epoch, timeout_s,
                                        self.ring.name if self.ring else "")
        finally:
            if self.ring is not None:
                self.ring.unlink()        # opened by the next stage or never: the name is not needed
        if answer == b"OK":
            self.ring = None              # the next stage cannot see our /dev/shm
        log.info("data link to %s: %s", address, f"shared-memory ring of {self.ring.capacity >> 20} MiB"
                 if self.ring is not None else "hidden states inline")
        self._on_reply, self._on_failed = on_reply, on_failed
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._sent, self._closed, self._broken = False, False, False
        threading.Thread(target=self._write, name="data-link-send", daemon=True).start()
        self._reader = threading.Thread(target=self._read, name="data-link-recv", daemon=True)
        self._reader.start()

    def send(self, request: pb.StepRequest, ready_at: float = 0.0, hidden: bytes | None = None, done=None) -> None:
        """`done()` runs once `hidden` is no longer needed (its bytes are sent or copied on)."""
        self._sent = True
        parts = payload_parts(hidden) if hidden is not None else ()
        self._q.put((request, ready_at, parts, sum(len(p) for p in parts), done))

    def _write(self) -> None:
        FrameWriter(self.sock, self.ring, self._q, lambda: self._broken).run()
        try:
            self.sock.shutdown(socket.SHUT_WR)    # the next stage finishes what it has
        except OSError:
            pass

    def _read(self) -> None:
        broke = False
        try:
            while True:
                self._on_reply(pb.StepReply.FromString(read_reply(self.sock)))   # an error
        except (OSError, ConnectionError, struct.error):
            broke = not self._closed
        self._broken = True               # a writer waiting for ring space gives up
        if broke and self._sent:          # 0: "the chain broke", the steps down there are lost
            self._on_failed(0, grpc.StatusCode.UNAVAILABLE, f"next stage {self.address}: data link closed")

    def close(self, wait_s: float = 0.0) -> None:
        self._closed = True
        self._q.put(END)
        if wait_s:
            self._reader.join(wait_s)

    def cancel(self) -> None:
        self._closed = self._broken = True
        self._q.put(END)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
