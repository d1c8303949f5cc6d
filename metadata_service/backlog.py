"""Pending job work in words: what a restarted service adopted, and how to get rid of it.

A job store keeps the requests of every unfinished job, and only workers of the model they were
admitted for may take them (their token ids are that model's). These sentences go into the start
log, Stats' not_ready_reason (so the gateway's /health), and a refused worker's error, so nobody is
left guessing why a service waits for a model nobody serves any more."""
from __future__ import annotations

import time
from dataclasses import dataclass

CANCEL_COMMAND = "minipaged jobs --cancel-all"


@dataclass
class Backlog:
    """Unfinished job requests of one model."""
    model_name: str
    model_fingerprint: str
    jobs: int
    requests: int
    oldest: float          # unix time of the oldest job's submission


def when(ts: float, now: float | None = None) -> str:
    """'2026-12-01 08:00:00 (3 h 2 min ago)'."""
    if not ts:
        return "an unknown time"
    age = max(0.0, (time.time() if now is None else now) - ts)
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))} ({age_words(age)} ago)"


def age_words(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def model_words(b: Backlog) -> str:
    fp = f"fingerprint {b.model_fingerprint[:12]}" if b.model_fingerprint else "fingerprint unknown"
    return f"{b.model_name or 'an unnamed model'} ({fp})"


def waiting_reason(backlogs: list[Backlog], command: str = CANCEL_COMMAND) -> str:
    """For Stats' not_ready_reason while no chain serves the pending work; "" when there is none."""
    if not backlogs:
        return ""
    parts = [f"waiting for a worker of model {model_words(b)}: {b.requests} pending requests from "
             f"{when(b.oldest)}" for b in backlogs]
    return "; ".join(parts) + f"; to drop them: {command}"


def resumed_line(b: Backlog, command: str = CANCEL_COMMAND) -> str:
    return (f"resumed {b.requests} unfinished requests of {b.jobs} job(s) for model {model_words(b)}, "
            f"submitted from {when(b.oldest)}; until they finish only workers of that model may join "
            f"(to drop them: {command})")


def refusal_hint(b: Backlog | None, command: str = CANCEL_COMMAND) -> str:
    """What a worker of another model should be told to do."""
    pending = f"{b.requests} requests from {when(b.oldest)}" if b is not None else "requests"
    return (f"start workers of that model to finish the {pending}, or drop them with `{command}` "
            f"and start this worker again")
