"""A request's body, read and parsed: size limit (413), JSON object, text, then the pydantic model
of the route, each failure an OpenAI error object that names what is wrong."""
from __future__ import annotations

import json

from fastapi import Request

from .errors import GatewayError, bad_request

MAX_BODY_BYTES = 16 << 20   # a body past this is a 413: parsing 24 MB of JSON took 30 s of CPU


async def raw_body(request: Request) -> bytes:
    """The body, once its media type is JSON (vLLM's validate_json_request: a form or text/plain
    POST, which a browser sends from any page without asking, is refused) and within the size
    limit, counted as it arrives: a chunked upload has no length to check first."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed "
                          f"(Content-Type: {media or 'none'})")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:        # before reading it
        raise GatewayError(413, f"the request body is {int(size)} bytes; this server takes at most "
                                f"{MAX_BODY_BYTES} ({MAX_BODY_BYTES >> 20} MiB)", "invalid_request_error")
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise GatewayError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes "
                                    f"({MAX_BODY_BYTES >> 20} MiB), the most this server takes",
                               "invalid_request_error")
        parts.append(chunk)
    return b"".join(parts)


def json_of(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:      # JSON may escape a lone UTF-16 surrogate ("\udc00"): valid JSON, not text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"the request body holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!r}), "
                          f"which is not text") from None
    return body


def parse_as(model, body: dict):
    try:
        return model.model_validate(body)
    except Exception as e:  # pydantic.ValidationError: name the first field that failed
        errors = getattr(e, "errors", lambda: [])()
        if errors:
            first = errors[0]
            loc = first.get("loc", ())
            where = ".".join(str(x) for x in loc)
            raise bad_request(f"{where}: {first.get('msg')}", str(loc[0]) if loc else None) from None
        raise bad_request(str(e)) from None
