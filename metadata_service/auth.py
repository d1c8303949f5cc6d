"""Who may call what, and on which port.

Two surfaces. The client-facing one (Generate, jobs, Stats, PoolSnapshot) answers to the client
token. The internal one (RegisterWorker, Heartbeat, DeregisterWorker and the block API) answers to the worker token:
whoever can register a worker receives prompts' hidden states and chooses every token, so it must
never be open to the network. With `--worker-port` the internal surface gets a port of its own that
a deployment does not publish; each port then refuses the other surface's methods. Health and
reflection stay open on both so orchestrators can probe without secrets."""
from __future__ import annotations

import hmac
import ipaddress

import grpc

_SERVICE = "/minipaged.v1.MetadataService/"
INTERNAL_METHODS = frozenset(_SERVICE + m for m in (
    "RegisterWorker", "Heartbeat", "DeregisterWorker", "CreateSequence", "AppendTokens", "ForkSequence",
    "ReleaseSequence", "GetBlockTables"))


def _abort(code: grpc.StatusCode, message: str):
    def handler(request, context):
        context.abort(code, message)
    return grpc.unary_unary_rpc_method_handler(handler)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, client_token: str | None, worker_token: str | None):
        self.client_token = client_token or None
        self.worker_token = worker_token or None

    def intercept_service(self, continuation, details):
        method = details.method
        if not method.startswith("/minipaged.v1."):
            return continuation(details)  # health, reflection
        internal = method in INTERNAL_METHODS
        expected = self.worker_token if internal else self.client_token
        if expected is None:
            return continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {expected}".encode()):
            return continuation(details)
        who = "worker" if internal else "client"
        return _abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {who} token: send 'authorization: Bearer <token>'")


class SurfaceInterceptor(grpc.ServerInterceptor):
    """On a split deployment, each port serves only its own surface."""

    def __init__(self, surface: str, ports: dict):
        self.surface, self.ports = surface, ports  # ports: {"client": n, "internal": m}, filled once bound

    def intercept_service(self, continuation, details):
        method = details.method
        if method.startswith(_SERVICE) and (method in INTERNAL_METHODS) != (self.surface == "internal"):
            name = method.rsplit("/", 1)[1]
            other = "internal" if self.surface == "client" else "client"
            where = "the worker port (--worker-port)" if other == "internal" else "the client port (--port)"
            return _abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{name} is served on {where} {self.ports.get(other, '?')}, not on this one")
        return continuation(details)
