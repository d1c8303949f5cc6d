"""KVBlockManager benchmark against the seed's plain-list manager, measured in the same run.

    .venv/bin/python bench/block_manager.py

Rows: append_token ops/s; one decode step for 256 sequences at 2k context, block size 16
(slot_mapping_for_append + get_block_table_tensor + get_seq_lens_tensor); the same step through the
gRPC block API on loopback (AppendTokens + GetBlockTables; server in-process on a thread pool, so
client and server share one GIL); prefix-cache lookups/s. Prints only.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import seed_block_manager as seed  # noqa: E402  (sibling file: the anchor)
from metadata_service.block_api import BlockApi, BlockApiServicer  # noqa: E402
from metadata_service.block_manager import KVBlockManager  # noqa: E402
from minipaged import wire  # noqa: E402
from minipaged.v1 import metadata_pb2 as pb  # noqa: E402
from minipaged.v1 import metadata_pb2_grpc as pb_grpc  # noqa: E402

B, BATCH, CTX, STEPS = 16, 256, 2048, 200
rng = np.random.default_rng(0)


def median_us(fn, iters: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


# ---------------------------------------------------------------- append_token
def bench_append_token(n: int = 100_000) -> tuple[float, float]:
    ours, base = KVBlockManager(n // B + 1, B), seed.KVBlockManager(n // B + 1, B)
    ours.create_sequence(0)
    base.create_sequence(0)
    rates = []
    for m in (ours, base):
        t = time.perf_counter()
        for _ in range(n):
            m.append_token(0)
        rates.append(n / (time.perf_counter() - t))
    return rates[0], rates[1]


# ---------------------------------------------------------------- decode step
def make_ours() -> KVBlockManager:
    m = KVBlockManager(BATCH * (CTX // B + STEPS // B + 4), B)
    for s in range(BATCH):
        m.create_sequence(s)
        m.append_tokens(s, CTX, rng.integers(0, 32000, CTX))
    return m


def make_seed() -> seed.KVBlockManager:
    m = seed.KVBlockManager(BATCH * (CTX // B + STEPS // B + 4), B)
    for s in range(BATCH):
        m.create_sequence(s)
        for _ in range(CTX):
            m.append_token(s)
    return m


def bench_decode() -> tuple[float, float]:
    ids, ours, base = list(range(BATCH)), make_ours(), make_seed()
    toks = rng.integers(0, 32000, BATCH).astype(np.int32)

    def step_ours():
        ours.slot_mapping_for_append(ids, toks)
        ours.get_block_table_tensor(ids)
        ours.get_seq_lens_tensor(ids)

    def step_seed():
        base.slot_mapping_for_append(ids)
        base.get_block_table_tensor(ids)
        base.get_seq_lens_tensor(ids)

    r = median_us(step_ours, STEPS), median_us(step_seed, STEPS)
    assert ours.invariants_ok() and base.invariants_ok()
    return r


# ---------------------------------------------------------------- through gRPC
class SeedServicer(pb_grpc.MetadataServiceServicer):
    """The seed manager behind the same two RPCs (same wire format, one lock)."""

    def __init__(self, m: seed.KVBlockManager):
        self.m, self.lock = m, threading.Lock()

    def AppendTokens(self, request, context):
        ids = wire.unpack(request.sequence_ids, wire.INT64).tolist()
        with self.lock:
            slots = self.m.slot_mapping_for_append(ids)
        return pb.AppendTokensReply(slot_mapping=wire.pack(slots.numpy()))

    def GetBlockTables(self, request, context):
        ids = wire.unpack(request.sequence_ids, wire.INT64).tolist()
        with self.lock:
            t, lens = self.m.get_block_table_tensor(ids), self.m.get_seq_lens_tensor(ids)
        return pb.GetBlockTablesReply(block_tables=wire.pack(t.numpy()), max_blocks=t.shape[1],
                                      seq_lens=wire.pack(lens.numpy()))


def grpc_step_us(servicer) -> float:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_MetadataServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.MetadataServiceStub(ch)
            ids = wire.pack(np.arange(BATCH), wire.INT64)

            def step():
                stub.AppendTokens(pb.AppendTokensRequest(sequence_ids=ids))
                r = stub.GetBlockTables(pb.GetBlockTablesRequest(sequence_ids=ids))
                wire.unpack_2d(r.block_tables, BATCH, r.max_blocks)

            return median_us(step, STEPS) / 2          # two round trips per step
    finally:
        server.stop(None)


def bench_grpc() -> tuple[float, float]:
    ours = grpc_step_us(BlockApiServicer(BlockApi(make_ours(), threading.Lock())))
    return ours, grpc_step_us(SeedServicer(make_seed()))


# ---------------------------------------------------------------- prefix lookups
def bench_prefix(n_prompts: int = 64, length: int = 512, lookups: int = 2000) -> tuple[float, float]:
    prompts = [rng.integers(0, 32000, length).tolist() for _ in range(n_prompts)]
    ours = KVBlockManager(n_prompts * length // B + 8, B)
    index = seed.SeedPrefixIndex(B)
    for i, p in enumerate(prompts):
        ours.create_sequence(i)
        ours.append_tokens(i, length, p)
        index.insert(p, list(ours.sequences[i].block_table))
    queries = [prompts[i % n_prompts] + [1] for i in range(lookups)]   # every full block hits
    rates = []
    for lookup in (ours.prompt_cache_lookup, index.lookup):
        t = time.perf_counter()
        hits = sum(lookup(q) for q in queries)
        rates.append(lookups / (time.perf_counter() - t))
        assert hits == lookups * length
    return rates[0], rates[1]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    t0 = time.perf_counter()
    rows = []
    a, b = bench_append_token()
    rows.append(("append_token", "ops/s", a, b, a / b, ""))
    a, b = bench_decode()
    rows.append((f"decode step {BATCH} seqs @ {CTX} ctx, B={B}", "us", a, b, b / a, "<= 200 us"))
    a, b = bench_grpc()
    rows.append(("same step via gRPC (per round trip)", "us", a, b, b / a, "<= 1000 us"))
    a, b = bench_prefix()
    rows.append(("prefix-cache lookup, 512-token prompt", "lookups/s", a, b, a / b, ""))
    print(f"{'metric':40} {'unit':>9} {'ours':>12} {'seed-style':>12} {'speedup':>8}  goal")
    for name, unit, ours, base, speedup, goal in rows:
        print(f"{name:40} {unit:>9} {ours:12,.1f} {base:12,.1f} {speedup:7.1f}x  {goal}")
    print(f"(total {time.perf_counter() - t0:.1f} s; medians; 'seed-style' = bench/seed_block_manager.py)")


if __name__ == "__main__":
    main()
