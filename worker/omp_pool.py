"""Keep the worker's OpenMP helper threads spinning between a step's parallel regions.

libgomp gives every thread that opens a parallel region a pool of helper threads of its own, kept
until that thread exits, and counts the helpers of all pools together: once the count passes the
CPUs, every helper waits at most 100 spins (not 300,000) before sleeping on a futex, so each of the
hundreds of parallel regions in a step pays a wake-up. The worker loads its model on the main
thread and allocates the K/V cache on a gRPC thread, and runs its steps on a third (the data
link's), so on a 2-core machine it held three pools: a 16 x 1024 x 6144 GEMM took 0.52 ms from a
second thread instead of 0.46, the Qwen3-0.6B decode-heavy job 6.2 s instead of 5.3
(bench/results/cpu-gemm-prefetch-2026-12-06.md). Work that opens parallel regions outside the
step path runs through `in_own_thread`: a thread that exits when the work is done, and takes its
pool with it. (Several pipeline stages on one machine share its cores anyway: there the cluster
sets OMP_WAIT_POLICY=PASSIVE.)
"""
from __future__ import annotations

import threading


def in_own_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a short-lived thread; its result, or its exception re-raised here."""
    out: list = []

    def target():
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            out.append((False, e))

    t = threading.Thread(target=target, name="omp-once", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
