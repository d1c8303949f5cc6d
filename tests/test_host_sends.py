"""A host device's replies and sampled tokens leave from the step's own thread (worker/frame_line.py,
used by the results link and worker/first_stage.py), an asynchronous device's through a writer
thread; either way in step order."""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

from minipaged import step_frames
from minipaged.v1 import worker_pb2 as pb
from worker.first_stage import FirstStageLink
from worker.frame_line import FrameLine


def _read_frames(sock: socket.socket, n: int, parse) -> list:
    out = []
    for _ in range(n):
        (k,) = step_frames.REPLY.unpack(step_frames.recv_exact(sock, step_frames.REPLY.size))
        out.append(parse(bytes(step_frames.recv_exact(sock, k))))
    return out


def _reply(step_id: int) -> pb.StepReply:
    return pb.StepReply(step_id=step_id, cache_epoch=7)


def _readable_now(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_results_go_out_in_step_order_and_host_replies_at_once():
    a, b = socket.socketpair()
    b.settimeout(5)
    line = FrameLine("step results", a)
    line.put((_reply(1), 0.0))                       # before the subscriber's b"OK": queued
    assert not _readable_now(b)
    writer = threading.Thread(target=line.write, daemon=True)
    writer.start()
    assert [r.step_id for r in _read_frames(b, 1, pb.StepReply.FromString)] == [1]
    line.put((_reply(2), time.monotonic() + 0.2))    # a simulated device: its reply exists later
    line.put((_reply(3), 0.0))                       # a host reply may not pass it
    assert [r.step_id for r in _read_frames(b, 2, pb.StepReply.FromString)] == [2, 3]
    for _ in range(50):                              # the writer has taken step 3 off the count
        if line._queued == 0:
            break
        time.sleep(0.01)
    line.put((_reply(4), 0.0))                       # nothing queued: sent by this thread, now
    assert _readable_now(b)
    assert [r.step_id for r in _read_frames(b, 1, pb.StepReply.FromString)] == [4]
    line.put(None)
    writer.join(5)
    assert not writer.is_alive()
    a.close()


def test_a_failed_send_ends_the_results_line():
    a, b = socket.socketpair()
    line = FrameLine("step results", a)
    writer = threading.Thread(target=line.write, daemon=True)
    writer.start()
    for _ in range(50):
        if line._writing:
            break
        time.sleep(0.01)
    b.close()
    for sid in range(1, 200):                        # the peer is gone: a send fails, none raises
        line.put((_reply(sid), 0.0))
        if line._broken:
            break
    assert line._broken
    writer.join(5)                                   # and the writer ends (its caller unsubscribes)
    assert not writer.is_alive()
    a.close()


def _tokens_server():
    """Stage 0's end of the TOKENS link: accepts one hello, answers b"OK", hands back the socket."""
    srv = socket.create_server(("127.0.0.1", 0))
    got: list = []

    def serve():
        conn, _ = srv.accept()
        conn.settimeout(5)
        magic, n = step_frames.HELLO.unpack(step_frames.recv_exact(conn, step_frames.HELLO.size))
        step_frames.recv_exact(conn, n + 8)
        (ring,) = struct.unpack("<I", step_frames.recv_exact(conn, 4))
        step_frames.recv_exact(conn, ring)
        assert magic == step_frames.TOKENS_MAGIC
        conn.sendall(b"OK")
        got.append(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t, got


class _Channel:
    def close(self):
        pass


def test_sampled_tokens_keep_step_order_across_the_thread_and_the_inline_sends():
    srv, t, got = _tokens_server()
    link = FirstStageLink()
    link.connect("stage0:1", "", lambda address, options: _Channel(), (),
                 data_address=f"127.0.0.1:{srv.getsockname()[1]}", epoch=3)

    def send(step_id: int, ready_at: float = 0.0) -> None:
        link.send(step_id, 3, struct.pack("<q", step_id), struct.pack("<i", step_id), ready_at)

    send(1)                                          # opens the line on the sender thread
    t.join(5)
    conn = got[0]
    parse = pb.SampledTokens.FromString
    assert [m.step_id for m in _read_frames(conn, 1, parse)] == [1]
    for _ in range(50):                              # the line's thread has drained what it queued
        if link._line is not None and link._line._writing and link._line._queued == 0:
            break
        time.sleep(0.01)
    send(2)                                          # drained: this thread sends it
    assert _readable_now(conn)
    send(3, time.monotonic() + 0.2)                  # an asynchronous device's: queued
    send(4)                                          # behind it, not ahead
    assert [m.step_id for m in _read_frames(conn, 3, parse)] == [2, 3, 4]
    link.close()
    conn.close()
    srv.close()
