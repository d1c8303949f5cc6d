"""Typed exceptions for the SDK: every grpc.RpcError becomes one of these.

The server is the authority on what is wrong; we keep its status code and message untouched so a
caller can branch on the type (or `.code`) and show `.details` to a human."""
from __future__ import annotations

import grpc


class MiniPagedError(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

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


_BY_CODE: dict[grpc.StatusCode, type[MiniPagedError]] = {
    cls.code: cls
    for cls in (InvalidArgument, ResourceExhausted, NotFound, Unavailable, FailedPrecondition,
                Unauthenticated, PermissionDenied, AlreadyExists, DeadlineExceeded, Cancelled)
}


def error_for(code: grpc.StatusCode, details: str = "") -> MiniPagedError:
    """The typed exception for a status code; codes without a subclass get the base class."""
    cls = _BY_CODE.get(code)
    return cls(details) if cls is not None else MiniPagedError(details, code)


def from_rpc_error(e: grpc.RpcError) -> MiniPagedError:
    """grpc.RpcError (sync) or grpc.aio.AioRpcError -> typed MiniPagedError."""
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = e.details() if callable(getattr(e, "details", None)) else None
    if code is None:  # an RpcError that is not a Call (rare): keep what we can
        return MiniPagedError(str(e))
    return error_for(code, details or "")


__all__ = ["MiniPagedError", "InvalidArgument", "ResourceExhausted", "NotFound", "Unavailable",
           "FailedPrecondition", "Unauthenticated", "PermissionDenied", "AlreadyExists", "DeadlineExceeded", "Cancelled", "error_for",
           "from_rpc_error"]
