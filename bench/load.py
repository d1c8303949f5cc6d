"""Load and backpressure: many concurrent streaming clients against one LocalCluster.

Workload: the embedded `tiny` Qwen3 in float32, one worker. `--clients` threads (one Client each)
send streaming requests in a loop for `--seconds`: prompt lengths uniform in 16-256 (random byte
tokens), max_new_tokens uniform in 8-64, greedy, EOS ignored, all from a fixed seed. The service
runs with `--max-waiting N`, so beyond N pending requests it answers RESOURCE_EXHAUSTED: such a
client counts a rejection and backs off 50-200 ms (jittered); any other error counts as failed.

Printed: requests ok / rejected / failed; p50 / p99 time to first token and inter-token latency;
RSS of each process at start and end plus the series sampled every `--rss-every` seconds; whether
every block is free once the load has drained (Stats: free_blocks == num_blocks, invariants_ok).
Exit status 1 if anything failed, a block leaked or the invariants broke.

    .venv/bin/python bench/load.py [--clients 64] [--seconds 20] [--max-waiting 32]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from client import Client, LocalCluster  # noqa: E402
from client.errors import MiniPagedError, ResourceExhausted  # noqa: E402

MAX_REQUESTS_PER_CLIENT = 10_000      # a bound on count as well as on time
REQUEST_TIMEOUT_S = 120.0


def rss_mb(pid: int) -> float:
    """VmRSS of a process in MB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class Totals:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.rejected = self.failed = self.tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.errors: Counter = Counter()

    def add_ok(self, ttft: float, itl: list[float], n: int) -> None:
        with self.lock:
            self.ok += 1
            self.tokens += n
            self.ttft.append(ttft)
            self.itl.extend(itl)

    def add_rejected(self) -> None:
        with self.lock:
            self.rejected += 1

    def add_failed(self, why: str) -> None:
        with self.lock:
            self.failed += 1
            self.errors[why[:160]] += 1


def client_loop(i: int, address: str, seed: int, deadline: float, totals: Totals) -> None:
    rng = random.Random(seed * 1_000_003 + i)
    with Client(address) as c:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            prompt = [rng.randrange(0, 256) for _ in range(rng.randint(16, 256))]
            n_new = rng.randint(8, 64)
            t0 = time.perf_counter()
            first = last = None
            itl: list[float] = []
            got, finish = 0, None
            try:
                for chunk in c.stream(prompt_token_ids=prompt, max_new_tokens=n_new, temperature=0.0,
                                      ignore_eos=True, timeout=REQUEST_TIMEOUT_S):
                    now = time.perf_counter()
                    k = len(chunk.token_ids)
                    if k:
                        if first is None:
                            first = now - t0
                        else:  # a chunk of k tokens: k inter-token gaps of (now - last) / k
                            itl.extend([(now - last) / k] * k)
                        last = now
                    got += k
                    finish = chunk.finish_reason or finish
            except ResourceExhausted:
                totals.add_rejected()
                time.sleep(rng.uniform(0.05, 0.2))
                continue
            except MiniPagedError as e:
                totals.add_failed(f"{e.code.name}: {e.details}")
                continue
            except Exception as e:  # noqa: BLE001 - the bench reports, never hides, anything else
                totals.add_failed(f"{type(e).__name__}: {e}")
                continue
            if finish != "length" or got != n_new or first is None:
                totals.add_failed(f"bad result: finish={finish!r}, {got} of {n_new} tokens")
                continue
            totals.add_ok(first, itl, got)


def pct(values, q) -> str:
    return f"{np.percentile(values, q) * 1e3:9.1f}" if values else "      n/a"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-waiting", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=None, help="worker --num-blocks (default: its own sizing)")
    ap.add_argument("--rss-every", type=float, default=2.0, help="RSS sampling period (s)")
    ap.add_argument("--drain-timeout", type=float, default=120.0)
    return ap.parse_args(argv)


def sample_rss(pids: dict, series: list, stop: threading.Event, every: float, t_begin: float) -> None:
    """Every process's RSS every `every` seconds until stopped: the series a leak shows up in."""
    while True:
        series.append((time.monotonic() - t_begin, {n: rss_mb(p) for n, p in pids.items()}))
        if stop.wait(every):
            return


def drain(address: str, timeout: float):
    """Stats once nothing is running or waiting and the pool is whole again (or at the timeout)."""
    ctl = Client(address)
    end = time.monotonic() + timeout
    st = ctl.stats(timeout=10)
    while (st.running or st.waiting or st.free_blocks != st.num_blocks) and time.monotonic() < end:
        time.sleep(0.2)
        st = ctl.stats(timeout=10)
    ctl.close()
    return st


def run_load(cluster, args) -> dict:
    """The clients for --seconds, the RSS sampler beside them, then the drain; what the report needs."""
    pids = {"metadata_service": cluster.processes[0].pid, "worker0": cluster.processes[1].pid}
    rss_start = {n: rss_mb(p) for n, p in pids.items()}
    series: list[tuple[float, dict]] = []
    stop = threading.Event()
    t_begin = time.monotonic()
    totals = Totals()
    deadline = time.monotonic() + args.seconds
    threads = [threading.Thread(target=client_loop, args=(i, cluster.address, args.seed, deadline, totals),
                                daemon=True, name=f"client{i}") for i in range(args.clients)]
    sampler_thread = threading.Thread(target=sample_rss, args=(pids, series, stop, args.rss_every, t_begin),
                                      daemon=True)
    sampler_thread.start()
    for t in threads:
        t.start()
    for t in threads:  # every in-flight request is bounded by REQUEST_TIMEOUT_S
        t.join(timeout=max(1.0, deadline - time.monotonic()) + REQUEST_TIMEOUT_S + 10)
    hung = sum(t.is_alive() for t in threads)
    load_s = time.monotonic() - t_begin

    # drain: nothing running or waiting, then the pool must be whole
    st = drain(cluster.address, args.drain_timeout)
    stop.set()
    sampler_thread.join()
    rss_end = {n: rss_mb(p) for n, p in pids.items()}
    alive = all(p.poll() is None for p in cluster.processes)
    return dict(names=list(pids), rss_start=rss_start, rss_end=rss_end, series=series, totals=totals,
                hung=hung, load_s=load_s, st=st, alive=alive)


def print_requests(args, totals: Totals, load_s: float) -> None:
    total = totals.ok + totals.rejected + totals.failed
    print()
    print(f"load: {args.clients} streaming clients, {args.seconds:.0f} s, --max-waiting {args.max_waiting}, "
          f"seed {args.seed} (ran {load_s:.1f} s incl. the in-flight tail)")
    print(f"{'requests':32s} {'count':>10s}")
    print(f"{'  ok':32s} {totals.ok:10d}")
    print(f"{'  rejected (RESOURCE_EXHAUSTED)':32s} {totals.rejected:10d}")
    print(f"{'  failed':32s} {totals.failed:10d}")
    print(f"{'  total':32s} {total:10d}")
    print(f"{'generated tokens':32s} {totals.tokens:10d}   ({totals.tokens / load_s:.0f} tok/s)")
    print()
    print(f"{'latency (ms)':32s} {'p50':>9s} {'p99':>9s} {'n':>8s}")
    print(f"{'  time to first token':32s} {pct(totals.ttft, 50)} {pct(totals.ttft, 99)} {len(totals.ttft):8d}")
    print(f"{'  inter-token latency':32s} {pct(totals.itl, 50)} {pct(totals.itl, 99)} {len(totals.itl):8d}")
    print()


def print_rss(names, series, rss_start, rss_end) -> list:
    """Start / end / max RSS per process and the sampled series; returns the processes whose RSS
    keeps growing."""
    print(f"{'RSS (MB)':32s} {'start':>9s} {'end':>9s} {'max':>9s}")
    growing = []
    for n in names:
        vals = [rss_start[n]] + [s[n] for _, s in series] + [rss_end[n]]   # the peak of all we read
        print(f"  {n:26s} {rss_start[n]:9.1f} {rss_end[n]:9.1f} {max(vals):9.1f}")
        # "keeps growing": the second half of the series sits well above the first half's peak
        half = len(vals) // 2
        if half >= 2 and min(vals[half:]) > max(vals[:half]) * 1.10 + 20:
            growing.append(n)
    print("RSS series (s: " + ", ".join(names) + "):")
    for t, s in series:
        print(f"  {t:6.1f}: " + ", ".join(f"{s[n]:.1f}" for n in names))
    print()
    return growing


def print_verdict(m: dict, growing: list) -> int:
    """After the drain: the pool, the processes, the RSS trend, the failures; 1 if anything is wrong."""
    st, totals, alive, hung = m["st"], m["totals"], m["alive"], m["hung"]
    blocks_ok = st.free_blocks == st.num_blocks and st.invariants_ok and not st.running and not st.waiting
    print(f"after drain: running={st.running} waiting={st.waiting} free_blocks={st.free_blocks}/{st.num_blocks} "
          f"(cached {st.cached_blocks}) invariants_ok={st.invariants_ok} preemptions={st.preemptions} "
          f"live_sequences={st.live_sequences}")
    print(f"every block free at the end: {'yes' if blocks_ok else 'NO'}")
    print(f"processes alive at the end: {'yes' if alive else 'NO'}; hung client threads: {hung}")
    print(f"RSS keeps growing: {'YES: ' + ', '.join(growing) if growing else 'no'}")
    for why, n in totals.errors.most_common(10):
        print(f"  failure x{n}: {why}")
    bad = totals.failed or not blocks_ok or not alive or hung or growing
    return 1 if bad else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"starting LocalCluster(tiny, 1 worker, float32, --max-waiting {args.max_waiting}) ...", flush=True)
    with LocalCluster(model="tiny", workers=1, dtype="float32", num_blocks=args.num_blocks,
                      extra_service_args=["--max-waiting", str(args.max_waiting)]) as cluster:
        m = run_load(cluster, args)

    # ---------------------------------------------------------------- report
    print_requests(args, m["totals"], m["load_s"])
    growing = print_rss(m["names"], m["series"], m["rss_start"], m["rss_end"])
    return print_verdict(m, growing)


if __name__ == "__main__":
    sys.exit(main())
