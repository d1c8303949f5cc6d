"""Stopping on SIGTERM / SIGINT without a lock in the signal handler."""
from __future__ import annotations

import ctypes
import os
import signal
import time

PARENT_ENV = "MINIPAGED_DIE_WITH"   # a child started by a front sets PR_SET_PDEATHSIG on itself


class StopFlag:
    """An Event that a signal handler may set. threading.Event.set takes the lock that the main
    thread holds inside Event.wait, so a second signal arriving there deadlocks the process for good
    (seen: a metadata service hit by two SIGTERMs at once never exited and kept its job store
    locked). Here set() writes an attribute and wait() sleeps in short steps."""

    STEP_S = 0.2

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = self.STEP_S if end is None else min(self.STEP_S, end - time.monotonic())
            if left <= 0:
                break
            time.sleep(left)
        return self._set

    def on_signals(self, *signums) -> "StopFlag":
        for s in signums or (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, lambda signum, frame: self.set())
        return self


def die_with_parent() -> bool:
    """In a child whose parent set PARENT_ENV to its pid: SIGTERM when the parent dies (Linux
    PR_SET_PDEATHSIG, set here rather than in a preexec_fn, which is unsafe in a threaded parent).
    False when the parent is already gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    return os.getppid() == int(parent)
