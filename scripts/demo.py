"""`make demo`: a two-stage cluster on this CPU with the HTTP gateway, one streamed request, one job
of 32 prompts through the SDK, one OpenAI-style HTTP request, then the stats.

Several prompts share a long common prefix (a "system prompt"), so once the first of them has run
its full KV blocks are reused from the prefix cache instead of being recomputed. The two stages keep
two micro-batches in flight, each with its next step already sent (async scheduling), so both are
busy at once."""
from __future__ import annotations

import json
import os
import random
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from client import LocalCluster  # noqa: E402

SYSTEM = ("You are a careful assistant for a paged KV cache. Answer briefly, cite the block table, "
          "and never invent slots that the allocator did not hand out.\n")  # ~150 bytes: 9 full blocks
WORDS = ("block table slot page cache prefix token sequence worker stage layer head query key value "
         "attention batch decode prefill chunk budget preempt evict hash reuse").split()


def make_prompts(n: int = 32, seed: int = 0) -> list[dict]:
    """Deterministic mixed lengths: half behind the shared prefix, half free-standing; greedy
    except every fourth, which samples with a fixed seed."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        prompt = (SYSTEM + f"Q{i}: {body}?") if i % 2 == 0 else f"{body}."
        item = {"prompt": prompt, "max_new_tokens": rng.choice([8, 16, 24, 32])}
        if i % 4 == 3:  # some sampled ones, seeded so every run prints the same
            item.update(temperature=0.8, top_p=0.95, seed=i)
        items.append(item)
    return items


def main() -> int:
    t0 = time.time()
    print("starting LocalCluster(model='tiny', workers=2, dtype='float32', http=True) ...", flush=True)
    with LocalCluster(model="tiny", workers=2, dtype="float32", http=True) as cluster:
        c = cluster.client
        print(f"ready at {cluster.address} (gRPC) and {cluster.http_url} (OpenAI API, dashboard at /) in "
              f"{time.time() - t0:.1f}s (service, {len(cluster.layers)} workers, gateway; logs in {cluster.log_dir})\n")

        # One streamed request first: it also puts the shared prefix into the prefix cache.
        # (tiny has random weights: its text is noise, so the token ids are shown too.)
        print("stream (token ids as they arrive):", end=" ", flush=True)
        for chunk in c.stream(prompt=SYSTEM + "Q: what is a slot?", max_new_tokens=16):
            print(*chunk.token_ids, end=" ", flush=True)
        print(f"-> {chunk.finish_reason}, {chunk.usage}\n")

        items = make_prompts()
        t1 = time.time()
        job_id = c.submit(items)
        results = c.wait(job_id, progress=True)
        elapsed = time.time() - t1
        tokens = sum(len(r.token_ids) for r in results)
        print(f"\njob {job_id}: {len(results)} requests, {tokens} tokens in {elapsed:.2f}s\n")
        for item, r in list(zip(items, results))[:6]:
            head = item["prompt"][-40:] if item["prompt"].startswith(SYSTEM) else item["prompt"][:40]
            print(f"  [{r.index:2d}] {head!r:44} -> {r.text[:12]!r:16} {r.token_ids[:4]}... "
                  f"{len(r.token_ids):2d} tok, {r.finish_reason}, {r.usage.cached_tokens} cached")
        # The same model through the OpenAI-compatible HTTP API (what the `openai` client sends).
        body = {"model": "tiny", "prompt": SYSTEM + "Q: what is a block table?", "max_tokens": 8, "temperature": 0}
        req = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.load(resp)
        print(f"\nPOST {cluster.http_url}/v1/completions -> finish_reason={out['choices'][0]['finish_reason']!r}, "
              f"usage={out['usage']}")
        st = c.stats()
        print("\n" + st.table())
        for ch in st.chains:
            busy = ", ".join(f"{s['layer_start']}:{s['layer_end']} {float(s['busy_fraction']):.0%}" for s in ch["stages"])
            print(f"chain {ch['chain_id']}: {ch['micro_batches']} micro-batches in flight, stage busy {busy}")
    print(f"\nshut down; total {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
