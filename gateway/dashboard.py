"""The live block-pool dashboard: GET / (one static page, no build step) and GET /dashboard/state,
the JSON the page polls, built from the PoolSnapshot and Stats RPCs at each poll.

Block states, as the seed article draws them: free, owned (one sequence), shared (ref count > 1:
prefix hits and forks) and cached (free, but still holding a reusable prefix; evicted last-used
first). The snapshot is bounded: at most `snapshot_max_blocks` blocks per chain (a larger pool is
sampled with a stride) and 64 sequences per chain. While the service does not implement
PoolSnapshot (UNIMPLEMENTED), the page degrades to the Stats counts without the grid."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from client.errors import MiniPagedError
from client.messages import PoolSnapshot, Stats

STATES = ("free", "owned", "shared", "cached")  # block_state codes 0..3


def counts_from_stats(s: Stats) -> dict:
    """Disjoint counts from Stats: its free_blocks include the cached ones, its used_blocks the
    shared ones."""
    return {"free": s.free_blocks - s.cached_blocks, "owned": s.used_blocks - s.shared_blocks,
            "shared": s.shared_blocks, "cached": s.cached_blocks}


def counts_from_snapshot(snap: PoolSnapshot) -> dict:
    """Exact counts over every chain's whole pool (not the sampled grid), made disjoint: the
    snapshot's free_blocks include the cached ones, as Stats' do."""
    out = dict.fromkeys(STATES, 0)
    for c in snap.chains:
        out["free"] += c.free_blocks - c.cached_blocks
        out["owned"] += c.owned_blocks
        out["shared"] += c.shared_blocks
        out["cached"] += c.cached_blocks
    return out


def page() -> str:
    return resources.files("gateway").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def dashboard_routes(app: FastAPI, gw) -> None:
    html = page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/state")
    async def state():
        stats_r, snap_r = await asyncio.gather(
            gw.stats(),
            gw.client.pool_snapshot(max_blocks=gw.config.snapshot_max_blocks, max_sequences=64,
                                    timeout=gw.config.rpc_timeout),
            return_exceptions=True)
        out = {"time": time.time(), "model": gw.model_name, "stats": None, "stats_error": None,
               "snapshot": None, "snapshot_error": None, "counts": None, "counts_source": None,
               "gateway": {"ttft_sum": gw.ttft_sum, "ttft_count": gw.ttft_count}}
        for r, key in ((stats_r, "stats"), (snap_r, "snapshot")):
            if isinstance(r, MiniPagedError):
                out[f"{key}_error"] = str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                out[key] = asdict(r)
        # int64 past 2^53 would lose digits in JavaScript: epochs and sequence ids travel as strings
        if out["stats"] is not None:
            out["stats"]["cache_epoch"] = str(out["stats"]["cache_epoch"])
        for chain in (out["snapshot"] or {}).get("chains", []):
            for seq in chain["sequences"]:
                seq["sequence_id"] = str(seq["sequence_id"])
        if not isinstance(snap_r, BaseException):
            out["counts"], out["counts_source"] = counts_from_snapshot(snap_r), "snapshot"
        elif not isinstance(stats_r, BaseException):
            out["counts"], out["counts_source"] = counts_from_stats(stats_r), "stats"
        return JSONResponse(out, headers={"Cache-Control": "no-cache"})
