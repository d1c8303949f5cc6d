"""Bearer-token checks: a client token for the public API, a worker token for registration.

Health and reflection stay open so orchestrators can probe without secrets."""
from __future__ import annotations

import hmac

import grpc

_WORKER_METHODS = ("/minipaged.v1.MetadataService/RegisterWorker", "/minipaged.v1.MetadataService/Heartbeat")


def _deny(message: str):
    def handler(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    return grpc.unary_unary_rpc_method_handler(handler)


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, client_token: str | None, worker_token: str | None):
        self.client_token = client_token or None
        self.worker_token = worker_token or None

    def intercept_service(self, continuation, details):
        method = details.method
        if not method.startswith("/minipaged.v1."):
            return continuation(details)  # health, reflection
        expected = self.worker_token if method in _WORKER_METHODS else self.client_token
        if expected is None:
            return continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode(), f"Bearer {expected}".encode()):
            return continuation(details)
        who = "worker" if method in _WORKER_METHODS else "client"
        return _deny(f"missing or wrong {who} token: send 'authorization: Bearer <token>'")
