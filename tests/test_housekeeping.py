"""A job store left behind by an interrupted run (issue 24), and the service's side of a user's
first hour (issue 21): one owner per store, the way out named, clean worker stops, a client told it
waits. Real processes on loopback, started the way a user starts them."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from client import Client
from client.cluster import free_port
from client.errors import NotFound
from tests.checkpoints import make_checkpoint
from tests.test_readiness import ROOT, start, stop, wait_for

pytestmark = pytest.mark.slow


def service(port, *extra):
    return start("metadata_service", "--port", port, "--worker-wait", 30, "--log-stats-interval", 0, *extra)


def worker(meta_port, model, *extra):
    return start("worker", "--metadata", f"127.0.0.1:{meta_port}", "--port", free_port(), "--model", model,
                 "--num-blocks", 64, "--threads", 1, *extra)


def cli(*args, input=None):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "client", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, input=input)


def output_of(proc) -> str:
    """What a process printed, once it has exited."""
    out, _ = proc.communicate(timeout=120)
    return out


def answers(port) -> bool:
    try:
        Client(f"127.0.0.1:{port}").stats(timeout=2)
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a = make_checkpoint(num_layers=2, seed=1, directory=str(tmp_path_factory.mktemp("model_a")))
    b = make_checkpoint(num_layers=2, seed=2, directory=str(tmp_path_factory.mktemp("model_b")))
    return a, b


def test_an_interrupted_run_is_named_at_start_and_easy_to_leave(models, tmp_path):
    model_a, model_b = models
    db, mp = str(tmp_path / "jobs.db"), free_port()
    addr = f"127.0.0.1:{mp}"
    first, wa = service(mp, "--db", db, "--max-num-seqs", 1), worker(mp, model_a)
    procs = [first, wa]
    try:
        c = Client(addr, wait_ready=120)
        small = c.submit([{"prompt_token_ids": [1, 2, 3], "max_new_tokens": 2}])
        assert c.wait(small, timeout=120)[0].finish_reason == "length"
        job = c.submit([{"prompt_token_ids": [1 + i, 2, 3], "max_new_tokens": 300, "ignore_eos": True}
                        for i in range(12)])

        # a second service on the same store: a start error naming the owner
        second = service(free_port(), "--db", db)
        out = output_of(second)
        assert second.returncode == 1 and f"pid {first.pid}" in out and f"port {mp}" in out, out

        wait_for(lambda: c.get_job(job).completed >= 1, timeout=120, what="a first result")
        before = {r.index: r.token_ids for r in c.get_job(job).results}
        assert len(before) < 12, "the job finished before the crash; make it longer"
        # the interrupted run: service and worker killed, the job unfinished
        for p in (first, wa):
            p.send_signal(signal.SIGKILL)
            p.wait()
        c.close()
        restarted = service(mp, "--db", db)
        procs.append(restarted)
        c = Client(addr)
        wait_for(lambda: answers(mp), what="the restarted service")
        wait_for(lambda: "waiting for a worker of model" in _reason(c), what="the backlog in not_ready_reason")
        reason = _reason(c)
        assert model_a in reason and "pending requests from" in reason
        assert f"to drop them: minipaged jobs --cancel-all --address {addr}" in reason

        # a worker of another model is refused, and told what to do
        wb = worker(mp, model_b)
        out = output_of(wb)
        assert wb.returncode == 3 and "model mismatch" in out and "minipaged jobs --cancel-all" in out, out

        r = cli("jobs", "--address", addr, "--cancel-all", "--model", "some-other-model")
        assert r.returncode == 0 and "cancelled 0 unfinished job(s)" in r.stdout
        r = cli("jobs", "--address", addr, "--cancel-all")
        assert r.returncode == 0 and "cancelled 1 unfinished job(s)" in r.stdout, r.stdout + r.stderr
        st = c.get_job(job)
        assert st.state == "cancelled" and st.total == 12
        kept = {r.index: r.token_ids for r in st.results if r.finish_reason == "length"}
        assert {i: kept.get(i) for i in before} == before and len(kept) < 12  # finished results stay
        assert c.get_job(small).state == "done"  # finished jobs are not touched by --cancel-all

        # the pin is gone: model B's workers may join now
        procs.append(worker(mp, model_b))
        wait_for(lambda: c.stats().ready, timeout=120, what="a chain of model B")
        running = c.submit([{"prompt_token_ids": [5, 6], "max_new_tokens": 400, "ignore_eos": True}] * 2)
        r = cli("jobs", "--address", addr, "--purge-older-than", "0.001s")
        assert r.returncode == 0 and "deleted 2 finished job(s)" in r.stdout, r.stdout + r.stderr
        with pytest.raises(NotFound):
            c.get_job(job)
        assert [j.job_id for j in c.list_jobs()] == [running]
        # the state filter says what GetJob says (the store has queued and running both as unfinished)
        wait_for(lambda: c.get_job(running).state == "running", timeout=60, what="the job running")
        assert [j.job_id for j in c.list_jobs(state="running")] == [running]
        assert [j.job_id for j in c.list_jobs(state="queued")] == []
        c.cancel(running)
        c.close()
    finally:
        stop(*reversed(procs))
    out = output_of(restarted)
    assert f"resumed {12 - len(kept)} unfinished requests of 1 job(s) for model {model_a}" in out, out
    with sqlite3.connect(db) as con:             # consistent: no orphaned request or result rows
        assert con.execute("SELECT COUNT(*) FROM requests WHERE job_id NOT IN (SELECT job_id FROM jobs)"
                           ).fetchone()[0] == 0
        assert con.execute("SELECT job_id, state FROM jobs").fetchall() == [(running, "cancelled")]


def _reason(c: Client) -> str:
    return c.stats(timeout=5).not_ready_reason


def test_a_worker_stopped_cleanly_deregisters_at_once(tmp_path):
    mp = free_port()
    meta = service(mp, "--worker-lease", 120)   # a lease longer than the test: only deregistering frees it
    w = worker(mp, "tiny", "--layers", "0:4")
    try:
        c = Client(f"127.0.0.1:{mp}", wait_ready=120)
        assert c.generate(prompt_token_ids=[1, 2, 3], max_new_tokens=2).finish_reason == "length"
        w.send_signal(signal.SIGTERM)
        assert w.wait(60) == 0
        wait_for(lambda: not c.stats().ready, timeout=30, what="the chain to go")
        st = c.stats()
        assert st.num_workers == 0 and not st.ready and st.not_ready_reason == "no worker is registered"
        c.close()
    finally:
        stop(w, meta)
    out = output_of(meta)
    assert "deregistered (stopped cleanly)" in out and "missed its heartbeat lease" not in out, out
    assert "blocks x 16 tokens = " in out           # KV capacity in human units


def told_waiting(*service_args) -> str:
    """A generate against a service (flags `service_args`) with no worker: UNAVAILABLE after
    --worker-wait 2, having told the user why it waits. Returns the service's output."""
    mp = free_port()
    meta = start("metadata_service", "--port", mp, "--worker-wait", 2, *service_args)
    try:
        wait_for(lambda: answers(mp), what="the service")
        r = cli("generate", "--address", f"127.0.0.1:{mp}", "--prompt", "hi")
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
        assert "waiting for a worker to register (up to 2s): no worker is registered" in r.stderr, r.stderr
        # a job too (SubmitJob is unary: the SDK reads the note before the reply; before, silence)
        r = cli("submit", "--address", f"127.0.0.1:{mp}", "--file", "-", input='{"prompt": "hi"}\n')
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
        assert "waiting for a worker to register (up to 2s): no worker is registered" in r.stderr, r.stderr
    finally:
        stop(meta)
    return output_of(meta)


def test_a_client_waiting_for_the_first_worker_is_told_so():
    assert "a request is waiting for a worker to register" in told_waiting()


def test_the_async_client_is_told_so_too(caplog):
    """AsyncClient (the gateway's) logs the service's note once, for a job and for a stream."""
    import asyncio

    from client import AsyncClient
    from client.errors import MiniPagedError
    mp = free_port()
    meta = start("metadata_service", "--port", mp, "--worker-wait", 1)

    async def calls():
        c = AsyncClient(f"127.0.0.1:{mp}")
        try:
            for call in (c.submit([{"prompt": "hi"}]), c.generate("hi")):
                with pytest.raises(MiniPagedError, match="no worker chain is ready"):
                    await call
        finally:
            await c.close()
    try:
        wait_for(lambda: answers(mp), what="the service")
        asyncio.run(calls())
    finally:
        stop(meta)
    told = [r for r in caplog.records if "waiting for a worker to register (up to 1s)" in r.getMessage()]
    assert len(told) == 1 and told[0].levelname == "WARNING"


def test_a_job_item_is_what_it_would_be_alone_and_a_cancel_is_final():
    """Probe N: a plain item's cumulative_logprob came from a best_of neighbour (its step computed
    logprobs for every row); generate() counted the first choice's tokens where the job counted
    every candidate's; a GetJob right after CancelJob said "cancelled" with results missing; a bad
    item did not say which it was."""
    from client import InvalidArgument, LocalCluster
    with LocalCluster(model="tiny", workers=1, dtype="float32") as c:
        cl = c.client
        plain = {"prompt": "hello", "max_new_tokens": 4}
        best_of = {"prompt": "xyz", "max_new_tokens": 4, "n": 2, "best_of": 3, "temperature": 0.8, "seed": 1}
        assert cl.wait(cl.submit([plain]))[0].cumulative_logprob is None
        mixed = cl.wait(cl.submit([plain, best_of]))
        assert mixed[0].cumulative_logprob is None and mixed[1].choices[0].cumulative_logprob is not None
        n2 = {"prompt": "abc", "max_new_tokens": 5, "n": 2, "temperature": 0.8, "seed": 3, "ignore_eos": True}
        assert cl.generate(**n2).usage.completion_tokens == cl.wait(cl.submit([n2]))[0].usage.completion_tokens == 10
        job = cl.submit([{"prompt_token_ids": [1, 2, 3], "max_new_tokens": 300, "ignore_eos": True}] * 10)
        cl.cancel(job)
        got = cl.get_job(job)
        assert got.state == "cancelled" and got.completed == got.total == len(got.results) == 10
        with pytest.raises(InvalidArgument, match=r"submit item 1: top_p must be in"):
            cl.submit([plain, {"prompt": "x", "top_p": 1.5}])
        with pytest.raises(InvalidArgument, match=r"request 2: .*regex"):
            cl.submit([plain, plain, {"prompt": "x", "regex": "(("}])
        from tests.test_readiness import wait_for
        wait_for(lambda: cl.stats().free_blocks == cl.stats().num_blocks, timeout=30, what="every block free")
        assert cl.stats().invariants_ok
