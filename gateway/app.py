"""The gateway's ASGI app (FastAPI): OpenAI-compatible routes, /health, /metrics and the dashboard.

It holds no state of its own beyond a gRPC channel to the metadata service (an AsyncClient of our
SDK): every request becomes one Generate stream per prompt (n > 1 travels in the request, the
service forks the prompt's blocks), and leaving a stream early (a client that disconnects, a
cancelled task) cancels the RPC, so the service frees the sequence's blocks at the next step.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics, GET / (dashboard) and GET /dashboard/state (its JSON). What the routes share is in
gateway/state.py (Gateway), the streamed responses in gateway/sse.py."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.aio import AsyncClient
from client.errors import MiniPagedError

from . import openai_api as oa
from . import reasoning as rs
from . import tool_calls as tc
from .chat_output import OutputOptions
from .dashboard import dashboard_routes
from .errors import REQUEST_PARAMS, GatewayError, bad_request, error_response
from .metrics import GatewayMetrics
from .request_body import json_of, parse_as, raw_body
from .sse import _chat_events, _collect, _completion_events, _start_sse, _unless_disconnected
from .state import DEFAULT_CHAT_MAX_TOKENS, MODEL_REFRESH_S, Gateway, GatewayConfig
from .utility_routes import utility_routes

log = logging.getLogger("gateway")


# ---------------------------------------------------------------- the app

def create_app(config: GatewayConfig) -> FastAPI:
    gw = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.client = AsyncClient(config.metadata, token=config.metadata_token or config.token,
                                tls_ca=config.tls_ca, tls_cert=config.tls_cert, tls_key=config.tls_key)
        try:
            await gw.stats()
        except MiniPagedError as e:
            log.warning("metadata service at %s not answering yet: %s", config.metadata, e)
        log.info("gateway for %s: model %s, chat template: %s", config.metadata, gw.model_name, gw.template.source)
        refresher = asyncio.ensure_future(gw.refresh_forever(MODEL_REFRESH_S))
        yield
        refresher.cancel()
        await gw.client.close()

    app = FastAPI(title="MiniPaged-Qwen gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gateway = gw
    _error_handlers(app)

    def authorize(request: Request) -> None:
        if config.token and request.headers.get("authorization", "") != f"Bearer {config.token}":
            raise GatewayError(401, "missing or wrong API key: send 'Authorization: Bearer <token>'",
                               "authentication_error", code="invalid_api_key")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = await _model_card(gw)
        return {"object": "list", "data": [_named_card(card, name) for name in gw.served_names or [card["id"]]]}

    @app.get("/v1/models/{model_id:path}")  # openai's models.retrieve(); a checkpoint path holds slashes
    async def model(model_id: str, request: Request):
        authorize(request)
        if not model_id:                     # /v1/models/: the list, as vLLM's redirect gives it
            return await models(request)
        gw.check_model(model_id)
        card = await _model_card(gw)
        return _named_card(card, model_id) if model_id in gw.served_names else card

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        return await _completions(gw, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        return await _chat_completions(gw, request)

    @app.get("/health")
    async def health():
        return await _health(gw)

    @app.get("/metrics")
    async def metrics():
        return await _metrics(gw)

    utility_routes(app, gw, authorize)
    dashboard_routes(app, gw)
    return _CountRequests(app, gw.metrics)


def _error_handlers(app: FastAPI) -> None:
    async def as_error(request: Request, e):
        return error_response(e)

    async def validation(request: Request, e: RequestValidationError):
        return error_response(bad_request(str(e)))

    async def http(request: Request, e: StarletteHTTPException):
        return error_response(GatewayError(e.status_code, str(e.detail), "invalid_request_error"))

    app.add_exception_handler(GatewayError, as_error)
    app.add_exception_handler(MiniPagedError, as_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(Exception, as_error)   # a bug: still an OpenAI error object (500), logged


# ---------------------------------------------------------------- OpenAI API

async def _model_card(gw: Gateway) -> dict:
    if gw.last_stats is None or not gw.last_stats.model:  # max_model_len is the service's: ask once
        try:
            await gw.stats()
        except MiniPagedError:
            pass
    if not gw.known_model_name:
        raise GatewayError(503, "the served model is not known yet: the metadata service has not answered "
                                "(see /health)", "service_unavailable_error", code="unavailable", retry_after=5)
    card = {"id": gw.model_name, "object": "model", "created": gw.started, "owned_by": "minipaged",
            "root": gw.config.model or gw.model_name, "parent": None,
            "permission": [{"id": f"modelperm-{gw.model_name}", "object": "model_permission", "created": gw.started,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}
    if gw.max_model_len:
        card["max_model_len"] = gw.max_model_len
    return card


def _named_card(card: dict, name: str) -> dict:
    """The card under another of --served-model-name's names (vLLM lists one card per name)."""
    perm = dict(card["permission"][0], id=f"modelperm-{name}")
    return dict(card, id=name, permission=[perm])


async def _accept(gw: Gateway, request: Request, model):
    """(arrival time, the parsed request) once its model is the served one."""
    t0 = time.monotonic()
    raw = await raw_body(request)
    if len(raw) > 1 << 20:    # a large body is parsed off the event loop: /health and streams go on
        req = await asyncio.to_thread(lambda: parse_as(model, json_of(raw)))
    else:
        req = parse_as(model, json_of(raw))
    await gw.require_model()  # first: without --model, the name to accept comes from the service
    gw.check_model(req.model)
    return t0, req


async def _completions(gw: Gateway, request: Request):
    t0, req = await _accept(gw, request, oa.CompletionRequest)
    kw = oa.completion_kwargs(req, gw.sampling_defaults)
    prompts = oa.completion_prompts(req)
    limit = gw.last_stats.max_waiting if gw.last_stats is not None else 0
    if limit and len(prompts) > limit:  # each prompt is a request: more than the queue holds never fit
        raise bad_request(f"{len(prompts)} prompts in one request; the service admits at most {limit} at a time "
                          f"(its --max-waiting): send them in parts", "prompt")
    echo = prompt_ids = None
    if req.echo:
        echo = [p.get("prompt") if "prompt" in p else _decode_or_fail(gw, p["prompt_token_ids"]) for p in prompts]
    if "prompt_logprobs" in kw:   # the service scores token ids the gateway knows, to name them
        prompt_ids = [p["prompt_token_ids"] if "prompt_token_ids" in p else _encode_or_fail(gw, p["prompt"])
                      for p in prompts]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    items = [{**kw, **p} for p in prompts]
    if req.max_tokens is None:    # OpenAI's default 16, within the context as vLLM keeps it
        for item in items:
            item["max_new_tokens"] = _within_context(gw, item["max_new_tokens"], gw.prompt_len(item))
    if req.logprobs is None:      # echo with max_tokens 0 asked the prompt's logprobs only to run
        prompt_ids = None         # (the service wants them for no token): none are shown, as vLLM's
    rid = oa.new_id("cmpl", request)
    stream = gw.generate_stream(items, req.n, t0, whole=not req.stream)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _start_sse(request, stream, _completion_events(gw, rid, req, stream, echo, include_usage,
                                                                      len(prompts), prompt_ids))
    choices = await _unless_disconnected(request, _collect(stream))
    per_prompt = [[c for c in choices.values() if c.index // req.n == p] for p in range(len(prompts))]
    return oa.completion_response(rid, gw.model_name, [choices[i] for i in sorted(choices)], per_prompt,
                                  gw.token_text_for(req), echo, req.n, prompt_ids)


async def _chat_completions(gw: Gateway, request: Request):
    t0, req = await _accept(gw, request, oa.ChatCompletionRequest)
    REQUEST_PARAMS.set({"prompt": "messages"})   # the service's "prompt" is this request's messages
    tools = tc.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages, prompt = gw.render_chat(req)
    kw = oa.chat_kwargs(req, _default_max_tokens(gw, prompt, req.use_beam_search), gw.sampling_defaults)
    kw.update(_forced_tool_kwargs(tools, kw))
    output = OutputOptions(reasoning=gw.config.reasoning_parser == "qwen3" and gw.template.thinks,
                           reasoning_open=rs.prompt_opens_reasoning(prompt), tools=tools,
                           include_reasoning=req.include_reasoning, think_ids=gw.think_ids,
                           role="assistant" if req.add_generation_prompt else messages[-1]["role"])
    if output.reasoning and not req.include_reasoning:
        kw.pop("logprobs", None)      # vLLM's rule: hidden reasoning must not leak through the logprobs
    kw.update(_grammar_after_reasoning(gw, output, tools, kw))
    rid = oa.new_id("chatcmpl", request)
    stream = gw.generate_stream([{**kw, "prompt": prompt}], req.n, t0, whole=not req.stream)
    echo = _chat_echo(req, messages)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _start_sse(request, stream, _chat_events(gw, rid, req, stream, include_usage, output, echo))
    choices = await _unless_disconnected(request, _collect(stream))
    out = oa.chat_response(rid, gw.model_name, [choices[i] for i in sorted(choices)], gw.token_text_for(req), output)
    if echo is not None:
        for ch in out["choices"]:
            ch["message"]["content"] = echo + (ch["message"]["content"] or "")
    return out


def _chat_echo(req: oa.ChatCompletionRequest, messages: list[dict]) -> str | None:
    """vLLM's chat `echo`: the last message's content goes before the answer when that message has
    the answer's role (continuing an assistant message), else nothing; None without echo."""
    if not req.echo:
        return None
    role = "assistant" if req.add_generation_prompt else messages[-1]["role"]
    return messages[-1]["content"] or "" if messages[-1]["role"] == role else ""


# ---------------------------------------------------------------- operations

async def _health(gw: Gateway):
    try:
        st = await gw.stats()
    except MiniPagedError as e:
        return JSONResponse({"status": "unavailable", "ready": False, "reason": str(e)}, status_code=503)
    if gw.mismatch:
        return JSONResponse({"status": "model mismatch", "ready": False, "reason": gw.mismatch}, status_code=503)
    if not st.ready:
        return JSONResponse({"status": "not ready", "ready": False,
                             "reason": st.not_ready_reason or "no worker chain is ready"}, status_code=503)
    return {"status": "ok", "ready": True, "model": gw.model_name}


async def _metrics(gw: Gateway):
    try:
        gw.metrics.stats.update(await gw.stats())
    except MiniPagedError as e:
        gw.metrics.stats.update(None, str(e))
    return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _decode_or_fail(gw: Gateway, ids: list[int]) -> str:
    if gw.tokenizer is None:
        raise bad_request("echo of a token-id prompt needs the model's tokenizer on the gateway (--model PATH)",
                          "echo")
    return gw.tokenizer.decode(ids, skip_special_tokens=False)   # as vLLM echoes token ids: specials named


def _forced_tool_kwargs(tools: tc.ToolPlan, kw: dict) -> dict:
    """tool_choice "required" or a named function: the SDK's JSON-schema constraint forces a call."""
    try:
        schema = tc.forced_schema(tools)
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    if schema is None:
        return {}
    if any(kw.get(k) not in (None, False) for k in ("json_schema", "regex", "choice", "json_object")):
        raise bad_request(f"tool_choice {tools.mode!r} constrains the output to a tool call: it cannot be "
                          f"combined with response_format or another structured output", "tool_choice")
    # the service's words for a schema that does not compile name json_schema: here it is a tool's
    REQUEST_PARAMS.set({**REQUEST_PARAMS.get(), "json_schema": "tools", "schema": "tools"})
    return {"json_schema": schema}


def _grammar_after_reasoning(gw: Gateway, output: OutputOptions, tools: tc.ToolPlan, kw: dict) -> dict:
    """A template that opened <think> (Qwen3 Thinking-2507's): the model reasons first, so a
    structured output constrains what follows its </think>, as vLLM applies a grammar once the
    reasoning has ended; from the first token, the whole answer would be read as reasoning. A
    forced tool call stays constrained from the start (its output is parsed as calls, not split)."""
    end_id = gw.think_ids[1]
    constrained = any(kw.get(k) not in (None, False) for k in ("json_schema", "regex", "choice", "json_object"))
    if not (output.reasoning and output.reasoning_open and constrained and end_id is not None) \
            or tools.mode in ("named", "required"):
        return {}
    return {"grammar_after_token_id": end_id}


def _encode_or_fail(gw: Gateway, text: str) -> list[int]:
    if gw.tokenizer is None:
        raise bad_request("echo with logprobs of a text prompt needs the model's tokenizer on the gateway "
                          "(--model PATH)", "echo")
    ids = list(gw.tokenizer.encode(text))
    if not ids:
        raise bad_request("the prompt is empty: it has no token", "prompt")
    return ids


def _default_max_tokens(gw: Gateway, prompt: str, beams: bool = False) -> int:
    """Chat requests without max_tokens: --default-max-tokens when given, else generation_config.json's
    max_new_tokens where the server's defaults have it (not for beam search), else 256; within the
    model's context when the gateway can read the model (it then knows the prompt's length too)."""
    limit = gw.config.default_max_tokens
    if limit is None:
        limit = DEFAULT_CHAT_MAX_TOKENS if beams else gw.sampling_defaults.get("max_tokens", DEFAULT_CHAT_MAX_TOKENS)
    return _within_context(gw, limit, gw.prompt_len({"prompt": prompt}))


def _within_context(gw: Gateway, limit: int, prompt_len: int | None) -> int:
    """A default max_tokens cut to what the model's context leaves after the prompt (at least 1, so
    that a prompt filling the context gets the service's clear error)."""
    if gw.max_model_len and prompt_len is not None:
        return min(limit, max(1, gw.max_model_len - prompt_len))
    return limit


class _CountRequests:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects):
    counts HTTP requests by route and status for /metrics."""

    ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/",
              "/dashboard/state", "/tokenize", "/detokenize", "/version", "/ping")

    def __init__(self, app: FastAPI, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics
        self.state = app.state  # tests reach the Gateway through app.state.gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counting_send)
