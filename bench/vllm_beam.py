"""vLLM's offline beam search (`LLM.beam_search`) as the anchor of bench/beam.py.

Runs in vLLM's OWN virtual environment (never imports this repository): bench/beam.py starts
`VLLM_PYTHON bench/vllm_beam.py CHECKPOINT PROMPTS.json NEW_TOKENS BLOCK_SIZE`, waits for the ready
line, then sends `run K` per timed run and `quit` at the end; every answer is one line "@@ JSON".
vLLM's beam search is API-level: each step it sends one request per beam (max_tokens=1,
logprobs=2K) and keeps the best K; its prefix cache serves the shared tokens. Each run: ignore_eos,
exactly NEW_TOKENS tokens per beam, prefix cache reset first.
"""
import json
import os
import sys
import time


def say(obj) -> None:
    print("@@ " + json.dumps(obj), flush=True)


def main() -> None:
    path, prompts_file, new_tokens, block_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(model=path, dtype="float32", block_size=block_size, seed=0, max_model_len=4096)
    warm = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 200 for j in range(64)]) for i in range(2)]
    llm.beam_search(warm, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    say({"ready": True, "startup_s": time.perf_counter() - t0, "version": vllm.__version__})
    for line in sys.stdin:
        cmd = line.split()
        if cmd == ["quit"]:
            break
        k = int(cmd[1])
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts],
                              BeamSearchParams(beam_width=k, max_tokens=new_tokens, ignore_eos=True))
        wall = time.perf_counter() - start
        beams = [[list(s.tokens[len(p):]) for s in o.sequences] for o, p in zip(out, prompts)]
        say({"wall": wall, "beams": beams})


if __name__ == "__main__":
    sys.stdout = os.fdopen(os.dup(1), "w")   # our protocol channel ...
    os.dup2(2, 1)                            # ... and anything vLLM prints goes to stderr
    main()
