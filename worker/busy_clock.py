"""BusyClock: how long the step now occupying this stage's device has been running.

The metadata service's step deadline (`--step-timeout`) knows only that a chain's step is late,
not which stage holds it. A stage answers Health with `busy_ms`, the age of the step it is
computing now (0 when idle), so the service can tell the hung stage of a timed-out chain from the
healthy ones waiting behind it. Two kinds of device: a synchronous one (the CPU, a GPU stream we
wait on) is busy between `begin()` and `end()`; an asynchronous one (the simulator) returns at once
and its results exist at `ready_at`, so each step occupies the window [ready_at - step_s, ready_at)."""
from __future__ import annotations

import threading
import time
from collections import deque


class BusyClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = 0.0                                  # synchronous step started at (0: none)
        self._windows: deque[tuple[float, float]] = deque()  # asynchronous (start, ready_at), in order

    def begin(self) -> None:
        self._since = time.monotonic()

    def end(self, device_s: float | None = None, ready_at: float = 0.0) -> None:
        """The call returned; `ready_at` (time.monotonic, as the simulator gives it) > now means an
        asynchronous device still works on it for `device_s` seconds up to then."""
        self._since = 0.0
        if ready_at > time.monotonic():
            with self._lock:
                self._windows.append((ready_at - (device_s or 0.0), ready_at))

    def busy_s(self) -> float:
        now = time.monotonic()
        ages = [now - self._since] if self._since else []
        with self._lock:
            while self._windows and self._windows[0][1] <= now:
                self._windows.popleft()
            ages += [now - start for start, _ in self._windows if start <= now]
        return max(ages, default=0.0)
