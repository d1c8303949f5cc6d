"""How the client reaches the service: the address forms it accepts and the channel options
(message limits from minipaged.constants, shared with both planes)."""
from __future__ import annotations

from minipaged.constants import DEFAULT_METADATA_PORT, grpc_options

CHANNEL_OPTIONS = grpc_options()
DEFAULT_PORT = DEFAULT_METADATA_PORT


def normalize_address(address: str) -> str:
    """"HOST" means HOST:50051 (the metadata service's default port); "HOST:PORT", "[v6]:PORT",
    "unix:..." and "dns:///..." targets pass through unchanged."""
    a = address.strip()
    if not a or a.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")) or "://" in a:
        return a
    if a.startswith("["):                       # [::1] or [::1]:50051
        return a if "]:" in a else f"{a}:{DEFAULT_PORT}"
    if a.count(":") == 0:
        return f"{a}:{DEFAULT_PORT}"
    if a.count(":") > 1:                        # a bare IPv6 address
        return f"[{a}]:{DEFAULT_PORT}"
    return a
