"""The data link's split steps (worker/link_frames.py): a step whose hidden states exist later goes as
a header at once and its data when it exists; the receiving stage gets the steps in order, each
split one's bytes exactly, whatever frames come between; a refused step still takes its data; a
link that ends first fails the step, not the stream's order."""
from __future__ import annotations

import json
import queue
import socket
import threading
import time

import grpc
import pytest

from client import LocalCluster
from minipaged.step_frames import STEP
from minipaged.v1 import worker_pb2 as pb
from worker.link_frames import END, FrameReader, FrameWriter
from worker.shm_ring import ShmRingReader, ShmRingWriter
from worker.step_stream import PendingHidden, StepError
from tests.test_scale import config_only, settle_all  # noqa: F401 (fixture)

SOON = 1.0   # seconds until a split step's bytes "exist": long enough that its header surely goes first


def link(ring_capacity: int = 0):
    """A writer thread and a reader over a socket pair (and a shared-memory ring if asked)."""
    a, b = socket.socketpair()
    w_ring = r_ring = None
    if ring_capacity:
        w_ring = ShmRingWriter(ring_capacity)
        r_ring = ShmRingReader(w_ring.name)
        w_ring.unlink()
    q = queue.SimpleQueue()
    writer = FrameWriter(a, w_ring, q, lambda: False)
    t = threading.Thread(target=lambda: (writer.run(), a.shutdown(socket.SHUT_WR)), daemon=True)
    t.start()
    return q, FrameReader(b, r_ring, threading.Event()), t


def put(q, step_id: int, payload: bytes, delay: float) -> None:
    q.put((pb.StepRequest(step_id=step_id), time.monotonic() + delay, (payload,) if payload else (), len(payload),
           None))


@pytest.mark.parametrize("ring", [0, 1 << 16])
def test_split_steps_come_in_order_with_their_own_bytes(ring):
    q, reader, t = link(ring)
    put(q, 1, b"a" * 300, SOON)
    put(q, 2, b"b" * 200, SOON + 0.2)
    q.put(END)
    it = iter(reader)
    (r1, h1, _), (r2, h2, _) = next(it), next(it)     # both headers, before either's bytes exist
    assert (r1.step_id, r2.step_id) == (1, 2)
    assert isinstance(h1, PendingHidden) and isinstance(h2, PendingHidden)
    assert (len(h1), len(h2)) == (300, 200) and not h1.filled and not h2.filled
    assert bytes(h1.get()) == b"a" * 300 and bytes(h2.get()) == b"b" * 200
    if ring:
        assert h1.release is not None                  # ring bytes are held until the step frees them
        h1.release(), h2.release()
    assert list(it) == []                              # then the writer ended the link
    t.join(5)


def test_a_whole_frame_is_never_overtaken_by_a_later_header():
    q, reader, t = link()
    put(q, 1, b"a" * 10, SOON)
    put(q, 2, b"", SOON + 0.1)      # no bytes (a move): goes whole at its time
    put(q, 3, b"c" * 10, SOON + 1.0)
    q.put(END)
    got = [(r.step_id, h) for r, h, _ in reader]
    assert [s for s, _ in got] == [1, 2, 3]
    assert got[1][1] is None                          # step 3's header waited for step 2, then went alone
    assert isinstance(got[2][1], PendingHidden) and bytes(got[2][1].get()) == b"c" * 10


def test_a_refused_step_still_takes_its_data_and_the_next_gets_its_own():
    q, reader, t = link()
    put(q, 1, b"a" * 10, SOON)
    put(q, 2, b"b" * 10, SOON)
    q.put(END)
    it = iter(reader)
    (_, h1, _), (_, h2, _) = next(it), next(it)
    h1.settle()                                        # step 1 refused: its bytes are read and dropped
    assert h1.filled and bytes(h2.get()) == b"b" * 10


def test_a_link_that_ends_before_the_data_fails_the_step():
    a, b = socket.socketpair()
    header = pb.StepRequest(step_id=7).SerializeToString()
    a.sendall(STEP.pack(b"H", len(header), 64) + header)
    a.close()                                          # the previous stage died while it computed
    reader = FrameReader(b, None, threading.Event())
    it = iter(reader)
    r, h, _ = next(it)
    with pytest.raises(StepError) as e:
        h.get()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "ended before" in e.value.message
    assert list(it) == []


@pytest.mark.parametrize("frame", [
    STEP.pack(b"D", 0, 8) + b"x" * 8,                  # data with no header waiting for it
    STEP.pack(b"Q", 0, 0),                             # no such kind
])
def test_frames_of_no_protocol_drop_the_link(frame):
    a, b = socket.socketpair()
    a.sendall(frame)
    assert list(FrameReader(b, None, threading.Event())) == []


def test_data_of_another_length_than_announced_drops_the_link():
    a, b = socket.socketpair()
    header = pb.StepRequest(step_id=1).SerializeToString()
    a.sendall(STEP.pack(b"H", len(header), 16) + header + STEP.pack(b"D", 0, 8) + b"x" * 8)
    r, h, _ = next(iter(FrameReader(b, None, threading.Event())))
    with pytest.raises(StepError):
        h.get()


def test_a_pipeline_whose_head_dies_between_header_and_data_recomputes_exactly(config_only, tmp_path):
    """Simulated stages split every step (their results exist 30 ms after the call): stage 0 of one
    replica is killed mid-job, so its next stage may hold a header whose data never comes. That
    step fails UNAVAILABLE, the chain is lost, and its requests finish on the other replica with
    the tokens of a quiet run."""
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"fixed_step_s": 0.03}))
    reqs = [{"prompt_token_ids": list(range(4000 + i, 4030 + 3 * i)), "max_new_tokens": 24} for i in range(12)]
    with LocalCluster(model=config_only, workers=2, replicas=2, simulate=str(slow), dtype=None,
                      extra_service_args=["--max-num-seqs", "4"]) as c:
        want = [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=120)]
        job = c.client.submit(reqs)
        deadline = time.monotonic() + 60
        while c.client.get_job(job).completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c.kill_worker(0)                                  # replica 0's stage 0, steps in flight
        got = c.client.wait(job, timeout=120)
        assert [r.token_ids for r in got] == want and not any(r.error for r in got)
        assert c.client.stats().num_chains == 1
        settle_all(c.client)
