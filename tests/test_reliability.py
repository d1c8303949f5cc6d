"""Worst days: crashes of the metadata service and of workers, client disconnects, cancels and
deadlines. Real processes on loopback; tokens checked against transformers in float64."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import sqlite3
import time

import pytest
import torch

from client import Client, LocalCluster
from client.errors import DeadlineExceeded, Unavailable
from tests.checkpoints import load_oracle, make_checkpoint
from tests.test_e2e import prompts, settle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, tie=True, vocab=96,
                           seed=11, directory=str(tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def greedy(ckpt):
    model = load_oracle(ckpt, torch.float64)

    def run(prompt, n):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        return ids[0, len(prompt):].tolist()
    return run


def wait_until(pred, timeout=60.0, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def job_requests(batch, n):
    return [{"prompt_token_ids": p, "max_new_tokens": n, "ignore_eos": True} for p in batch]


def test_metadata_service_kill9_mid_job_resumes_exactly_once(ckpt, greedy, tmp_path):
    db = str(tmp_path / "jobs.db")
    batch = prompts(40, 4, 40, seed=21)
    with LocalCluster(model=ckpt, workers=2, dtype="float64", db=db,
                      extra_service_args=["--max-num-seqs", "4"]) as c:
        job = c.client.submit(job_requests(batch, 24))
        with cf.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(Client(c.address).wait, job, timeout=180)  # follows the job across the crash
            wait_until(lambda: 3 <= c.client.get_job(job).completed, what="a few results")
            done_before = c.client.get_job(job).completed
            assert done_before < 40, "the job finished before the crash; make it longer"
            c.processes[0].send_signal(signal.SIGKILL)
            c.processes[0].wait()
            c.restart_service()                  # same port, same --db; workers re-register by themselves
            results = waiting.result()
        assert [r.index for r in results] == list(range(40))
        for p, r in zip(batch, results):
            assert r.token_ids == greedy(p, 24)
        settle(c.client)
    with sqlite3.connect(db) as con:             # each result stored exactly once, none missing
        rows = con.execute("SELECT COUNT(*), COUNT(result) FROM requests WHERE job_id = ?", (job,)).fetchone()
        assert rows == (40, 40)


def test_worker_kill9_mid_job_recovers_with_identical_tokens(ckpt, greedy):
    batch = prompts(12, 4, 40, seed=22)
    with LocalCluster(model=ckpt, workers=2, dtype="float64") as c:
        job = c.client.submit(job_requests(batch, 60))
        wait_until(lambda: c.client.stats().steps > 5, what="some steps")
        before = c.client.stats()
        c.kill_worker(1)
        c.restart_worker(1, wait=False)
        results = c.client.wait(job, timeout=180)
        for p, r in zip(batch, results):
            assert r.token_ids == greedy(p, 60)
        st = settle(c.client)
        assert st.ready and st.num_workers == 2
        # the lost chain's counts stay in the totals: counters never go down (Prometheus' rule)
        assert st.steps > before.steps and st.generated_tokens >= sum(len(r.token_ids) for r in results)


def test_a_replica_that_joins_takes_its_share_of_the_queue(ckpt, greedy):
    """Requests are routed on admission; a replica that joins while they queue on another takes the
    newest never-started ones (they were waiting there, all on one chain, before this)."""
    batch = prompts(16, 4, 30, seed=23)
    with LocalCluster(model=ckpt, replicas=2, dtype="float64", extra_service_args=["--max-num-seqs", "1"]) as c:
        c.kill_worker(1, signal.SIGTERM)                   # deregisters: one chain left
        wait_until(lambda: c.client.stats().num_chains == 1, what="one chain")
        job = c.client.submit(job_requests(batch, 400))
        wait_until(lambda: c.client.stats().steps > 2, what="some steps")
        c.restart_worker(1)
        assert c.client.stats().waiting > 4                # (the queue is still long when it joins)
        results = c.client.wait(job, timeout=300)
        for p, r in zip(batch, results):
            assert r.token_ids == greedy(p, 400)
        st = settle(c.client)
        assert st.num_chains == 2 and all(int(ch["steps"]) > 0 for ch in st.chains), st.chains
        assert st.invariants_ok and st.free_blocks == st.num_blocks


def _process_serving(cluster, address):
    port = address.rsplit(":", 1)[1]
    return next(p.popen for p in cluster._procs if "--port" in p.cmd and p.cmd[p.cmd.index("--port") + 1] == port)


def test_a_hung_worker_fails_over_to_a_standby_and_wakes_up_harmless(ckpt, greedy):
    """SIGSTOP (a GPU hang, a partition): the lease runs out, the chain fails over to the standby and
    recomputes; the hung worker, woken up, finds its epoch stale and corrupts nothing."""
    batch = prompts(12, 4, 30, seed=24)
    with LocalCluster(model=ckpt, workers=2, standby=1, dtype="float64",
                      extra_service_args=["--worker-lease", "2"]) as c:
        st = c.client.stats()
        assert st.num_chains == 1 and st.standby_workers == 1        # two 1:2 workers, one chain
        active = _process_serving(c, st.chains[0]["stages"][1]["address"])
        job = c.client.submit(job_requests(batch, 40))
        wait_until(lambda: c.client.stats().steps > 5, what="some steps")
        active.send_signal(signal.SIGSTOP)
        try:
            results = c.client.wait(job, timeout=60)      # the old stall was the 120 s step timeout
            for p, r in zip(batch, results):
                assert r.token_ids == greedy(p, 40) and not r.error
            st = c.client.stats()
            assert st.num_chains == 1 and _process_serving(c, st.chains[0]["stages"][1]["address"]) is not active
        finally:
            active.send_signal(signal.SIGCONT)
        # awake again: it registers as a standby; nothing it still had queued may touch a live cache
        wait_until(lambda: c.client.stats().num_workers == 3, what="the woken worker to register again")
        settle(c.client)
        second = prompts(6, 4, 30, seed=25)
        for p, r in zip(second, c.client.wait(c.client.submit(job_requests(second, 20)), timeout=60)):
            assert r.token_ids == greedy(p, 20)
        # and when it is the one left, it serves exactly
        now = _process_serving(c, c.client.stats().chains[0]["stages"][1]["address"])
        now.send_signal(signal.SIGKILL)
        wait_until(lambda: c.client.stats().ready and c.client.stats().num_workers == 2, what="failover back")
        for p, r in zip(second, c.client.wait(c.client.submit(job_requests(second, 20)), timeout=60)):
            assert r.token_ids == greedy(p, 20)
        settle(c.client)


def test_streams_end_with_unavailable_when_no_worker_comes_back(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64",
                      extra_service_args=["--worker-wait", "2", "--heartbeat-timeout", "2"]) as c:
        in_flight = c.client.stream(prompt_token_ids=[5, 6, 7], max_new_tokens=400, ignore_eos=True, timeout=60)
        next(in_flight)
        c.kill_worker(0)
        t0 = time.monotonic()
        try:  # a stream in flight finishes (if it outran the kill) or ends with UNAVAILABLE; never hangs
            n = 1 + sum(1 for _ in in_flight)
            assert n <= 400
        except Unavailable as e:
            assert "worker" in str(e)
        # a stream admitted after the crash waits --worker-wait seconds for a chain, then UNAVAILABLE
        with pytest.raises(Unavailable) as err:
            list(c.client.stream(prompt_token_ids=[8, 9], max_new_tokens=50, timeout=60))
        assert "worker" in str(err.value)
        assert time.monotonic() - t0 < 30
        settle(c.client)


def test_disconnect_cancel_and_deadline_free_every_block(ckpt):
    with LocalCluster(model=ckpt, workers=1, dtype="float64", block_size=4) as c:
        base = c.client.stats()
        assert base.free_blocks == base.num_blocks

        # 1. a stream whose client goes away after two chunks
        stream = c.client.stream(prompt_token_ids=list(range(2, 40)), max_new_tokens=400, ignore_eos=True)
        next(stream), next(stream)
        stream.close()
        settle(c.client)

        # 2. an expired deadline
        with pytest.raises(DeadlineExceeded):  # 500 steps cannot fit in 0.2 s
            c.client.generate(prompt_token_ids=[2, 3], max_new_tokens=500, ignore_eos=True, timeout=0.2)
        settle(c.client)

        # 3. a cancelled job: partial results say "cancelled", nothing keeps running
        job = c.client.submit(job_requests(prompts(6, 4, 20, seed=23), 400))
        wait_until(lambda: c.client.stats().running > 0, what="the job to start")
        status = c.client.cancel(job)
        assert status.state == "cancelled"
        settle(c.client)

        def quiet() -> bool:   # steps already in flight (async scheduling: up to two) come back and count
            before = c.client.stats().steps
            time.sleep(0.3)
            return c.client.stats().steps == before
        # the cancelled job's 6 x 400 tokens would keep the steps going for far longer than this
        wait_until(quiet, timeout=10.0, what="no more steps after the cancel (work continued)")
        final = c.client.get_job(job)
        assert final.state == "cancelled"


def test_sigterm_exits_cleanly(ckpt):
    c = LocalCluster(model=ckpt, workers=2, dtype="float64")
    procs = c.processes
    c.stop()
    assert [p.returncode for p in procs] == [0, 0, 0]
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)


def test_a_job_resumed_before_any_worker_keeps_its_model_rules(tmp_path):
    """Probe V (ninth round): a job resumed at start is made before any worker has told the service
    its model. Its grammar then had a 0-token vocabulary (every chain died at its first step, the
    service wedged), min_new_tokens and beam search had no EOS ids (tokens differed from a run
    without the restart). They are made again when the first chain names the model."""
    d = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, tie=False, vocab=300, seed=5,
                        directory=str(tmp_path / "ckpt"))
    for name in ("config.json", "generation_config.json"):   # an EOS the greedy path reaches
        path = os.path.join(d, name)
        if os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            cfg["eos_token_id"] = 204
            with open(path, "w") as f:
                json.dump(cfg, f)
    items = [{"prompt": "bar", "min_new_tokens": 8, "max_new_tokens": 12},
             {"prompt": "Beam prompt 7", "beam_width": 4, "max_new_tokens": 20},
             {"prompt": "json:", "json_schema": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                                                 "required": ["k"]}, "max_new_tokens": 40},
             {"prompt": "pick", "choice": ["yes", "no"], "temperature": 0.8, "seed": 3, "max_new_tokens": 8}]
    with LocalCluster(model=d, workers=1, dtype="float64", db=str(tmp_path / "jobs.db")) as c:
        want = [c.client.generate(**item) for item in items]
        assert want[0].finish_reason == "length" and want[1].choices[0].finish_reason == "stop"   # EOS matters here
        worker = c.processes[1]
        worker.send_signal(signal.SIGSTOP)           # nothing runs: the whole job is resumed after the restart
        try:
            job = c.client.submit(items)
            c.processes[0].send_signal(signal.SIGKILL)
            c.processes[0].wait()
        finally:
            worker.send_signal(signal.SIGCONT)
        c.restart_service()                          # same --db; the worker registers again by itself
        got = Client(c.address).wait(job, timeout=120)
        for w, g in zip(want, got):
            assert [ch.token_ids for ch in (w.choices or [w])] == [ch.token_ids for ch in (g.choices or [g])]
        settle(c.client)
