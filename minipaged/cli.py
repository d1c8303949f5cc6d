"""What the four command-line programs share."""
from __future__ import annotations

import os
import sys


def prog_name(module: str) -> str:
    """argparse's `prog`: the console script's own name when started as one (`minipaged-worker`),
    else `python -m <module>`, so --help and usage errors name the command the user typed."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("minipaged") else f"python -m {module}"


def host_port_ok(address: str) -> bool:
    """HOST:PORT with a HOST and PORT in 1-65535 (what a peer can dial)."""
    host, _, port_text = address.rpartition(":")
    return bool(host) and port_text.isdigit() and 1 <= int(port_text) <= 65535


def port(text: str) -> int:
    """argparse type of a port flag: 0-65535 (gRPC would wrap 120686 to 55150 silently, and a
    socket bind raise OverflowError)."""
    return _port(text, 0, "a port is 0-65535")


def port_or_off(text: str) -> int:
    """A port flag whose -1 means "off" (--metrics-port, --worker-port)."""
    return _port(text, -1, "a port is 0-65535 (-1: off)")


def _port(text: str, lowest: int, rule: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{rule}, got {value}")
    return value


def token(parser, value: str | None, env: str, flag: str, path: str | None = None) -> str | None:
    """A token from the file `path` (its --*-token-file; the whitespace around it dropped), else
    its flag, else the environment variable `env`; None when none is set. Set but blank (a secret
    file that held only a newline) is a start error, not "no token", and so is a character that a
    gRPC or HTTP header cannot carry (a CR, a control character, non-ASCII), which would otherwise
    fail every call later with gRPC's "Invalid metadata"."""
    if path:
        try:
            with open(path) as f:
                return checked_token(parser, f.read().strip(), path)
        except OSError as e:
            parser.error(f"cannot read {path}: {e}")
    source = flag if value is not None else env
    value = value if value is not None else os.environ.get(env)
    if value is None:
        return None
    return checked_token(parser, value, source)


def checked_token(parser, value: str, source: str) -> str:
    if not value.strip():
        parser.error(f"{source} is set but blank: give the token, or unset it to run without one")
    bad = next((c for c in value if not " " <= c <= "~"), None)
    if bad is not None:
        parser.error(f"{source} holds {bad!r}, which a gRPC / HTTP header cannot carry: a token is printable "
                     f"ASCII (a secret file with CRLF line ends? its CR stays in the value)")
    return value
