"""`python -m client generate|submit|watch|stats|jobs|job|cancel|delete` (also `minipaged ...`):
the SDK from a shell; `serve MODEL` runs the whole local stack in the foreground (client/serve.py).

Results print as JSON lines (one per request) so they pipe into jq; errors print "error: CODE:
message" on stderr and exit 1 (2 for bad input caught before any RPC, 130 on Ctrl-C)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from minipaged.cli import prog_name

from .errors import MiniPagedError
from .messages import DEFAULT_PORT
from .sdk import Client


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(text: str) -> float:
    """'90' or '90s', '30m', '12h', '7d' -> seconds (> 0)."""
    t = text.strip().lower()
    unit = _AGE_UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if unit else t) * (unit or 1)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected an age > 0 like 90s, 30m, 12h or 7d, got {text!r}")
    return value


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, and "(default: None)" only where None means something."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=os.environ.get("MINIPAGED_ADDRESS", f"127.0.0.1:{DEFAULT_PORT}"),
                        help=f"metadata service HOST:PORT; HOST alone means port {DEFAULT_PORT} "
                             f"(env MINIPAGED_ADDRESS)")
    common.add_argument("--token", default=os.environ.get("MINIPAGED_TOKEN"),
                        help="bearer token (env MINIPAGED_TOKEN)")
    common.add_argument("--timeout", type=float, default=None, help="deadline per call, seconds (default: none)")
    common.add_argument("--wait-ready", type=float, default=None, metavar="S",
                        help="wait up to S seconds for a ready worker chain before failing")

    ap = argparse.ArgumentParser(prog=prog_name("client"), description="MiniPaged-Qwen client",
                                 formatter_class=_Formatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_):
        return sub.add_parser(name, parents=[common], help=help_, description=help_, formatter_class=_Formatter)

    g = add("generate", "one request (or one per --prompt); prints the text, or JSON lines with --json")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch run concurrently)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--min-new-tokens", type=int, default=0, help="EOS and stop token ids are masked until then")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default: off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="default: the service picks one")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_ids, default=None, help="comma-separated ids that end generation")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    g.add_argument("--n", type=int, default=1, help="choices to return")
    g.add_argument("--best-of", type=int, default=None, help="candidates generated, the n best returned")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' definition; 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's definition; 0 = off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's definition; 0 = off")
    g.add_argument("--beam-width", type=int, default=0, help="beam search with K beams (K choices, best first)")
    g.add_argument("--length-penalty", type=float, default=None, help="beam search: score = logprob / len ** this")
    g.add_argument("--early-stopping", choices=("false", "true", "never"), default="false", help="beam search")
    g.add_argument("--logprobs", type=int, nargs="?", const=0, default=None, metavar="K",
                   help="return per-token logprobs, and the K best alternatives per token")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true",
                   help="print the whole result as JSON (with --stream: one JSON line per chunk)")

    s = add("submit", "submit a job from JSON lines; prints the job id")
    s.add_argument("--file", required=True, help="JSON lines, one request dict each ('-' = stdin)")
    s.add_argument("--wait", action="store_true", help="then wait and print results as JSON lines")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    w = add("watch", "progress bar, then results as JSON lines")
    w.add_argument("job_id")
    w.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    j = add("jobs", "list jobs, newest first")
    j.add_argument("--limit", type=int, default=100, help="newest jobs to list")
    j.add_argument("--state", default=None, choices=["queued", "running", "done", "cancelled"],
                   help="only jobs in this state")
    j.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    j.add_argument("--cancel-all", action="store_true",
                   help="cancel every unfinished job (of --model); their finished results stay")
    j.add_argument("--model", default=None,
                   help="with --cancel-all: only jobs admitted for this model (name, or >= 8 hex digits of "
                        "its fingerprint)")
    j.add_argument("--purge-older-than", type=_age, default=None, metavar="AGE",
                   help="delete done and cancelled jobs that finished at least AGE ago (90s, 30m, 12h, 7d)")

    for name, what in (("job", "job state and finished results"), ("cancel", "cancel a job"),
                       ("delete", "cancel a job if unfinished, then forget it")):
        add(name, what).add_argument("job_id")

    st = add("stats", "pool, fragmentation, queue, invariants")
    st.add_argument("--json", action="store_true", help="print every field as JSON")

    from .serve import add_arguments as serve_arguments
    what = "serve MODEL over the OpenAI API: metadata service, workers and gateway in the foreground"
    serve_arguments(sub.add_parser("serve", help=what, description=what, formatter_class=_Formatter))
    return ap


def _generate_kwargs(a) -> dict:
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos,
              logprobs=a.logprobs, n=a.n, best_of=a.best_of, min_new_tokens=a.min_new_tokens,
              repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
              frequency_penalty=a.frequency_penalty)
    if a.beam_width:
        kw.update(beam_width=a.beam_width, n=None if a.n == 1 else a.n, length_penalty=a.length_penalty,
                  early_stopping={"false": False, "true": True}.get(a.early_stopping, a.early_stopping))
    if a.prompt_ids is not None:
        kw["prompt_token_ids"] = a.prompt_ids
    return kw


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
    return {"job_id": job.job_id, "state": job.state, "total": job.total, "completed": job.completed,
            "created": job.created}


class _Interrupted(Exception):
    """Ctrl-C, with what the user should know about the work left behind."""


def _generate(client: Client, a) -> None:
    kw = _generate_kwargs(a)
    prompts = a.prompt or []
    if len(prompts) > 1:  # a batch: results in order, as JSON lines or one text each
        results = client.generate(prompts, **kw)
        for r in results:
            print(json.dumps(r.as_dict()) if a.json else r.text, flush=True)
        return
    if prompts:
        kw["prompt"] = prompts[0]
    if a.stream:
        try:
            last = None
            for last in client.stream(**kw):
                if a.json:  # one JSON line per chunk: every field, for jq
                    print(json.dumps(dataclasses.asdict(last)), flush=True)
                elif a.n > 1:
                    print(json.dumps({"index": last.index, "text": last.text, "token_ids": last.token_ids}),
                          flush=True)
                else:
                    sys.stdout.write(last.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            raise _Interrupted("interrupted") from None  # leaving the stream cancelled the request
        if not a.json:
            print()
        if last is not None and last.usage is not None:
            print(f"[finish_reason={last.finish_reason} {last.usage}]", file=sys.stderr)
        return
    r = client.generate(**kw)
    if a.json:
        print(json.dumps(r.as_dict()))
    else:
        for c in r.choices or [r]:
            print(c.text)
        print(f"[finish_reason={r.finish_reason} {r.usage}]", file=sys.stderr)


def _wait(client: Client, job_id: str, progress: bool) -> None:
    try:
        results = client.wait(job_id, progress=progress)
    except KeyboardInterrupt:
        raise _Interrupted(f"interrupted; job {job_id} keeps running: python -m client cancel {job_id}") from None
    _print_results(results)


def _housekeeping(client: Client, a) -> None:
    """`jobs --cancel-all [--model M]` and/or `jobs --purge-older-than AGE`, on the live service."""
    out = {}
    if a.cancel_all:
        out["cancelled_jobs"], out["cancelled_requests"] = client.cancel_pending_jobs(a.model)
    if a.purge_older_than:
        out["purged_jobs"] = client.purge_jobs(a.purge_older_than)
    if a.json:
        print(json.dumps(out))
        return
    if a.cancel_all:
        print(f"cancelled {out['cancelled_jobs']} unfinished job(s): {out['cancelled_requests']} pending "
              f"requests" + (f" of model {a.model}" if a.model else ""))
    if a.purge_older_than:
        print(f"deleted {out['purged_jobs']} finished job(s) older than {a.purge_older_than:g}s")


def run(a) -> int:
    client = Client(a.address, token=a.token, timeout=a.timeout, wait_ready=a.wait_ready)
    try:
        if a.command == "generate":
            _generate(client, a)
        elif a.command == "submit":
            job_id = client.submit(_read_requests(a.file))
            print(job_id, flush=True)
            if a.wait:
                _wait(client, job_id, progress=not a.no_progress)
        elif a.command == "watch":
            _wait(client, a.job_id, progress=not a.no_progress)
        elif a.command == "jobs" and a.model and not a.cancel_all:
            raise ValueError("--model only narrows --cancel-all")
        elif a.command == "jobs" and (a.cancel_all or a.purge_older_than):
            _housekeeping(client, a)
        elif a.command == "jobs":
            jobs = client.list_jobs(limit=a.limit, state=a.state)
            if a.json:
                for job in jobs:
                    print(json.dumps(_job_summary(job)))
            else:
                print(f"{'job_id':<36}  {'state':<9}  {'done':>11}  created")
                for job in jobs:
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.created)) if job.created else "-"
                    print(f"{job.job_id:<36}  {job.state:<9}  {job.completed:>5}/{job.total:<5}  {when}")
        elif a.command in ("job", "cancel", "delete"):
            job = {"job": client.get_job, "cancel": client.cancel, "delete": client.delete_job}[a.command](a.job_id)
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
    if a.command == "serve":
        from .serve import serve
        return serve(a)
    try:
        return run(a)
    except _Interrupted as e:
        print(f"\n{e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `... | head` closed the pipe: stop quietly. Point stdout at /dev/null so the interpreter's
        # final flush does not fail again and print "Exception ignored ... Broken pipe".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a process killed by the broken pipe
    except MiniPagedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (TypeError, ValueError, OSError) as e:  # bad input caught before any RPC
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
