"""Typed exceptions for the SDK: every grpc.RpcError becomes one of these.

The server is the authority on what is wrong; we keep its status code and message untouched so a
caller can branch on the type (or `.code`) and show `.details` to a human."""
from __future__ import annotations

import grpc


class MiniPagedError(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    before_rpc = False      # True: the SDK's own check refused it before any call (the CLI exits 2)

    def __init__(self, details: str = "", code: grpc.StatusCode | None = None):
        if code is not None:
            self.code = code
        self.details = details or ""
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class InvalidArgument(MiniPagedError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(MiniPagedError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotFound(MiniPagedError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(MiniPagedError):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(MiniPagedError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(MiniPagedError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MiniPagedError):
    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(MiniPagedError):
    code = grpc.StatusCode.ALREADY_EXISTS


class DeadlineExceeded(MiniPagedError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(MiniPagedError):
    code = grpc.StatusCode.CANCELLED


class ClosedStub:
    """What a closed client calls instead of its stub: every RPC is refused with one clear error
    (gRPC's own were a ValueError or a UsageError about a "channel")."""

    def __init__(self, what: str):
        self.what = what

    def __getattr__(self, rpc: str):
        raise Cancelled(f"this {self.what} is closed (close() or the end of its `with` block): make a new one")


class Unimplemented(MiniPagedError):
    """The server does not serve this RPC: an older metadata service, or not the metadata service
    at all (a worker's port answers every MetadataService call with "Method not found")."""
    code = grpc.StatusCode.UNIMPLEMENTED


_BY_CODE: dict[grpc.StatusCode, type[MiniPagedError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ResourceExhausted, NotFound, Unavailable, FailedPrecondition,
                Unauthenticated, PermissionDenied, AlreadyExists, DeadlineExceeded, Cancelled, Unimplemented)
}


# gRPC's own words when the connection under a running call goes away (the server stopped past its
# grace, restarted, or died), which name nothing a caller can act on
CONNECTION_LOST = ("cancelling all calls", "socket closed", "connection reset", "goaway", "broken pipe",
                   "stream removed")


def error_for(code: grpc.StatusCode, details: str = "") -> MiniPagedError:
    """The typed exception for a status code; codes without a subclass get the base class."""
    if code == grpc.StatusCode.UNAVAILABLE and details.lower().startswith(CONNECTION_LOST):   # gRPC's own
        details = (f"the connection to the metadata service ended while this call was running (it stopped, "
                   f"restarted or died); retry it (gRPC said: {details})")
    cls = _BY_CODE.get(code)
    return cls(details) if cls is not None else MiniPagedError(details, code)


WORKER_SERVICE = "minipaged.v1.WorkerService"


NOT_GRPC = ("failed parsing http/2", "http1.x server", "expected settings frame")


def explain_not_grpc(err: MiniPagedError, address: str) -> MiniPagedError:
    """A server that answers in HTTP/1.1 (the gateway's port, a web server) fails gRPC's HTTP/2
    handshake with a parse error: name the likely mix-up instead."""
    if not isinstance(err, Unavailable) or not any(s in err.details.lower() for s in NOT_GRPC):
        return err
    return Unavailable(f"{address} answers HTTP/1.1, not gRPC: is it the gateway's HTTP port (try "
                       f"curl http://{address}/v1/models)? Point the client at the metadata service's address "
                       f"(python -m metadata_service --port, 50051 by default). Server said: {err.details}")


def explain_unimplemented(err: MiniPagedError, address: str, channel: grpc.Channel | None = None) -> MiniPagedError:
    """UNIMPLEMENTED "Method not found" means the server at `address` serves no MetadataService.
    Ask its health service whether it is one of our workers, and say so plainly (the common
    mistake: pointing the client at a worker's port). A server that is no gRPC server at all
    gets explain_not_grpc's hint."""
    err = explain_not_grpc(err, address)
    if not isinstance(err, Unimplemented) or "not found" not in err.details.lower():
        return err
    what = "does not serve minipaged.v1.MetadataService"
    if channel is not None:
        try:
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                      timeout=2.0)
            what = "is a MiniPaged worker (minipaged.v1.WorkerService), not the metadata service"
        except grpc.RpcError:
            pass
    return Unimplemented(f"{address} {what}: point the client at the metadata service's address "
                         f"(python -m metadata_service --port, 50051 by default). Server said: {err.details}")


def from_rpc_error(e: grpc.RpcError) -> MiniPagedError:
    """grpc.RpcError (sync) or grpc.aio.AioRpcError -> typed MiniPagedError."""
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = e.details() if callable(getattr(e, "details", None)) else None
    if code is None:  # an RpcError that is not a Call (rare): keep what we can
        return MiniPagedError(str(e))
    return error_for(code, details or "")


__all__ = ["MiniPagedError", "InvalidArgument", "ResourceExhausted", "NotFound", "Unavailable",
           "FailedPrecondition", "Unauthenticated", "PermissionDenied", "AlreadyExists", "DeadlineExceeded", "Cancelled", "Unimplemented",
           "error_for", "explain_not_grpc", "explain_unimplemented",
           "from_rpc_error"]
