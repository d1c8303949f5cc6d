"""The step deadline (--step-timeout): a stage whose compute never returns while its heartbeats go
on (a hung kernel, a wedged driver) fails its chain like a lost lease; its sequences recompute on
the other chains, exactly, and the hung stage is held out of chains while its device is busy."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from client import LocalCluster
from client.cluster import ROOT, free_port
from tests.test_scale import config_only, settle_all  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def start_worker(cluster, model, profile, layers=None):
    cmd = [sys.executable, "-m", "worker", "--metadata", cluster.address, "--host", "127.0.0.1",
           "--port", str(free_port()), "--model", model, "--simulate", str(profile)]
    cmd += ["--layers", layers] if layers else []
    return subprocess.Popen(cmd, cwd=ROOT, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)


def wait_for(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_a_replica_whose_step_never_returns_fails_over_within_the_deadline(config_only, tmp_path):
    fast, hung = tmp_path / "fast.json", tmp_path / "hung.json"
    fast.write_text(json.dumps({"fixed_step_s": 0.002}))
    hung.write_text(json.dumps({"fixed_step_s": 3600.0}))     # alive, heartbeating, never done
    reqs = [{"prompt_token_ids": list(range(2000 + i, 2030 + 3 * i)), "max_new_tokens": 10} for i in range(32)]
    with LocalCluster(model=config_only, workers=1, simulate=str(fast), dtype=None,
                      extra_service_args=["--step-timeout", "2"]) as c:
        want = [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=60)]
        proc = start_worker(c, config_only, hung)
        try:
            wait_for(lambda: c.client.stats().num_chains == 2)
            t0 = time.monotonic()
            got = [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=60)]
            took = time.monotonic() - t0
            assert got == want                      # the late chain's sequences recomputed, exactly
            assert took < 30, took                  # within the deadline, not never
            st = c.client.stats()
            assert st.num_chains == 1 and st.standby_workers == 1   # the hung stage joins no chain
            time.sleep(1.5)                         # (the engine polls held stages once a second)
            assert c.client.stats().num_chains == 1
            assert proc.poll() is None              # alive all along: only the deadline caught it
            settle_all(c.client)
        finally:
            proc.kill()
            proc.wait()


def test_the_hung_stage_of_a_pipeline_is_held_out_and_the_healthy_one_rejoins(config_only, tmp_path):
    fast, hung = tmp_path / "fast.json", tmp_path / "hung.json"
    fast.write_text(json.dumps({"fixed_step_s": 0.002}))
    hung.write_text(json.dumps({"fixed_step_s": 3600.0}))
    reqs = [{"prompt_token_ids": list(range(3000 + i, 3020 + 5 * i)), "max_new_tokens": 8} for i in range(24)]
    with LocalCluster(model=config_only, workers=2, simulate=str(fast), dtype=None,
                      extra_service_args=["--step-timeout", "2"]) as c:   # chain A: 0:18 -> 18:36
        want = [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=60)]
        head = start_worker(c, config_only, fast, "0:18")
        tail = start_worker(c, config_only, hung, "18:36")               # chain B: head -> hung tail
        procs = [head, tail]
        try:
            wait_for(lambda: c.client.stats().num_chains == 2)
            got = [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=60)]
            assert got == want
            st = c.client.stats()
            assert st.num_chains == 1 and st.standby_workers == 2
            tail.kill()                                  # the hung stage goes; its lease runs out
            procs.append(start_worker(c, config_only, fast, "18:36"))
            # the healthy head of chain B was released (idle) and forms a chain with the new tail
            wait_for(lambda: c.client.stats().num_chains == 2, timeout=30)
            assert [r.token_ids for r in c.client.wait(c.client.submit(reqs), timeout=60)] == want
            settle_all(c.client)
        finally:
            for p in procs:
                p.kill()
                p.wait()
