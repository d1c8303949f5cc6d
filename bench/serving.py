"""The serving path: our HTTP gateway against vLLM's OpenAI server, same checkpoint, same load.

Both expose POST /v1/completions (OpenAI's API with vLLM's extensions: ignore_eos, min_tokens);
each gets the e2e workload (bench/e2e.py: 64 prompts of 16-512 random ids, 64 new tokens, greedy)
as 64 concurrent requests with token-id prompts, after a warm-up on other prompts, `--repeat`
times, alternating (vLLM's processes are stopped with SIGSTOP while ours run: its idle CPU worker
polls on a whole core). Ours: LocalCluster(http=True) (metadata service + worker + gateway processes),
with LocalCluster's default thread count and with cores - 1; vLLM: its OpenAI api_server from its
own venv (--vllm-python; started once, its start-up not timed), computing on the cores we use
(--vllm-cores, VLLM_CPU_OMP_THREADS_BIND: "0-1" on this 2-core machine; "" for its default, which
keeps a core for its engine). Every round sends new prompts (the same to both servers): vLLM's server
keeps its prefix cache between rounds. The table gives completion tok/s (usage.completion_tokens over
the wall time of the whole batch of requests), the ratio, and our processes' CPU microseconds per
completion token (from /proc: the metadata service, the worker, the gateway).

    .venv/bin/python bench/serving.py --vllm-python /work/vllm-venv/bin/python [--repeat 2] [--vllm-cores 0-1]
        [--model tiny|qwen3-0.6b|qwen3-1.7b|PATH] [--prompts 64] [--new-tokens 64]
        [--dtype float32|bfloat16] [--vllm-dtype bfloat16] [--sampling greedy|qwen3|temperature|default]

`--model` other than tiny (bench/shapes.py's cached random-weight shapes, or a checkpoint): prompts of
16-64 ids over its whole vocabulary (e2e's decode-heavy lengths), 2 GiB of K/V for each server. Both
compute in float32 (the parity dtype; our `--dtype auto` for a float32 checkpoint or a CPU without
bfloat16 instructions) unless `--dtype bfloat16` (our CPU bfloat16 mode against vLLM's bfloat16:
both servers' default for a bfloat16 checkpoint on a CPU with AVX512_BF16 / AMX); `--vllm-dtype`
sets vLLM's alone.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from client import LocalCluster  # noqa: E402
from client.cluster import free_port  # noqa: E402
from e2e import exit_on_sigterm, hf_model, save_checkpoint, vllm_env, workload  # noqa: E402
from scale import proc_cpu_s  # noqa: E402
from worker.model_runner import cpu_compute_threads  # noqa: E402


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


SAMPLING = {"greedy": dict(temperature=0),
            "qwen3": dict(temperature=0.6, top_p=0.95, top_k=20),   # Qwen3's card (thinking mode)
            # every field sent, so a checkpoint's generation_config.json (both servers apply it) adds nothing
            "temperature": dict(temperature=1.0, top_p=1.0, top_k=0),
            "default": {}}   # no sampling field: each server's defaults (bench/shapes.py: Qwen3's file)


def load(base_url: str, model: str, prompts, new_tokens: int, sampling: str = "greedy") -> dict:
    """All prompts at once, one request each; returns wall time and completion tokens."""
    def one(p):
        r = post(f"{base_url}/v1/completions", {"model": model, "prompt": p, "max_tokens": new_tokens,
                                                "min_tokens": new_tokens, "ignore_eos": True,
                                                **SAMPLING[sampling]})
        return r["usage"]["completion_tokens"]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        tokens = sum(ex.map(one, prompts))
    return dict(wall=time.perf_counter() - t0, tokens=tokens)


def signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_http(url: str, proc, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--vllm-cores", default=f"0-{(os.cpu_count() or 1) - 1}",
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: every core, as ours use; '' = its default)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", default="tiny", help="tiny, a named shape (bench/shapes.py) or a checkpoint")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="both servers' compute dtype (ours: bfloat16 is the CPU bfloat16 mode, README)")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="every request's sampling: greedy (temperature 0), qwen3 (Qwen3's card: temperature "
                         "0.6, top_p 0.95, top_k 20), temperature (1.0, nothing filtered) or default (no sampling field: each "
                         "server's defaults, the checkpoint's generation_config.json for both); no seed (vLLM-CPU 0.32's "
                         "seeded requests fail its engine once a prefill is chunked: CPU Generator does not use offset)")
    ap.add_argument("--vllm-dtype", default="",
                    help="vLLM's alone (bfloat16 = its default for a bfloat16 checkpoint; default: --dtype)")
    return ap.parse_args()


def spawn_vllm(args, ckpt: str, workdir: str):
    """vLLM's OpenAI server from its own venv: (process, its log file, base URL). Not waited for here,
    so that the caller holds the process (and stops it) even if it never becomes ready."""
    port = free_port()
    vllm_log = open(os.path.join(workdir, "vllm-serve.log"), "w")
    env = vllm_env(workdir, VLLM_CPU_KVCACHE_SPACE="1" if args.model == "tiny" else "2")
    if args.vllm_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cores
    vllm = subprocess.Popen(
        [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
         "--served-model-name", "tiny", "--dtype", args.vllm_dtype or args.dtype, "--block-size", "32",
         "--max-model-len", "4096", "--skip-tokenizer-init", "--port", str(port), "--host", "127.0.0.1"],
        stdout=vllm_log, stderr=subprocess.STDOUT, cwd=workdir, env=env,
        start_new_session=True)   # its own process group: paused, resumed and stopped as one
    return vllm, vllm_log, f"http://127.0.0.1:{port}"


def stop_vllm(vllm, vllm_log) -> None:
    signal_group(vllm, signal.SIGCONT)
    signal_group(vllm, signal.SIGTERM)
    try:
        vllm.wait(timeout=30)
    except subprocess.TimeoutExpired:
        signal_group(vllm, signal.SIGKILL)
    vllm_log.close()


def run_our_gateways(ckpt: str, warm, prompts, new_tokens: int, runs, kv_bytes: int = 0,
                     dtype: str = "float32", sampling: str = "greedy") -> None:
    """One round of each of our rows, each on a fresh cluster, with our processes' CPU per token."""
    for label, threads in ((f"minipaged gateway, 1 worker, {dtype}", None),
                           (f"minipaged gateway, 1 worker, {dtype}, {cpu_compute_threads()} thread(s)",
                            cpu_compute_threads())):
        kw = dict(threads=threads) if threads else {}
        extra = ["--kv-cache-bytes", str(kv_bytes)] if kv_bytes else []
        with LocalCluster(model=ckpt, workers=1, dtype=dtype, http=True, extra_worker_args=extra,
                          startup_timeout=900, **kw) as c:
            model = json.loads(urllib.request.urlopen(f"{c.http_url}/v1/models").read())["data"][0]["id"]
            load(c.http_url, model, warm, 4)
            cpu0 = [proc_cpu_s(p.pid) for p in c.processes]
            r = load(c.http_url, model, prompts, new_tokens, sampling)
            r["cpu_us"] = [1e6 * (proc_cpu_s(p.pid) - x) / r["tokens"] for p, x in zip(c.processes, cpu0)]
            runs.setdefault(label, []).append(r)


def run_vllm_round(vllm, vllm_url: str, args, prompts, runs) -> None:
    """One round of vLLM's server, resumed only for it (stopped again while ours run)."""
    signal_group(vllm, signal.SIGCONT)
    time.sleep(1.0)
    cores = f"cores {args.vllm_cores}" if args.vllm_cores else "its default cores"
    runs.setdefault(f"vLLM OpenAI server (vllm-cpu 0.32, {cores}, {args.vllm_dtype or args.dtype})", []).append(
        load(vllm_url, "tiny", prompts, args.new_tokens, args.sampling))
    signal_group(vllm, signal.SIGSTOP)


def print_table(args, runs) -> None:
    tps = {k: [r["tokens"] / r["wall"] for r in v] for k, v in runs.items()}
    mean = {k: sum(v) / len(v) for k, v in tps.items()}
    ref = next((mean[k] for k in mean if k.startswith("vLLM")), None)
    lens = "16-512" if args.model == "tiny" else "16-64"
    print(f"\nmodel {args.model}: {args.prompts} concurrent /v1/completions requests, token-id prompts of {lens}, "
          f"{args.new_tokens} new tokens each, {args.sampling} sampling ({SAMPLING[args.sampling]}), ignore_eos; "
          f"load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| server | completion tok/s (mean) | each run | x vLLM server | CPU us/token: service, worker, gateway |")
    print("|---|---|---|---|---|")
    for k in runs:
        each = ", ".join(f"{x:.0f}" for x in tps[k])
        cpu = [r["cpu_us"] for r in runs[k] if "cpu_us" in r]
        per = ", ".join(f"{sum(c[i] for c in cpu) / len(cpu):.0f}" for i in range(len(cpu[0]))) if cpu else "-"
        print(f"| {k} | {mean[k]:.0f} | {each} | {f'{mean[k] / ref:.2f}' if ref else '-'} | {per} |")


def prompts_for(args, ckpt: str, n: int, seed: int):
    if args.model == "tiny":
        return workload(n, seed=seed)
    from minipaged.config import load_model_config
    return workload(n, seed, 16, 64, load_model_config(ckpt).vocab_size)


def main():
    args = parse_args()
    exit_on_sigterm()
    workdir = tempfile.mkdtemp(prefix="minipaged-serving-")
    if args.model == "tiny":
        ckpt = save_checkpoint(hf_model(), os.path.join(workdir, "tiny-qwen3"))
    else:
        from shapes import SHAPES, ensure_checkpoint
        ckpt = ensure_checkpoint(args.model) if args.model in SHAPES else args.model
    warm = prompts_for(args, ckpt, 4, 1)
    kv_bytes = 0 if args.model == "tiny" else 2 << 30
    runs: dict[str, list[dict]] = {}
    vllm = vllm_log = None
    try:
        if args.vllm_python:
            vllm, vllm_log, vllm_url = spawn_vllm(args, ckpt, workdir)
            wait_http(f"{vllm_url}/health", vllm)
            load(vllm_url, "tiny", warm, 4)
            signal_group(vllm, signal.SIGSTOP)
        for rep in range(args.repeat):
            # new prompts every round (both servers get the same ones): vLLM's server keeps its prefix
            # cache between rounds, and a repeated batch would skip most of its prefill
            prompts = prompts_for(args, ckpt, args.prompts, 10 + rep)
            run_our_gateways(ckpt, warm, prompts, args.new_tokens, runs, kv_bytes, args.dtype, args.sampling)
            if vllm is not None:
                run_vllm_round(vllm, vllm_url, args, prompts, runs)
    finally:
        if vllm is not None:
            stop_vllm(vllm, vllm_log)
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(args, runs)


if __name__ == "__main__":
    main()
