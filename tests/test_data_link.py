"""The data link between stages: the shared-memory ring (worker/shm_ring.py) on its own, then whole
two-stage chains with the ring and with the bytes inline, token-exact against transformers."""
from __future__ import annotations

import os
import threading
import time

import pytest

from client import LocalCluster
from tests.test_e2e import ckpt, oracle, prompts  # noqa: F401 (fixtures)
from tests.test_scale import exact_job, settle_all
from minipaged import step_frames
from worker.shm_ring import SHM_DIR, ShmRingReader, ShmRingWriter


def ring_pair(capacity):
    w = ShmRingWriter(capacity)
    r = ShmRingReader(w.name)
    w.unlink()
    return w, r


def test_ring_round_trips_payloads_in_parts_and_skips_the_wrap():
    w, r = ring_pair(100)
    assert not os.path.exists(os.path.join(SHM_DIR, w.name))     # nothing left behind in /dev/shm
    seen = []
    for i, n in enumerate([30, 30, 30, 30, 70, 1, 99, 100]):
        payload = bytes((i + k) % 256 for k in range(n))
        offset, end = w.put((payload[:7], memoryview(payload)[7:]))
        assert offset + n <= 100                                  # never split across the end
        out, release = r.hold(offset, n, end)
        assert isinstance(out, memoryview) and not out.readonly and bytes(out) == payload
        release()
        seen.append(offset)
    assert seen[:4] == [0, 30, 60, 0]                             # the 4th skipped the 10-byte tail


def test_a_writer_waits_for_room_until_the_reader_frees_it():
    w, r = ring_pair(64)
    first = w.put((b"a" * 40,))
    done = []
    t = threading.Thread(target=lambda: done.append(w.put((b"b" * 40,))))
    t.start()
    time.sleep(0.05)
    assert not done                                               # no room until the first is freed
    view, release = r.hold(first[0], 40, first[1])
    assert bytes(view) == b"a" * 40
    time.sleep(0.05)
    assert not done                                               # held (a step computes in it): still none
    release()
    t.join(5)
    offset, end = done[0]
    view, release = r.hold(offset, 40, end)
    assert bytes(view) == b"b" * 40


def test_frames_free_in_ring_order_whatever_order_their_steps_end():
    w, r = ring_pair(90)
    frames = [r.hold(*_at(w.put((bytes([i]) * 30,)))) for i in range(3)]
    frames[1][1]()                                                # the 2nd step ended first
    assert int(r._consumed[0]) == 0                               # the 1st still holds its bytes
    frames[0][1]()
    assert int(r._consumed[0]) == 60                              # both freed, the 3rd still held
    frames[0][1]()                                                # a second release changes nothing
    frames[2][1]()
    assert int(r._consumed[0]) == 90


def _at(put):
    offset, end = put
    return offset, end - offset, end


def test_a_stopped_link_gives_up_waiting_and_bad_frames_are_refused():
    w, r = ring_pair(64)
    w.put((b"x" * 60,))
    with pytest.raises(ConnectionError):
        w.put((b"y" * 10,), stopped=lambda: True)
    with pytest.raises(ValueError):
        w.put((b"z" * 65,))                                       # bigger than the ring: sent inline
    with pytest.raises(ConnectionError):
        r.hold(40, 30, 70)                                        # out of bounds: the link drops
    with pytest.raises(ValueError):
        ShmRingReader("../../etc/passwd")                         # only ring names are opened


@pytest.mark.slow
@pytest.mark.parametrize("shm_mb", ["64", "0"], ids=["shared-memory", "inline"])
def test_two_stages_are_exact_with_the_ring_and_inline(ckpt, oracle, shm_mb):
    before = {n for n in os.listdir(SHM_DIR) if n.startswith("minipaged-")}
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4,
                      env={"MINIPAGED_DATA_SHM_MB": shm_mb},
                      extra_service_args=["--max-num-batched-tokens", "32"]) as c:
        exact_job(c.client, oracle, prompts(12, 1, 60, seed=41), 8)
        settle_all(c.client)
        logs = c.logs(200)
    want = "shared-memory ring of 64 MiB" if shm_mb != "0" else "hidden states inline"
    assert f": {want}" in logs
    assert {n for n in os.listdir(SHM_DIR) if n.startswith("minipaged-")} <= before


@pytest.mark.slow
@pytest.mark.parametrize("data_port", ["0", "-1"], ids=["data-link", "grpc"])
def test_the_service_steps_on_the_data_link_or_on_grpc_and_both_are_exact(ckpt, oracle, data_port):
    """Steps to stage 0, results from the last stage and the sampled tokens the last stage sends
    stage 0 (async inputs across the pipeline) ride the workers' data link when they offer one
    (`--data-port -1`: they do not, and gRPC carries them): the same tokens either way."""
    with LocalCluster(model=ckpt, workers=2, dtype="float64", block_size=4,
                      extra_worker_args=["--data-port", data_port],
                      extra_service_args=["--max-num-batched-tokens", "32"]) as c:
        exact_job(c.client, oracle, prompts(8, 1, 40, seed=43), 6)
        settle_all(c.client)
        logs = c.logs(300)
    want = "the data link" if data_port == "0" else "gRPC"
    assert f"steps and results on {want}" in logs
    assert ("sampled tokens to stage 0 on the data link" in logs) == (data_port == "0")


def test_a_results_link_needs_the_token_the_epoch_and_the_last_stage(ckpt):
    """Who may read a chain's results on the data link: the worker token, at the chain's epoch,
    from its last stage; who may send stage 0 sampled tokens: the same token and epoch, to stage 0.
    Anything else is refused (b"NO") and changes nothing."""
    with LocalCluster(model=ckpt, workers=2, dtype="float32", token="s3cret") as c:
        c.client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=2)
        st = c.client.stats()
        epoch = int(st.cache_epoch)
        first, last = (f"127.0.0.1:{p}" for p in _data_ports(c.log_dir, 2))
        for address, token, ep in [(last, "wrong", epoch), (last, "s3cret", epoch + 1), (first, "s3cret", epoch)]:
            with pytest.raises(ConnectionError):
                step_frames.connect(address, step_frames.RESULTS_MAGIC, token, ep, 5.0)
        for address, token, ep in [(first, "wrong", epoch), (first, "s3cret", epoch + 1), (last, "s3cret", epoch)]:
            with pytest.raises(ConnectionError):
                step_frames.connect(address, step_frames.TOKENS_MAGIC, token, ep, 5.0)
        r = c.client.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=2)   # the chain is untouched
        assert r.finish_reason == "length" and c.client.stats().cache_epoch == epoch


def _data_ports(log_dir: str, n: int) -> list[int]:
    import re
    out = []
    for i in range(n):
        with open(os.path.join(log_dir, f"worker{i}.log")) as f:
            out.append(int(re.search(r"data link on [^ ]+:(\d+)", f.read()).group(1)))
    return out
