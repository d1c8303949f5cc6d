"""What `make compose-test` sends and what it compares with: the requests (a stream and three
jobs of random token ids), the same requests through LocalCluster (host processes, same model and
dtype), token-exactness, and waiting until a job is mid-way (for the faults)."""
from __future__ import annotations

import random
import time

from compose_stack import DTYPE, GATEWAY_PROMPT, MODEL, Failed, log  # first: puts the repo on sys.path

from client import Client, LocalCluster
from minipaged.config import load_model_config


def make_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(4, 48))] for _ in range(n)]


def workload() -> dict:
    vocab = load_model_config(MODEL).vocab_size
    a = [{"prompt_token_ids": p, "max_new_tokens": 24, "ignore_eos": True} for p in make_prompts(28, 1, vocab)]
    a += [{"prompt_token_ids": p, "max_new_tokens": 24, "ignore_eos": True, "temperature": 0.8, "top_p": 0.95,
           "seed": 1000 + i} for i, p in enumerate(make_prompts(4, 2, vocab))]   # seeded sampling, too
    long = lambda seed: [{"prompt_token_ids": p, "max_new_tokens": 96, "ignore_eos": True}  # noqa: E731
                         for p in make_prompts(32, seed, vocab)]
    return {"stream": {"prompt": "The paged KV cache", "max_new_tokens": 32, "ignore_eos": True},
            "jobs": {"A": a, "B": long(3), "C": long(4)}}


def reference(work: dict) -> dict:
    """The same requests through LocalCluster (host processes), same model and dtype."""
    with LocalCluster(model=MODEL, workers=2, dtype=DTYPE) as cluster:
        c = cluster.client
        out = {"stream": c.generate(**work["stream"]).token_ids,
               "gateway_text": c.generate(**GATEWAY_PROMPT, temperature=0.0).text}
        for name, requests in work["jobs"].items():
            out[name] = [r.token_ids for r in c.wait(c.submit(requests), timeout=600)]
    return out


def expect_exact(what: str, got: list, want: list, unit: str = "results") -> None:
    if got != want:
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        raise Failed(f"{what}: not token-exact against LocalCluster ({len(bad)} of {len(want)} {unit} differ, "
                     f"first {bad[:5]}; lengths {len(got)} vs {len(want)})")
    log(f"   {what}: token-exact against LocalCluster ({len(want)} {unit})")


def wait_progress(c: Client, job: str, steps: int, timeout: float = 120.0) -> None:
    """Until the engine ran `steps` more steps for this job and it is still unfinished."""
    start, end = c.stats().steps, time.monotonic() + timeout
    while c.stats().steps < start + steps:
        if c.get_job(job).done:
            raise Failed("the job finished before the fault; make it longer")
        if time.monotonic() > end:
            raise Failed(f"no progress on job {job} within {timeout:.0f}s")
        time.sleep(0.05)
