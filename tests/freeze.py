"""Hold a live cluster's block pool still: SIGSTOP every worker, so the step in flight never
returns and the metadata service, waiting for it, changes nothing; Stats and PoolSnapshot then
describe one moment that a scrape or a browser can be compared with. SIGCONT on the way out.
The service must be started with a --worker-lease (and --step-timeout) longer than the freeze,
or it fails the silent workers' chain over, as it should: FREEZE_SERVICE_ARGS does that."""
from __future__ import annotations

import contextlib
import os
import signal
import time


FREEZE_SERVICE_ARGS = ["--worker-lease", "300", "--step-timeout", "300"]
POOL_FIELDS = ("num_blocks", "used_blocks", "free_blocks", "cached_blocks", "shared_blocks", "running", "waiting",
               "internal_fragmentation_tokens", "steps", "generated_tokens", "cache_epoch")


def pool_state(st) -> tuple:
    """What does not move while the pool is held (rates and CPU time do)."""
    return tuple(getattr(st, f) for f in POOL_FIELDS)


@contextlib.contextmanager
def frozen(cluster, until=lambda st: True, timeout: float = 60.0):
    """Freeze once `until(stats)` holds; yields the (stable) Stats of the frozen pool."""
    end = time.monotonic() + timeout
    while not until(cluster.client.stats()):
        assert time.monotonic() < end, "the condition to freeze at never held"
        time.sleep(0.02)
    workers = [p for p in cluster.processes[1:] if "gateway" not in p.args]
    for p in workers:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        prev = None
        while True:  # the engine may finish scheduling one more step before it blocks
            st = cluster.client.stats()
            if prev is not None and pool_state(st) == pool_state(prev):
                break
            prev = st
            time.sleep(0.3)
        yield st
        assert pool_state(cluster.client.stats()) == pool_state(st), "the pool moved while frozen"
    finally:
        for p in workers:
            os.kill(p.pid, signal.SIGCONT)
