"""The SDK as a program embeds it (Probe T, ninth round): calls cancelled while the service waits
for a worker never run, deadlines (inf, a list's), closed clients, event loops, TLS flags, Stats types."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from client import AsyncClient, Client, LocalCluster
from client.channel import NO_DEADLINE_S, grpc_seconds
from client.cluster import ClusterError, free_port
from client.collect import Deadline
from client.errors import Cancelled, DeadlineExceeded, Unavailable
from client.service_stats import plain_dict
from minipaged.tls import channel_credentials
from minipaged.v1 import metadata_pb2 as pb
from tests.test_readiness import health, service, stop, wait_for, worker

CERT = "tests/data/tls/client.crt"


def test_no_deadline_is_none_for_grpc_and_a_list_shares_one_deadline():
    assert grpc_seconds(math.inf) is None and grpc_seconds(NO_DEADLINE_S) is None and grpc_seconds(5.0) == 5.0
    d = Deadline(math.inf)
    assert d.left() is None and d.remaining() == math.inf and not d.expired() and d.poll(0.2) == 0.2
    d = Deadline(0.0)
    assert d.expired() and d.remaining() == 0.0 and d.poll(5.0) == 0.05


def test_a_client_certificate_without_a_ca_is_tls_not_plain_text(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(b"-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    key.write_bytes(b"-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n")
    assert channel_credentials(None, None, None) is None
    assert channel_credentials(None, str(cert), str(key)) is not None          # the system's roots
    assert channel_credentials(None, str(cert), str(key), ca_required=True) is None   # a worker's own cert
    with pytest.raises(ValueError, match="needs its key"):
        Client("127.0.0.1:1", tls_cert=str(cert))


def test_stats_chain_counters_are_ints():
    d = plain_dict(pb.ChainStats(steps=1262, cache_epoch=398037610162306016, stages=[pb.StageStats(step_ms=1.5)]))
    assert d["steps"] == 1262 and d["cache_epoch"] == 398037610162306016 and d["stages"][0]["step_ms"] == 1.5


def test_a_closed_client_says_so():
    c = Client("127.0.0.1:1")
    c.close()
    c.close()
    with pytest.raises(Cancelled, match="Client is closed"):
        c.stats()
    with pytest.raises(Cancelled, match="closed"):
        c.generate(prompt_token_ids=[1, 2])

    async def use_closed():
        ac = AsyncClient("127.0.0.1:1")
        await ac.close()
        with pytest.raises(Cancelled, match="AsyncClient is closed"):
            await ac.stats()
        with pytest.raises(Cancelled, match="AsyncClient is closed"):     # (was AttributeError)
            await ac.generate(prompt_token_ids=[1, 2])
    asyncio.run(use_closed())


@pytest.mark.slow
def test_cancelled_while_parked_never_runs_and_loops_and_deadlines(tmp_path):
    """Calls cancelled while the service waits for its first worker (a sync deadline, an async
    task cancelled, a job submit cut short) leave nothing behind: no tokens are generated and no job
    is created once a worker comes. Then: an AsyncClient made outside any loop serves two
    asyncio.run()s, timeout=inf is no deadline, a list of prompts shares one deadline, and a call
    running when its AsyncClient closes ends with Cancelled."""
    mp = free_port()
    procs = [service(mp, tmp_path / "j.db")]
    try:
        wait_for(lambda: health(mp) is not None, what="the service")
        c = Client(f"127.0.0.1:{mp}")
        with pytest.raises(Unavailable, match="waited"):      # the service answers just before the deadline
            c.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=50, ignore_eos=True, timeout=1.0)
        ac = AsyncClient(f"127.0.0.1:{mp}")                     # built outside any event loop

        async def cut(coro):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(coro, 1.0)
        asyncio.run(cut(ac.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=50, ignore_eos=True)))
        asyncio.run(cut(ac.submit([{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}])))
        time.sleep(1.0)                                        # the service notices within 0.5 s
        procs.append(worker(mp, free_port(), "0:4"))
        wait_for(lambda: c.stats().ready, what="a ready chain")
        time.sleep(1.5)
        st = c.stats()
        assert st.generated_tokens == 0 and st.live_sequences == 0 and c.list_jobs() == [], st
        assert all(isinstance(ch["steps"], int) for ch in st.chains)

        assert c.stats(timeout=math.inf).ready and Client(f"127.0.0.1:{mp}", timeout=math.inf).stats().ready
        assert len(c.generate(prompt_token_ids=[1, 2], max_new_tokens=2, timeout=math.inf).token_ids) == 2
        with pytest.raises(DeadlineExceeded):                    # one deadline for the whole list
            c.generate([[1, 2, 3]] * 6, max_new_tokens=200, ignore_eos=True, max_concurrency=1, timeout=1.5)

        async def close_under_a_call():
            task = asyncio.ensure_future(ac.generate(prompt_token_ids=[1, 2], max_new_tokens=400, ignore_eos=True))
            await asyncio.sleep(0.5)
            await ac.close()
            with pytest.raises(Cancelled, match="closed while this call ran"):
                await task
        asyncio.run(close_under_a_call())
        wait_for(lambda: c.stats().live_sequences == 0, what="the cancelled calls' sequences to end")
        st = c.stats()
        assert st.invariants_ok and st.used_blocks == 0 and st.free_blocks == st.num_blocks, st
        c.close()
    finally:
        stop(*reversed(procs))


def test_a_stopped_local_cluster_cannot_be_entered_again():
    c = LocalCluster.__new__(LocalCluster)    # (no processes needed to check the guard)
    c.stopped = True
    with pytest.raises(ClusterError, match="was stopped"):
        c.__enter__()
