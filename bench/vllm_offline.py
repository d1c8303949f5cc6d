"""vLLM's offline engine as a measuring anchor, driven by bench/e2e.py over stdin/stdout.

Runs in vLLM's OWN virtual environment (never imports this repository): bench/e2e.py starts
`VLLM_PYTHON bench/vllm_offline.py CHECKPOINT PROMPTS.json NEW_TOKENS BLOCK_SIZE`, waits for the
ready line, then sends `run` once per timed repetition (so its runs alternate with ours without
paying vLLM's start-up again) and `quit` at the end. Every answer is one line starting with "@@ "
and holding JSON; vLLM's own logging goes to stderr.

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


def main() -> None:
    path, prompts_file, new_tokens, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the workload needs ~0.2
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(model=path, dtype="float32", block_size=block_size, skip_tokenizer_init=True, seed=0,
              max_model_len=4096)
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    warm = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 200 for j in range(64 + 32 * i)]) for i in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
    say({"ready": True, "startup_s": time.perf_counter() - t0, "version": vllm.__version__})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd != "run":
            say({"error": f"unknown command {cmd!r}"})
            continue
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        say({"wall": wall, "tokens": [list(o.outputs[0].token_ids) for o in out]})


if __name__ == "__main__":
    sys.stdout = os.fdopen(os.dup(1), "w")   # our protocol channel ...
    os.dup2(2, 1)                            # ... and anything vLLM prints goes to stderr
    main()
