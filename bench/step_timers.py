"""bench/profile_step.py's timers: nested per-phase timers, and the hooks that put one on every module
and attention-backend call of a forward. Apart so that profile_step.py stays a readable size.

CLOCK is read at each call (not bound at import): profile_step.py's --cpu-time sets
`step_timers.CLOCK = time.thread_time` before anything is timed, and its own timings read the same
attribute, so every number of Part 1 comes from one clock."""
from __future__ import annotations

import collections
import re
import time

import torch


CLOCK = time.perf_counter   # --cpu-time: time.thread_time (this thread's CPU time)


class Timers:
    """Nested timers: `with timers("name"):` adds the block's time to `name` and takes it off the
    enclosing timer's own time, so the rows of one step add up to the step."""

    def __init__(self):
        self.own = collections.Counter()     # name -> exclusive seconds
        self.calls = collections.Counter()
        self._stack: list[list] = []         # [name, start, seconds spent in children]

    def __call__(self, name: str):
        return _Span(self, name)

    def push(self, name):
        self._stack.append([name, CLOCK(), 0.0])

    def pop(self):
        name, start, children = self._stack.pop()
        dt = CLOCK() - start
        self.own[name] += dt - children
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][2] += dt

    def snapshot(self):
        return collections.Counter(self.own)


class _Span:
    def __init__(self, timers, name):
        self.timers, self.name = timers, name

    def __enter__(self):
        self.timers.push(self.name)

    def __exit__(self, *exc):
        self.timers.pop()


def instrument(stage: torch.nn.Module, backend, timers: Timers):
    """Time every submodule (layer indices folded into `*`) and every attention-backend call.
    Returns a function that takes the timers out again."""
    handles = []
    for name, module in stage.named_modules():
        if not name:
            continue
        label = "fwd: " + re.sub(r"\.\d+\.", ".*.", name + ".").rstrip(".")
        handles.append(module.register_forward_pre_hook(lambda m, a, label=label: timers.push(label)))
        handles.append(module.register_forward_hook(lambda m, a, o: timers.pop()))
    patched = []
    for method in ("write_kv", "paged_decode", "paged_prefill"):
        fn = getattr(backend, method, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _label=f"attn backend: {method}", **k):
            with timers(_label):
                return _fn(*a, **k)
        setattr(backend, method, timed)
        patched.append(method)

    def undo():
        for h in handles:
            h.remove()
        for method in patched:
            delattr(backend, method)  # the instance attribute: the class's method shows again
    return undo
