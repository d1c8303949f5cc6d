"""Server-side request decoding that answers INVALID_ARGUMENT instead of INTERNAL.

grpcio turns any deserializer failure (for instance invalid UTF-8 in a `string` field, which the
Python protobuf runtime rejects) into INTERNAL before a handler runs. This interceptor decodes the
request itself and, when that fails, lets the handler answer with a clear INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer):
    def decode(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return _Undecodable(e)
    return decode


def _guard(behavior, method: str):
    def handler(request, context):
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method}: the request does not decode ({request.error}); string fields must be "
                          f"valid UTF-8 and the bytes a serialized message of the method's type")
        return behavior(request, context)
    return handler


class DecodeGuardInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, details):
        h = continuation(details)
        if h is None or h.request_streaming or h.request_deserializer is None:
            return h
        method = details.method.rsplit("/", 1)[-1]
        if h.unary_unary is not None:
            return h._replace(request_deserializer=_safe(h.request_deserializer),
                              unary_unary=_guard(h.unary_unary, method))
        if h.unary_stream is not None:
            return h._replace(request_deserializer=_safe(h.request_deserializer),
                              unary_stream=_guard(h.unary_stream, method))
        return h
