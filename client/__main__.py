"""`python -m client generate|submit|watch|stats|jobs|job|cancel|delete` (also `minipaged ...`):
the SDK from a shell; `serve MODEL` runs the whole local stack in the foreground (client/serve.py).

Results print as JSON lines (one per request) so they pipe into jq; errors print "error: CODE:
message" on stderr and exit 1 (2 for bad input caught before any RPC, 130 on Ctrl-C). The flags are
in client/cli_args.py."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time

from .cli_args import build_parser
from .errors import MiniPagedError
from .sdk import Client


def _generate_kwargs(a) -> dict:
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
              seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos,
              logprobs=a.logprobs, n=a.n, best_of=a.best_of, min_new_tokens=a.min_new_tokens,
              repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
              frequency_penalty=a.frequency_penalty, min_p=a.min_p)
    if a.beam_width:
        kw.update(beam_width=a.beam_width, n=None if a.n == 1 else a.n, length_penalty=a.length_penalty,
                  early_stopping={"false": False, "true": True}.get(a.early_stopping, a.early_stopping))
    if a.prompt_ids is not None:
        kw["prompt_token_ids"] = a.prompt_ids
    return kw


def _read_requests(path: str) -> tuple[list[dict], list[int]]:
    """The JSONL file's requests and the line each came from (blank lines skipped; a UTF-8 byte
    order mark, as Windows editors write, is not part of line 1)."""
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    try:
        lines = [(n, line.lstrip("\ufeff") if n == 1 else line) for n, line in enumerate(f, 1) if line.strip()]
    finally:
        if f is not sys.stdin:
            f.close()
    out = []
    for n, line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    return out, [n for n, _ in lines]


def _submit(client: Client, path: str) -> str:
    """submit --file: an item's error names its file line, not only its index."""
    items, line_of = _read_requests(path)
    try:
        return client.submit(items)
    except (MiniPagedError, TypeError, ValueError) as e:
        text = e.details if isinstance(e, MiniPagedError) else str(e)
        m = re.match(r"(?:submit item|request) (\d+):", text)
        if m and int(m.group(1)) < len(line_of):
            where = f"{path}:{line_of[int(m.group(1))]}: "
            if isinstance(e, MiniPagedError):
                e.details = where + text
                raise e from None
            raise type(e)(where + text) from None
        raise


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
    if len(prompts) > 1:  # a batch: results in order, as JSON lines or one text per choice
        if a.stream:
            raise ValueError("--stream takes one --prompt (a batch prints each result whole)")
        results = client.generate(prompts, **kw)
        for r in results:
            if a.json:
                print(json.dumps(r.as_dict()), flush=True)
            else:
                for c in r.choices or [r]:
                    print(c.text, flush=True)
        return
    if prompts:
        kw["prompt"] = prompts[0]
    if a.stream:
        try:
            last = None
            for last in client.stream(**kw):
                if a.json:  # one JSON line per chunk: every field, for jq
                    print(json.dumps(dataclasses.asdict(last)), flush=True)
                elif a.n > 1 or (a.beam_width or 0) > 1:   # several choices: one JSON line per chunk
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
    client = Client(a.address, token=a.token, timeout=a.timeout, wait_ready=a.wait_ready, tls_ca=a.tls_ca,
                    tls_cert=a.tls_cert, tls_key=a.tls_key)
    try:
        if a.command == "generate":
            _generate(client, a)
        elif a.command == "submit":
            job_id = _submit(client, a.file)
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
        return 2 if e.before_rpc else 1
    except (TypeError, ValueError, OSError) as e:  # bad input caught before any RPC
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
