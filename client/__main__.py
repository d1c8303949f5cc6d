"""`python -m client generate|submit|watch|stats|job|cancel`: the SDK from a shell.

Results print as JSON lines (one per request) so they pipe into jq; errors print "CODE: message"
on stderr and exit 1."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import MiniPagedError
from .sdk import Client


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=os.environ.get("MINIPAGED_ADDRESS", "127.0.0.1:50051"),
                        help="metadata service HOST:PORT (env MINIPAGED_ADDRESS)")
    common.add_argument("--token", default=os.environ.get("MINIPAGED_TOKEN"),
                        help="bearer token (env MINIPAGED_TOKEN)")
    common.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds")

    ap = argparse.ArgumentParser(prog="python -m client", description="MiniPaged-Qwen client")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", parents=[common], help="one request; prints the text (or JSON)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_ids, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", action="store_true", help="return per-token logprobs")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print the whole result as JSON")

    s = sub.add_parser("submit", parents=[common], help="submit a job from JSON lines; prints the job id")
    s.add_argument("--file", required=True, help="JSON lines, one request dict each ('-' = stdin)")
    s.add_argument("--wait", action="store_true", help="then wait and print results as JSON lines")
    s.add_argument("--no-progress", action="store_true")

    w = sub.add_parser("watch", parents=[common], help="progress bar, then results as JSON lines")
    w.add_argument("job_id")
    w.add_argument("--no-progress", action="store_true")

    for name, what in (("job", "job state and finished results"), ("cancel", "cancel a job")):
        sub.add_parser(name, parents=[common], help=what).add_argument("job_id")

    st = sub.add_parser("stats", parents=[common], help="pool, fragmentation, queue, invariants")
    st.add_argument("--json", action="store_true")
    return ap


def _generate_kwargs(a) -> dict:
    return dict(prompt=a.prompt, prompt_token_ids=a.prompt_ids, max_new_tokens=a.max_new_tokens,
                temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=a.stop,
                stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos, return_logprobs=a.logprobs)


def _read_requests(path: str) -> list[dict]:
    f = sys.stdin if path == "-" else open(path)
    try:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    finally:
        if f is not sys.stdin:
            f.close()
    out = []
    for n, line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not JSON: {e}") from None
    return out


def _print_results(results) -> None:
    for r in results:
        print(json.dumps(r.as_dict()), flush=True)


def _job_summary(job) -> dict:
    return {"job_id": job.job_id, "state": job.state, "total": job.total, "completed": job.completed}


def run(a) -> int:
    client = Client(a.address, token=a.token, timeout=a.timeout)
    try:
        if a.command == "generate" and a.stream:
            last = None
            for last in client.stream(**_generate_kwargs(a)):
                sys.stdout.write(last.text)
                sys.stdout.flush()
            print()
            if last is not None and last.usage is not None:
                print(f"[finish_reason={last.finish_reason} {last.usage}]", file=sys.stderr)
        elif a.command == "generate":
            r = client.generate(**_generate_kwargs(a))
            if a.json:
                print(json.dumps(r.as_dict()))
            else:
                print(r.text)
                print(f"[finish_reason={r.finish_reason} {r.usage}]", file=sys.stderr)
        elif a.command == "submit":
            job_id = client.submit(_read_requests(a.file))
            print(job_id, flush=True)
            if a.wait:
                _print_results(client.wait(job_id, progress=not a.no_progress))
        elif a.command == "watch":
            _print_results(client.wait(a.job_id, progress=not a.no_progress))
        elif a.command in ("job", "cancel"):
            job = (client.get_job if a.command == "job" else client.cancel)(a.job_id)
            print(json.dumps(_job_summary(job)))
            _print_results(job.results)
        elif a.command == "stats":
            stats = client.stats()
            print(json.dumps(stats.as_dict()) if a.json else stats.table())
        return 0
    finally:
        client.close()


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return run(a)
    except MiniPagedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, OSError) as e:  # bad input caught before any RPC
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
