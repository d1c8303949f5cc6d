"""worker/omp_pool.py: work run through in_own_thread leaves no OpenMP pool behind (the helpers of
the pool it opened exit with it), so the thread that runs steps keeps the only one; results and
exceptions come back to the caller."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from worker.omp_pool import in_own_thread


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> float:
    return float(torch.ones(1 << 22).add_(1).sum())   # large enough for torch to open a parallel region


def _settles_at(count: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads() == count


def test_result_and_exception_come_back():
    assert in_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        in_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2+ CPUs")
def test_its_openmp_pool_goes_with_it():
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        base = _threads()
        assert in_own_thread(_parallel_work) == 2.0 * (1 << 22)
        assert _settles_at(base)                        # the thread and its pool's helper are gone
        # the contrast: a thread that stays keeps its pool's helper alive
        go, done = threading.Event(), threading.Event()

        def stays():
            _parallel_work()
            go.set()
            done.wait()
        t = threading.Thread(target=stays, daemon=True)
        t.start()
        go.wait()
        assert _threads() >= base + 2                   # the thread itself and at least one helper
        done.set()
        t.join()
        assert _settles_at(base)
    finally:
        torch.set_num_threads(before_threads)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2+ CPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_move_copies_open_no_pool_on_their_thread(dtype):
    """A K/V move reads and writes blocks on threads that live on (the PullQueue, the data link's
    block reads): its copies must not give those threads an OpenMP pool of their own."""
    from worker.paged_cache import PagedKVCache
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _parallel_work()                                # this thread's pool, as the step thread's
        src, dst = (PagedKVCache(2, 4096, 4, 16, 64, dtype) for _ in range(2))   # 64 MiB a layer in float32
        for c in src.key_cache + src.value_cache:
            c.copy_(torch.randn_like(c, dtype=torch.float32))
        ids, to = list(range(0, 4096, 2)), list(range(1, 4096, 2))
        base, go, done, out = _threads(), threading.Event(), threading.Event(), {}

        def move():
            dst.write_blocks(to, src.read_blocks(ids))
            out["back"] = dst.read_blocks(to)
            go.set()
            done.wait()
        t = threading.Thread(target=move, daemon=True)
        t.start()
        go.wait()
        assert _threads() == base + 1                   # the thread itself, and no helper beside it
        done.set()
        t.join()
        assert out["back"] == src.read_blocks(ids)
        for a, b in zip(src.key_cache + src.value_cache, dst.key_cache + dst.value_cache):
            assert torch.equal(b[1::2], a[0::2]) and not b[0::2].any()
    finally:
        torch.set_num_threads(before_threads)
