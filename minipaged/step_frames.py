"""The frames of the TCP data link (worker/data_link.py), shared by its two kinds of caller: a stage
sending Steps to the next one, and the metadata service sending Steps to stage 0 and reading the
last stage's results. Python gRPC costs ~0.3 ms of CPU per streamed message on each side (its
request-iterator, channel-spin and reader threads all take the interpreter lock); a frame on a
socket costs one serialization and one system call.

Little endian. Hello: 4-byte magic, u32 token length, token, u64 cache epoch, u32 ring name length,
ring name (empty: none). The server answers b"OS" (ring opened), b"OK" or b"NO" and closes.
- STEPS_MAGIC: then steps, b"S", u32 header length, u64 hidden length, the StepRequest bytes, the
  hidden bytes; or b"M", the same lengths, the StepRequest bytes, u64 ring offset, u64 ring end.
  A stage whose device is asynchronous (its hidden states exist later, at `ready_at`) may split a
  step: b"H", the same lengths, the StepRequest bytes, at once (the next stage checks the step while
  this one computes); then, when the bytes exist, b"D", 0, the hidden length, the hidden bytes, or
  b"R", 0, the hidden length, u64 ring offset, u64 ring end. Data frames come in the order of their
  H frames; other frames may come between an H and its data, but never a frame that an earlier
  step's header has not preceded.
  Back: u32 length, a StepReply (errors, in-band, as on the StepStream).
- RESULTS_MAGIC (the last stage, at the chain's epoch): StepResults as frames, u32 length, a
  StepReply, for every step of the epoch, in order.
- TOKENS_MAGIC (the last stage to stage 0, at the chain's epoch): SampledTokens as frames, u32
  length, a SampledTokens message; nothing comes back.
- KV_MAGIC (a decode stage reading a prefill stage's blocks, at the source's epoch): one request,
  u32 count, int32 block ids; back b"K", u64 length, the blocks' bytes (PagedKVCache.read_blocks),
  or b"E", u64 length, an error message. Then the link closes."""
from __future__ import annotations

import socket
import struct

HELLO, STEP, REPLY, RING = struct.Struct("<4sI"), struct.Struct("<cIQ"), struct.Struct("<I"), struct.Struct("<QQ")
STEPS_MAGIC, RESULTS_MAGIC, TOKENS_MAGIC, KV_MAGIC = b"MPD2", b"MPR1", b"MPT1", b"MPK1"
KV_ANSWER = struct.Struct("<cQ")


def recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    buf = into if into is not None else bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if k == 0:
            raise ConnectionError("the peer closed the data link")
        got += k
    return buf


def hello(magic: bytes, token: str, epoch: int, ring_name: str = "") -> bytes:
    t, name = token.encode(), ring_name.encode()
    return HELLO.pack(magic, len(t)) + t + struct.pack("<QI", epoch, len(name)) + name


def connect(address: str, magic: bytes, token: str, epoch: int, timeout_s: float, ring_name: str = ""):
    """A connected, greeted link: (socket, the server's 2-byte answer). Raises OSError /
    ConnectionError when the server is unreachable or refuses (b"NO": token or epoch)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(hello(magic, token, epoch, ring_name))
        answer = bytes(recv_exact(sock, 2))
        if answer not in (b"OK", b"OS"):
            raise ConnectionError(f"{address} refused the data link (token or epoch)")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, answer


def read_reply(sock: socket.socket) -> bytes:
    """One reply frame's StepReply bytes."""
    (n,) = REPLY.unpack(recv_exact(sock, REPLY.size))
    return bytes(recv_exact(sock, n))


def step_frame(request_bytes: bytes) -> bytes:
    """A Step whose inputs are inside it (the metadata service's frames: no hidden states)."""
    return STEP.pack(b"S", len(request_bytes), 0) + request_bytes
