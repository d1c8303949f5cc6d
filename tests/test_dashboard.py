"""The live dashboard in a real browser: headless Chromium (Debian's `chromium`) loads GET / from
the gateway, runs its JavaScript (which polls /dashboard/state), and we read what it drew.

Two set-ups:
- a real cluster (tiny model) during a shared-prefix job, its workers held still (SIGSTOP) so the
  pool stands for a moment: the page's counts and grid equal Stats and the PoolSnapshot then;
- a stand-in metadata service whose PoolSnapshot and Stats come from a real KVBlockManager (owned,
  shared, cached and free blocks all present, forks included): the grid's cells per state equal
  the snapshot's counts and the sequences table shows every block table; and, without
  PoolSnapshot (an older service), the page falls back to the Stats counts.

Screenshots go to the test's tmp dir, and also to $MINIPAGED_SCREENSHOT_DIR when set (the README's
picture is made that way)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import httpx
import pytest

from client import LocalCluster
from client.cluster import free_port
from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc
from tests.freeze import FREEZE_SERVICE_ARGS, frozen

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium: apt-get install -y chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(url: str, *extra: str, budget_ms: int = 4000) -> str:
    """Load `url` in a fresh headless Chromium, let its timers run `budget_ms` of virtual time
    (fetches are waited for), return stdout (the DOM with --dump-dom)."""
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                            *extra, url], capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def screenshot(url: str, path, name: str) -> str:
    out = str(path / name)
    chromium(url, f"--screenshot={out}", "--window-size=1400,1000")
    assert os.path.getsize(out) > 10_000
    keep = os.environ.get("MINIPAGED_SCREENSHOT_DIR")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(out, os.path.join(keep, name))
    return out


def page_state(dom: str) -> dict:
    """What the page shows: the legend's counts, and per chain grid the cells it drew per state."""
    body = re.search(r"<body([^>]*)>", dom).group(1)
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body))
    shown = {k: int(v) for k, v in re.findall(r'id="count-(free|owned|shared|cached)">(\d+)<', dom)}
    grids = [dict(re.findall(r'data-cells-(\w+)="(\d+)"', m)) for m in re.findall(r'<div class="card"[^>]*data-chain[^>]*>', dom)]
    rows = len(re.findall(r"<td class=\"chips\"><span", dom))  # the script holds the bare tag too
    return {"attrs": attrs, "shown": shown, "grids": [{k: int(v) for k, v in g.items()} for g in grids], "rows": rows}


def expected_from_stats(st) -> dict:
    return {"free": st.free_blocks - st.cached_blocks, "owned": st.used_blocks - st.shared_blocks,
            "shared": st.shared_blocks, "cached": st.cached_blocks}


# ---------------------------------------------------------------- the live cluster

@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(model="tiny", workers=1, http=True, num_blocks=192, extra_service_args=FREEZE_SERVICE_ARGS) as c:
        yield c


@needs_chromium
def test_dashboard_during_a_shared_prefix_job(cluster, tmp_path):
    """24 requests behind one system prompt: while the workers are held still mid-job, the page's
    counts and grid equal Stats and the PoolSnapshot at that moment."""
    c = cluster.client
    system = "You are a careful assistant for a paged KV cache. Cite the block table. " * 3
    job = c.submit([{"prompt": system + f"Question {i}?", "max_new_tokens": 160, "ignore_eos": True}
                    for i in range(24)])
    try:
        with frozen(cluster, until=lambda st: st.running >= 8 and st.shared_blocks > 0) as st:
            dom = chromium(cluster.http_url + "/", "--dump-dom")
            shot = screenshot(cluster.http_url + "/", tmp_path, "dashboard-live.png")
            snap = c.pool_snapshot().chains[0]
        page = page_state(dom)
        assert int(page["attrs"]["polls"]) >= 2  # it polled and redrew
        assert page["attrs"]["source"] == "snapshot"
        assert page["shown"] == expected_from_stats(st)  # free, owned, shared (ref > 1), cached
        assert page["shown"]["shared"] == st.shared_blocks > 0 and page["shown"]["owned"] > 0
        assert page["shown"]["free"] + page["shown"]["cached"] == st.free_blocks
        assert snap.stride == 1 and page["grids"] == [page["shown"]]  # 192 blocks: one cell each
        assert page["rows"] == len(snap.sequences) == st.running + st.waiting
    finally:
        c.wait(job)
    assert os.path.exists(shot)

    # after the job: the shared prefix stays cached (evictable), nothing is owned
    page, st = page_state(chromium(cluster.http_url + "/", "--dump-dom")), c.stats()
    assert page["shown"] == expected_from_stats(st) and st.cached_blocks > 0 and st.used_blocks == 0


def test_a_long_sequence_shows_64_blocks_and_counts_all(cluster):
    """The snapshot sends a sequence's first 64 blocks but its whole count (the page writes "... +N")."""
    c = cluster.client
    job = c.submit([{"prompt_token_ids": [7] * 1100, "max_new_tokens": 200, "ignore_eos": True}])  # 69+ blocks
    try:
        with frozen(cluster, until=lambda st: st.running >= 1 and st.used_blocks >= 69):
            seq = next(s for ch in c.pool_snapshot().chains for s in ch.sequences)
        assert len(seq.block_table) == 64 and seq.num_blocks >= 69
    finally:
        c.wait(job)


# ---------------------------------------------------------------- the grid, from a real KVBlockManager

class PoolService(pb_grpc.MetadataServiceServicer):
    """Stats and PoolSnapshot of a real KVBlockManager holding every kind of block."""

    def __init__(self, snapshots: bool = True):
        from metadata_service.block_manager import KVBlockManager
        self.snapshots = snapshots
        self.stride = 1          # > 1: the grid sampled, as a service does past 4,096 blocks
        self.m = m = KVBlockManager(num_physical_blocks=256, block_size=16)
        system = list(range(30, 30 + 64))  # 4 full blocks every request shares
        for sid in range(6):
            m.create_and_append(sid, prompt_token_ids=system + [sid] * (8 + 9 * sid),
                                num_tokens=len(system) + 8 + 9 * sid)
        for child in (100, 101, 102):  # n = 4 choices of request 0: forks share its full blocks
            m.fork(0, child)
        m.create_and_append(50, prompt_token_ids=list(range(200, 296)), num_tokens=96)
        m.release_sequence(50)  # a finished request: its full blocks stay cached, evictable
        self.labels = {sid: f"job-7:{sid}" for sid in range(6)} | {c: f"job-7:0/{c - 99}" for c in (100, 101, 102)}

    def _states(self):
        import numpy as np
        ref = np.asarray(self.m.pool.ref_count)
        state = np.where(ref > 1, 2, np.where(ref == 1, 1, 0)).astype(np.uint8)
        for b in np.flatnonzero(ref == 0):
            if self.m.pool.is_cached_free(int(b)):
                state[b] = 3
        return ref, state

    def Stats(self, request, context):
        ref, state = self._states()
        s = self.m.stats()
        return pb.StatsReply(num_blocks=s["num_blocks"], block_size=s["block_size"], used_blocks=s["used_blocks"],
                             free_blocks=s["free_blocks"], cached_blocks=s["cached_blocks"],
                             shared_blocks=int((state == 2).sum()), ready=True, num_workers=1,
                             invariants_ok=self.m.invariants_ok(), live_sequences=s["live_sequences"],
                             internal_fragmentation_tokens=s["internal_fragmentation_tokens"],
                             running=len(self.labels))

    def PoolSnapshot(self, request, context):
        if not self.snapshots:  # an older service
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        ref, state = self._states()
        tables = self.m.debug_state()["tables"]
        seqs = [pb.SequenceSnapshot(sequence_id=sid, state="running", length=int(self.m.debug_state()["lens"][sid]),
                                    num_blocks=len(t), block_table=wire.pack(t[:64]), label=self.labels.get(sid, ""))
                for sid, t in sorted(tables.items())]
        chain = pb.ChainSnapshot(chain_id=0, num_blocks=len(state), block_size=16, stride=self.stride,
                                 block_state=wire.pack(state[::self.stride], wire.UINT8),
                                 ref_counts=wire.pack(ref.clip(0, 255), wire.UINT8),
                                 free_blocks=int((state == 0).sum() + (state == 3).sum()),  # cached included
                                 owned_blocks=int((state == 1).sum()),
                                 shared_blocks=int((state == 2).sum()), cached_blocks=int((state == 3).sum()),
                                 sequences=seqs, running=len(seqs))
        return pb.PoolSnapshotReply(chains=[chain], time=time.time())


@pytest.fixture(params=[True, False], ids=["snapshot", "stats-only"])
def pool_gateway(request):
    service = PoolService(snapshots=request.param)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_MetadataServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    http_port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "--metadata", f"127.0.0.1:{port}", "--port",
                           str(http_port), "--model", "tiny"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url, end = f"http://127.0.0.1:{http_port}", time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert gw.poll() is None and time.monotonic() < end
            time.sleep(0.2)
        yield service, url
    finally:
        gw.terminate()
        gw.wait(30)
        server.stop(0)


@needs_chromium
def test_grid_draws_every_block_state(pool_gateway, tmp_path):
    service, url = pool_gateway
    if not service.snapshots:  # an older service: the counts from Stats, a note instead of the grid
        page = page_state(chromium(url + "/", "--dump-dom"))
        assert page["attrs"]["source"] == "stats" and page["grids"] == [] and page["rows"] == 0
        assert page["shown"] == expected_from_stats(service.Stats(None, None))
        return
    snap = service.PoolSnapshot(None, None).chains[0]
    want = {"free": snap.free_blocks - snap.cached_blocks, "owned": snap.owned_blocks, "shared": snap.shared_blocks,
            "cached": snap.cached_blocks}
    assert all(want.values())  # every colour is on the page
    page = page_state(chromium(url + "/", "--dump-dom"))
    assert page["attrs"]["source"] == "snapshot"
    assert page["shown"] == want
    assert page["grids"] == [want]  # one cell per block, coloured by state
    assert page["rows"] == len(snap.sequences) == 9
    stats = service.Stats(None, None)
    assert page["shown"] == expected_from_stats(stats)
    screenshot(url + "/", tmp_path, "dashboard-grid.png")


@needs_chromium
def test_block_chips_off_the_sampling_stride_keep_their_state(pool_gateway):
    """Probe N: past 4,096 blocks the grid is sampled, and every block table chip off the stride was
    drawn "owned", shared ones too: they take their state from the tables that hold them."""
    service, url = pool_gateway
    if not service.snapshots:
        return
    service.stride = 2
    colors = re.search(r"const COLORS = (\[[^\]]*\])", open(os.path.join(ROOT, "gateway/static/dashboard.html")).read())
    owned, shared = json.loads(colors.group(1))[1:3]
    ref = service.m.pool.ref_count
    chips = re.findall(r'<span style="background:\s*(#[0-9a-f]+);?">(\d+)</span>', chromium(url + "/", "--dump-dom"))
    assert chips and {int(b) % 2 for _, b in chips} == {0, 1}
    assert all(color == (shared if ref[int(b)] > 1 else owned) for color, b in chips), chips
