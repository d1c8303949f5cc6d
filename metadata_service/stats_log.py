"""The periodic activity line, like vLLM's: requests running and waiting, prompt and generation
throughput, KV usage and the prefix-cache hit rate over the last interval. Nothing while idle, so
an idle service's log stays quiet."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("metadata_service.stats")


@dataclass
class Sample:
    at: float                 # monotonic seconds
    prompt_tokens: int
    generated_tokens: int
    prefix_queries: int
    prefix_hits: int


def sample(st: dict, at: float) -> Sample:
    return Sample(at, st.get("prompt_tokens", 0), st.get("generated_tokens", 0),
                  st.get("prefix_cache_queries", 0), st.get("prefix_cache_hits", 0))


def stats_line(prev: Sample, cur: Sample, st: dict, last_queue: tuple = (0, 0)) -> str | None:
    """One line about the interval prev -> cur, or None when no token moved and the queue
    (running, waiting) is what the last line said: idle, or stuck with no worker (said once)."""
    dt = max(cur.at - prev.at, 1e-9)
    prompt, gen = cur.prompt_tokens - prev.prompt_tokens, cur.generated_tokens - prev.generated_tokens
    running, waiting = st.get("running", 0), st.get("waiting", 0)
    if not (prompt or gen) and (running, waiting) == tuple(last_queue):
        return None
    # counters restart with a chain (a lost chain takes its own): a negative delta reads as none
    queries, hits = cur.prefix_queries - prev.prefix_queries, cur.prefix_hits - prev.prefix_hits
    rate = f"{100.0 * hits / queries:.1f}%" if queries > 0 and hits >= 0 else "-"
    blocks, used = st.get("num_blocks", 0), st.get("used_blocks", 0)
    kv = f"{100.0 * used / blocks:.1f}% ({used} of {blocks} blocks)" if blocks else "-"
    return (f"running: {running} reqs, waiting: {waiting} reqs, prompt throughput: {max(prompt, 0) / dt:.1f} "
            f"tok/s, generation throughput: {max(gen, 0) / dt:.1f} tok/s, KV usage: {kv}, "
            f"prefix cache hit rate: {rate}")


class StatsLogger:
    def __init__(self, engine, interval_s: float = 10.0):
        self.engine, self.interval_s = engine, interval_s
        self._prev = sample(engine.stats(), time.monotonic())
        self._queue = (0, 0)                  # (running, waiting) of the last line
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-log", daemon=True)

    def tick(self, now: float | None = None) -> str | None:
        st = self.engine.stats()
        cur = sample(st, time.monotonic() if now is None else now)
        line = stats_line(self._prev, cur, st, self._queue)
        self._prev = cur
        if line:
            self._queue = (st.get("running", 0), st.get("waiting", 0))
            log.info("%s", line)
        return line

    def start(self) -> "StatsLogger":
        if self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # a figure that cannot be read must not end the log for good
                log.exception("stats line failed")
