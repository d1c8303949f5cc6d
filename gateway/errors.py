"""The one table from our gRPC status codes to HTTP statuses and OpenAI error objects.

Every error the gateway returns goes through `error_response`: a typed SDK error (the server's
status code and message, or a check the SDK made before any RPC) or a GatewayError the gateway
raised itself (a bad parameter, an unknown model, a wrong token)."""
from __future__ import annotations

import contextvars
import re

import grpc
from fastapi.responses import JSONResponse

from client.errors import MiniPagedError

S = grpc.StatusCode
# code -> (HTTP status, OpenAI error type, Retry-After seconds or None)
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, int | None]] = {
    S.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    S.OUT_OF_RANGE: (400, "invalid_request_error", None),
    S.UNAUTHENTICATED: (401, "authentication_error", None),   # (from upstream: 502, from_sdk_error)
    S.PERMISSION_DENIED: (403, "permission_error", None),
    S.NOT_FOUND: (404, "not_found_error", None),
    S.ALREADY_EXISTS: (409, "conflict_error", None),
    S.ABORTED: (409, "conflict_error", None),
    S.RESOURCE_EXHAUSTED: (429, "rate_limit_error", 1),       # the queue is full: retry shortly
    # a client that hangs up gets no answer at all (its own 499 is only counted): CANCELLED from
    # upstream means the service or the transport dropped the call, so retry
    S.CANCELLED: (503, "service_unavailable_error", 1),
    S.UNIMPLEMENTED: (501, "not_implemented_error", None),
    S.FAILED_PRECONDITION: (503, "service_unavailable_error", 5),  # the chain is (re)initialising
    S.UNAVAILABLE: (503, "service_unavailable_error", 5),     # no worker chain (yet)
    S.DEADLINE_EXCEEDED: (504, "timeout_error", None),
    S.INTERNAL: (500, "server_error", None),
    S.UNKNOWN: (500, "server_error", None),
    S.DATA_LOSS: (500, "server_error", None),
}
# RESOURCE_EXHAUSTED also says "this request needs more blocks than the whole pool holds": no
# retry can help, so that one is a 400 (the server's message says "could never run").
NEVER_FITS = "could never run"


class GatewayError(Exception):
    """An error the gateway itself detects; `param` names the offending request field."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", param)


# The service and SDK name fields as our GenerateRequest does; a gateway user sent OpenAI's names
# (beam_width is vLLM's `n` with use_beam_search; prompt_token_ids is a token-id `prompt`).
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "beam_width": "n",
                "prompt_token_ids": "prompt"}
# Request fields an error message can be about, most specific first: the first one named is `param`.
# The constraint kinds (regex, json_schema, choice) name the field the request gave them in.
PARAMS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "best_of", "n", "seed", "stop_token_ids",
          "stop", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_logprobs", "logprobs",
          "prompt", "messages", "regex", "json_schema", "schema", "choice")
_PARAM_RE = re.compile(r"\b(" + "|".join(PARAMS) + r")\b")
# The request being answered: its own name for a field the service's words name ("prompt" is
# "messages" in a chat request; "regex" is "guided_regex" or "structured_outputs.regex" ...)
REQUEST_PARAMS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("request_params", default={})


def openai_wording(message: str) -> tuple[str, str | None]:
    """(message with OpenAI's field names, the request field it is about or None)."""
    for ours, theirs in OPENAI_NAMES.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    # the SDK's way to 0 new tokens is prompt_logprobs; over HTTP it is echo (this server refuses
    # the prompt_logprobs field)
    message = message.replace("(0 only with prompt_logprobs)", "(0 only with echo, on /v1/completions)")
    message = message.replace("n must be in [1, 16] (0 = off)", "n must be in [1, 16] with use_beam_search")
    m = _PARAM_RE.search(message)
    param = m.group(1) if m else None
    return message, REQUEST_PARAMS.get().get(param, param) if param else None


def from_sdk_error(e: MiniPagedError) -> GatewayError:
    if e.code == S.UNAUTHENTICATED:
        # the gateway checks its clients' token itself: UNAUTHENTICATED from upstream is about the
        # gateway's own token, which no client can fix (a 401 would tell them their key is wrong)
        return GatewayError(502, "the metadata service refused this gateway's token (gateway --metadata-token, "
                                 f"or --token when that is unset): {e.details}", "server_error", code="bad_gateway")
    status, type_, retry = GRPC_TO_HTTP.get(e.code, (500, "server_error", None))
    if e.code == S.RESOURCE_EXHAUSTED and NEVER_FITS in e.details:
        status, type_, retry = 400, "invalid_request_error", None
    message, param = openai_wording(e.details or e.code.name)
    return GatewayError(status, message, type_, param if status == 400 else None, code=e.code.name.lower(),
                        retry_after=retry)


def as_gateway_error(e: Exception) -> GatewayError:
    if isinstance(e, GatewayError):
        return e
    if isinstance(e, MiniPagedError):
        return from_sdk_error(e)
    if isinstance(e, (TypeError, ValueError)):  # the SDK's own type checks, before any RPC
        return bad_request(*openai_wording(str(e)))
    return GatewayError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def error_response(e: Exception) -> JSONResponse:
    g = as_gateway_error(e)
    headers = {"Retry-After": str(g.retry_after)} if g.retry_after is not None else None
    return JSONResponse(g.body(), status_code=g.status, headers=headers)
