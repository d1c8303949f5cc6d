"""Garbage collection for long-running servers: their live objects (a model, a block manager, many
sequences) are long-lived, and every step allocates messages and arrays that reference counting
frees at once. The default thresholds run full collections over all of it every few steps (a
tenth of a simulated worker's CPU went there). Freeze what exists after start-up and collect
young objects rarely, as vLLM and Instagram's servers do."""
from __future__ import annotations

import gc


def tune_for_serving() -> None:
    gc.collect()
    gc.freeze()                        # start-up objects: never scanned again
    gc.set_threshold(50_000, 50, 100)  # cycles still get collected, just not every few steps
