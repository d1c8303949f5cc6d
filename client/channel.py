"""How the client reaches the service: the address forms it accepts and the channel options
(message limits from minipaged.constants, shared with both planes)."""
from __future__ import annotations

import numbers

from minipaged.cli import host_port_ok
from minipaged.constants import DEFAULT_METADATA_PORT, grpc_options

CHANNEL_OPTIONS = grpc_options()
DEFAULT_PORT = DEFAULT_METADATA_PORT


def normalize_address(address: str) -> str:
    """"HOST" means HOST:50051 (the metadata service's default port); "HOST:PORT", "[v6]:PORT",
    "unix:..." and "dns:///..." targets pass through unchanged."""
    a = address.strip()
    if not a:
        raise ValueError("the address is empty: give HOST or HOST:PORT")
    if a.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")) or "://" in a:
        return a
    if a.startswith("["):                       # [::1] or [::1]:50051
        return _checked_port(a) if "]:" in a else f"{a}:{DEFAULT_PORT}"
    if a.count(":") == 0:
        return f"{a}:{DEFAULT_PORT}"
    if a.count(":") > 1:                        # a bare IPv6 address
        return f"[{a}]:{DEFAULT_PORT}"
    return _checked_port(a)


def _checked_port(address: str) -> str:
    """HOST:PORT with PORT in 1-65535: gRPC takes 120636 as 55100 and -1 as 65535, silently."""
    if not host_port_ok(address):
        raise ValueError(f"address {address!r}: the port must be a number in 1-65535")
    return address


NO_DEADLINE_S = 1e8   # a timeout this long (~3 years) or inf means none: gRPC's deadline overflows past ~8e9


def checked_seconds(name: str, value):
    """A timeout / wait in seconds: None, or a number >= 0, inf meaning no limit (a str or a negative
    one failed later inside gRPC with words that named neither)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds or None, got {type(value).__name__} {value!r:.40}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value}")
    return value


def grpc_seconds(value: float | None) -> float | None:
    """A timeout as gRPC takes it: None for none (inf or >= NO_DEADLINE_S, which gRPC turned into a
    deadline already past)."""
    return None if value is None or value >= NO_DEADLINE_S else value


def checked_token(token: str | None) -> str | None:
    """The bearer token goes in an HTTP/2 header: printable ASCII only."""
    if token is None or token == "":
        return token
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    if not all(" " <= ch <= "~" for ch in token):
        raise ValueError("token must be printable ASCII (it travels in a header): it holds a control or "
                         "non-ASCII character")
    return token

