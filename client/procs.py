"""LocalCluster's child processes: started as `python -m MOD` that die with us, stopped with a
grace period, and reaped at exit whatever happens to the cluster object."""
from __future__ import annotations

import atexit
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

LIVE: set[subprocess.Popen] = set()  # every process we started and have not reaped yet

# `python -m MOD ARGS` plus PR_SET_PDEATHSIG, so a child dies with us even if we are SIGKILLed and
# atexit never runs. Done in the child's own Python rather than a preexec_fn: forking a process that
# runs gRPC threads can crash the child (gRPC's fork handlers), posix_spawn does not fork.
_BOOT = ("import ctypes, runpy, signal, sys; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM)); "
         "sys.argv = sys.argv[1:]; runpy._run_module_as_main(sys.argv[0])")


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log_path: str
    popen: subprocess.Popen | None = None
    rebinds: int = 0      # restarts on a fresh port after "could not bind" (see LocalCluster._rebind)


def spawn(p: Proc, cwd: str, env: dict, **popen_kwargs) -> None:
    """Start p.cmd (`python -m MOD ...`) with its output appended to p.log_path."""
    cmd = p.cmd
    # PDEATHSIG follows the thread that spawned the child: only safe from the main thread.
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        cmd = [cmd[0], "-c", _BOOT, *cmd[2:]]  # same as cmd = [python, "-m", MOD, ...]
    with open(p.log_path, "ab") as log:  # the child keeps its own copy of the fd
        p.popen = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen_kwargs)
    LIVE.add(p.popen)


def log_tail(p: Proc, lines: int) -> str:
    """The last `lines` lines of p's log under a header naming it, its exit code and its command."""
    try:
        with open(p.log_path, "rb") as f:
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        tail = ["<no log>"]
    rc = p.popen.poll() if p.popen else None
    return f"--- {p.name} (exit code {rc}) {' '.join(p.cmd[1:])}\n" + "\n".join(tail)


def stop_all(procs, grace: float) -> None:
    """SIGTERM each, wait up to `grace` in all, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        LIVE.discard(p)


atexit.register(lambda: stop_all(list(LIVE), grace=3.0))
