"""worker/omp_pool.py: work run through in_own_thread leaves no OpenMP pool behind (the helpers of
the pool it opened exit with it), so the thread that runs steps keeps the only one; results and
exceptions come back to the caller. K/V moves, which run on threads that live on, open no pool.

The thread counts are taken in a fresh interpreter (`_fresh`): pytest's own process carries the
threads of earlier tests, which come and go on their own schedule."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from worker.omp_pool import in_own_thread

needs_two_cpus = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                                    reason="needs Linux, 2+ CPUs")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> float:
    return float(torch.ones(1 << 22).add_(1).sum())   # large enough for torch to open a parallel region


def _settles_at(count: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads() == count


def _fresh(fn, *args):
    """fn(*args) in a new interpreter; its AssertionError comes back as this test's."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _on_a_live_thread(work):
    """Run work() on a thread that stays alive; the process's thread count while it does."""
    go, done, out = threading.Event(), threading.Event(), {}

    def stays():
        out["result"] = work()
        go.set()
        done.wait()
    t = threading.Thread(target=stays, daemon=True)
    t.start()
    go.wait()
    count = _threads()
    done.set()
    t.join()
    return count, out["result"]


def test_result_and_exception_come_back():
    assert in_own_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        in_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def _pool_goes_with_its_thread() -> None:
    torch.set_num_threads(2)
    _parallel_work()                                   # the main thread's pool, as the step thread's
    base = _threads()
    assert in_own_thread(_parallel_work) == 2.0 * (1 << 22)
    assert _settles_at(base)                           # the thread and its pool's helper are gone
    count, _ = _on_a_live_thread(_parallel_work)       # the contrast: a thread that stays keeps its pool
    assert count >= base + 2                           # the thread itself and at least one helper
    assert _settles_at(base)


@needs_two_cpus
def test_its_openmp_pool_goes_with_it():
    _fresh(_pool_goes_with_its_thread)


def _kv_move_opens_no_pool(dtype: str) -> None:
    from worker.paged_cache import PagedKVCache
    torch.set_num_threads(2)
    _parallel_work()
    src, dst = (PagedKVCache(2, 4096, 4, 16, 64, dtype) for _ in range(2))   # 64 MiB a layer in float32
    for c in src.key_cache + src.value_cache:
        c.copy_(torch.randn_like(c, dtype=torch.float32))
    ids, to = list(range(0, 4096, 2)), list(range(1, 4096, 2))
    base = _threads()

    def move():
        dst.write_blocks(to, src.read_blocks(ids))
        return dst.read_blocks(to)
    count, back = _on_a_live_thread(move)
    assert count == base + 1                           # the thread itself, and no helper beside it
    assert back == src.read_blocks(ids)
    for a, b in zip(src.key_cache + src.value_cache, dst.key_cache + dst.value_cache):
        assert torch.equal(b[1::2], a[0::2]) and not b[0::2].any()


@needs_two_cpus
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_move_copies_open_no_pool_on_their_thread(dtype):
    """A K/V move reads and writes blocks on threads that live on (the PullQueue, the data link's
    block reads): its copies must not give those threads an OpenMP pool of their own."""
    _fresh(_kv_move_opens_no_pool, dtype)
