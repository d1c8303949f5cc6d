"""The CLI's flags (`python -m client ...`, `minipaged ...`): one parser, a subcommand each. The
flags, their defaults and their help are the CLI's contract (README, docs/architecture.md section 2)."""
from __future__ import annotations

import argparse
import os

from minipaged.cli import prog_name

from .channel import DEFAULT_PORT


def _ids(text: str) -> list[int]:
    """'1,2,3' (a trailing comma is fine); an empty item ('1,,2') is a typo, not nothing."""
    items = text.replace(" ", "").split(",")
    if items and items[-1] == "":
        items.pop()
    try:
        return [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


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
    common = _common_flags()
    ap = argparse.ArgumentParser(prog=prog_name("client"), description="MiniPaged-Qwen client",
                                 formatter_class=_Formatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, help_):
        return sub.add_parser(name, parents=[common], help=help_, description=help_, formatter_class=_Formatter)

    _add_generate(add("generate", "one request (or one per --prompt); prints the text, or JSON lines with --json"))
    _add_job_commands(add)
    st = add("stats", "pool, fragmentation, queue, invariants")
    st.add_argument("--json", action="store_true", help="print every field as JSON")

    from .serve import add_arguments as serve_arguments
    what = "serve MODEL over the OpenAI API: metadata service, workers and gateway in the foreground"
    serve_arguments(sub.add_parser("serve", help=what, description=what, formatter_class=_Formatter))
    return ap


def _common_flags() -> argparse.ArgumentParser:
    """Where the service is and how to call it: every subcommand but serve takes these."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=os.environ.get("MINIPAGED_ADDRESS") or f"127.0.0.1:{DEFAULT_PORT}",
                        help=f"metadata service HOST:PORT; HOST alone means port {DEFAULT_PORT} "
                             f"(env MINIPAGED_ADDRESS)")
    common.add_argument("--token", default=os.environ.get("MINIPAGED_TOKEN"),
                        help="bearer token (env MINIPAGED_TOKEN)")
    common.add_argument("--tls-ca", default=os.environ.get("MINIPAGED_TLS_CA"),
                        help="CA of the service's certificate: talk TLS to it (env MINIPAGED_TLS_CA)")
    common.add_argument("--tls-cert", default=os.environ.get("MINIPAGED_TLS_CERT"),
                        help="client certificate, for a service that asks for one (mTLS; env MINIPAGED_TLS_CERT)")
    common.add_argument("--tls-key", default=os.environ.get("MINIPAGED_TLS_KEY"),
                        help="key of --tls-cert (env MINIPAGED_TLS_KEY)")
    common.add_argument("--timeout", type=_seconds, default=None, help="deadline per call, seconds (default: none)")
    common.add_argument("--wait-ready", type=float, default=None, metavar="S",
                        help="wait up to S seconds for a ready worker chain before failing")
    return common


def _add_generate(g: argparse.ArgumentParser) -> None:
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
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with probability >= this x the most likely one's (vLLM's min_p); 0 = off")
    g.add_argument("--beam-width", type=int, default=0, help="beam search with K beams (K choices, best first)")
    g.add_argument("--length-penalty", type=float, default=None, help="beam search: score = logprob / len ** this")
    g.add_argument("--early-stopping", choices=("false", "true", "never"), default="false", help="beam search")
    g.add_argument("--logprobs", type=int, nargs="?", const=0, default=None, metavar="K",
                   help="return per-token logprobs, and the K best alternatives per token")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true",
                   help="print the whole result as JSON (with --stream: one JSON line per chunk)")


def _add_job_commands(add) -> None:
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
