"""Stopping on signals: a burst of SIGTERMs never deadlocks a waiting process (threading.Event.set
in a handler did: the handler waits for the lock its own thread holds in Event.wait), and a child
that asked to die with its parent does when the parent is killed -9."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from minipaged.signals import PARENT_ENV, StopFlag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stop_flag_waits_and_times_out():
    f = StopFlag()
    t0 = time.monotonic()
    assert f.wait(0.3) is False and time.monotonic() - t0 >= 0.29
    f.set()
    assert f.wait() is True and f.is_set()


def test_a_burst_of_sigterms_stops_a_waiting_process():
    code = ("import sys; sys.path.insert(0, %r); from minipaged.signals import StopFlag; "
            "f = StopFlag().on_signals(); print('ready', flush=True); f.wait(); print('stopped', flush=True)" % ROOT)
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        for _ in range(200):
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
        assert p.wait(10) == 0 and "stopped" in p.stdout.read()


def test_a_child_dies_with_its_parent_killed_9():
    child = ("import sys, time; sys.path.insert(0, %r); from minipaged.signals import die_with_parent, StopFlag; "
             "assert die_with_parent(); print('up', flush=True); StopFlag().on_signals().wait(); "
             "open(sys.argv[1], 'w').write('ended')" % ROOT)
    marker = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minipaged-pdeath-{os.getpid()}")
    parent = ("import os, subprocess, sys; env = dict(os.environ, %s=str(os.getpid())); "
              "c = subprocess.Popen([sys.executable, '-c', %r, %r], env=env, stdout=subprocess.PIPE, text=True); "
              "print(c.stdout.readline().strip(), c.pid, flush=True); import time; time.sleep(60)"
              % (PARENT_ENV, child, marker))
    p = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    word, pid = p.stdout.readline().split()
    assert word == "up"
    p.kill()
    p.wait()
    end = time.monotonic() + 10
    while not os.path.exists(marker):
        assert time.monotonic() < end, "the child outlived its parent"
        time.sleep(0.05)
    os.unlink(marker)
