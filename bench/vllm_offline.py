"""vLLM's offline engine as a measuring anchor, driven by bench/e2e.py over stdin/stdout.

Runs in vLLM's OWN virtual environment (never imports this repository): bench/e2e.py starts
`VLLM_PYTHON bench/vllm_offline.py CHECKPOINT PROMPTS.json NEW_TOKENS BLOCK_SIZE`, waits for the
ready line, then sends `run` once per timed repetition (so its runs alternate with ours without
paying vLLM's start-up again) and `quit` at the end. Every answer is one line starting with "@@ "
and holding JSON; vLLM's own logging goes to stderr.

`run PROMPTS.json NEW_TOKENS` runs another prompt set (so one engine serves several workloads).
Each answer to `run` also carries `rss`: the peak resident set (VmHWM, MB) of this process and of
each process it started (vLLM's engine core runs in a child).

Each run: greedy, ignore_eos, exactly NEW_TOKENS tokens per prompt, prompts given as token ids
(no tokenizer), prefix cache reset first so no run is helped by an earlier one (vLLM caches
prefixes by default, as we do). A warm-up on other prompts happens before `ready`.
"""
import json
import os
import sys
import time


def say(obj) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def peak_rss_tree(root: int | None = None) -> dict:
    """{"pid name": VmHWM MB} for this process and its descendants (Linux /proc)."""
    root = root or os.getpid()
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                st = dict(line.split(":", 1) for line in f if ":" in line)
            out[f"{pid} {st['Name'].strip()}"] = int(st["VmHWM"].split()[0]) / 1024
        except (OSError, KeyError, ValueError):
            pass
    return out


def main() -> None:
    path, prompts_file, new_tokens, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; bench/e2e.py sets it per model
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(model=path, dtype=os.environ.get("BENCH_VLLM_DTYPE", "float32"), block_size=block_size,
              skip_tokenizer_init=True, seed=0, max_model_len=4096)
    warm = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 200 for j in range(64 + 32 * i)]) for i in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
    say({"ready": True, "startup_s": time.perf_counter() - t0, "version": vllm.__version__})
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        if cmd != "run":
            say({"error": f"unknown command {cmd!r}"})
            continue
        if rest:
            with open(rest[0]) as f:
                prompts = json.load(f)
            new_tokens = int(rest[1])
        params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0,
                                ignore_eos=True, detokenize=False)
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        say({"wall": wall, "tokens": [list(o.outputs[0].token_ids) for o in out], "rss": peak_rss_tree()})


if __name__ == "__main__":
    sys.stdout = os.fdopen(os.dup(1), "w")   # our protocol channel ...
    os.dup2(2, 1)                            # ... and anything vLLM prints goes to stderr
    main()
