"""The gateway's ASGI app (FastAPI): OpenAI-compatible routes, /health, /metrics and the dashboard.

It holds no state of its own beyond a gRPC channel to the metadata service (an AsyncClient of our
SDK): every request becomes one Generate stream per prompt (n > 1 travels in the request, the
service forks the prompt's blocks), and leaving a stream early (a client that disconnects, a
cancelled task) cancels the RPC, so the service frees the sequence's blocks at the next step.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics, GET / (dashboard) and GET /dashboard/state (its JSON)."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.aio import AsyncClient
from client.errors import MiniPagedError
from client.messages import Stats, StreamChunk

from . import model_identity as identity
from . import openai_api as oa
from . import reasoning as rs
from . import tool_calls as tc
from .chat_output import OutputOptions
from .chat_output import merge as merge_deltas
from .chat_template import ChatTemplate
from .dashboard import dashboard_routes
from .errors import GatewayError, bad_request, error_response
from .metrics import GatewayMetrics
from .token_bytes import TokenStrings

log = logging.getLogger("gateway")
DEFAULT_CHAT_MAX_TOKENS = 256
MODEL_REFRESH_S = 5.0  # Stats poll that keeps the served model's identity and context current


@dataclass
class GatewayConfig:
    metadata: str                         # HOST:PORT of the metadata service
    token: str | None = None              # HTTP clients must send "Authorization: Bearer <token>"
    metadata_token: str | None = None     # presented to the metadata service (default: token)
    model: str | None = None              # what the workers load (tiny or a checkpoint path)
    served_model_name: str | None = None  # the name in /v1/models (default: model)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS  # chat requests without max_tokens
    reasoning_parser: str = rs.DEFAULT_PARSER  # "qwen3": <think> split out where the template thinks
    snapshot_max_blocks: int = 4096       # dashboard: blocks per chain before sampling with a stride
    rpc_timeout: float = 5.0              # Stats / PoolSnapshot calls


def _reported_model(stats: Stats | None) -> str:
    """The model the service reports, once the proto carries it (see docs/gateway.md)."""
    return (getattr(stats, "model", "") or getattr(stats, "model_name", "")) if stats is not None else ""


class Gateway:
    """What the routes share: the SDK client, the template, the tokenizer for token strings and
    the metrics. Created in the app's lifespan (grpc.aio binds to the running loop)."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client: AsyncClient | None = None
        self.template = ChatTemplate(config.model)
        self.tokenizer = self._load_tokenizer(config.model)
        self.metrics = GatewayMetrics(lambda: self.model_name)
        self.started = int(time.time())
        self.last_stats: Stats | None = None
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.ttft_sum, self.ttft_count = 0.0, 0  # for the dashboard's TTFT plot
        self.local_config = self._local_config(config.model)
        self.max_model_len = self.local_config.max_position_embeddings if self.local_config else None
        self.mismatch: str | None = None      # why --model is not the served model (requests get 503)
        self._adopted = ""                    # without --model: the served model taken from the service
        self._warned: set[str] = set()

    # ------------------------------------------------------------ model identity

    @staticmethod
    def _load_tokenizer(model: str | None):
        if not model or (model != "tiny" and not os.path.isdir(model)):
            return None  # not readable here: token strings fall back to "token_id:N"
        from minipaged.tokenizer import load_tokenizer
        try:
            return load_tokenizer(model)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer must not stop the gateway
            log.warning("cannot load the tokenizer of %s (%s): logprob tokens shown as token ids", model, e)
            return None

    @staticmethod
    def _local_config(model: str | None):
        try:
            return identity.check_model_arg(model)
        except (ValueError, OSError):  # python -m gateway refuses these at start (gateway/__main__.py)
            return None

    @property
    def model_name(self) -> str:
        c = self.config
        return c.served_model_name or c.model or _reported_model(self.last_stats) or "minipaged"

    def accepts_model(self, name: str | None) -> bool:
        if not name:
            return True
        known = {self.model_name, self.config.model or "", _reported_model(self.last_stats)}
        known |= {os.path.basename(os.path.normpath(k)) for k in known if k}
        return name in known - {""}

    def check_model(self, name: str | None) -> None:
        if not self.accepts_model(name):
            raise GatewayError(404, f"The model `{name}` does not exist. This gateway serves "
                                    f"`{self.model_name}` (GET /v1/models).", "invalid_request_error",
                               "model", "model_not_found")

    def token_text_for(self, req) -> TokenStrings:
        return TokenStrings(_token_id_text if req.return_tokens_as_token_ids else self.token_text, self.tokenizer)

    def _token_text(self, token_id: int) -> str:
        """A token as text for logprobs (vLLM writes "token_id:N" where it has no tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------ service calls

    async def stats(self) -> Stats:
        st = await self.client.stats(timeout=self.config.rpc_timeout)
        self.last_stats = st
        await self._observe_model(st)
        return st

    async def _observe_model(self, st: Stats) -> None:
        """The served model, as Stats reports it: checked against --model, or adopted without one
        (gateway/model_identity.py). max_model_len is the service's, the limit it enforces."""
        if st.max_model_len:
            self.max_model_len = st.max_model_len
        model = self.config.model
        if model:
            why = identity.mismatch(model, self.local_config, st)
            if why and why != self.mismatch:
                log.error("%s", why)
            elif self.mismatch and not why:
                log.info("gateway --model %s matches the served model again", model)
            self.mismatch = why
            warn = None if why else identity.path_warning(model, st)
            if warn and warn not in self._warned:
                self._warned.add(warn)
                log.warning("%s", warn)
        elif st.model and st.model != self._adopted:
            self._adopted = st.model
            if not identity.readable_checkpoint(st.model):
                log.warning("the workers' model %s is not readable here: chat uses the %s template and logprob "
                            "tokens are shown as ids (mount it, or pass --model)", st.model, self.template.source)
                return
            loaded = await asyncio.to_thread(lambda: (ChatTemplate(st.model), self._load_tokenizer(st.model)))
            self.template, self.tokenizer = loaded
            self.token_text.cache_clear()
            log.info("model taken from the service: %s (max_model_len %d, chat template: %s)", st.model,
                     st.max_model_len, self.template.source)

    async def require_model(self) -> None:
        """Before a generation request: refuse one for a model the workers do not serve."""
        if self.last_stats is None or not self.last_stats.model:   # not known yet: ask once
            try:
                await self.stats()
            except MiniPagedError:
                return  # the request itself reports the service's state
        if self.mismatch:
            raise GatewayError(503, self.mismatch, "service_unavailable_error", "model", "model_mismatch")

    async def refresh_forever(self, interval_s: float) -> None:
        """Keep the served model's identity current (workers can be restarted with another model)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.stats()
            except MiniPagedError:
                pass

    async def generate_stream(self, items: list[dict], n: int, t0: float,
                              whole: bool = False) -> AsyncIterator[tuple[int, StreamChunk]]:
        """Every prompt's Generate stream at once, merged: (OpenAI choice index, chunk). Leaving the
        iterator early cancels every stream (each cancelled RPC frees its sequence's blocks).
        `whole` (a non-streaming HTTP request): one chunk per choice, at its end."""
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(p: int, kw: dict) -> None:
            obs = _Observed(self, t0)
            agen = None
            try:  # (a failure to even start the stream must reach the consumer too, or it waits forever)
                agen = self.client.chunks(whole=whole, **kw)  # best_of > n (refused when streaming): winners at the end
                async for chunk in agen:
                    obs.chunk(chunk)
                    await queue.put((p * n + chunk.index, chunk))
                obs.finish()
                await queue.put((p, end))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((p, e))
            finally:
                if agen is not None:
                    await agen.aclose()  # a stream left at a yield: cancel its RPC now, not at GC

        tasks = [asyncio.ensure_future(pump(p, kw)) for p, kw in enumerate(items)]
        try:
            left = len(tasks)
            while left:
                idx, item = await queue.get()
                if item is end:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield idx, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


class _Observed:
    """Per prompt: TTFT, inter-token latency, e2e latency, tokens and finish reasons."""

    def __init__(self, gw: Gateway, t0: float):
        self.gw, self.m, self.model, self.t0 = gw, gw.metrics, gw.model_name, t0
        self.first: float | None = None
        self.last: dict[int, float] = {}
        self.prompt_tokens = 0
        self.generated = 0
        self.finished: list[str] = []

    def chunk(self, c: StreamChunk) -> None:
        now = time.monotonic()
        if c.decode_seconds and len(c.token_ids) > 1:   # a whole choice: the service timed its tokens
            self._whole(c, now)
        elif c.token_ids:
            if self.first is None:
                self.first = now
                self.m.ttft.labels(self.model).observe(now - self.t0)
                self.gw.ttft_sum += now - self.t0
                self.gw.ttft_count += 1
            elif c.index in self.last:
                self.m.itl.labels(self.model).observe((now - self.last[c.index]) / len(c.token_ids))
            self.last[c.index] = now
            self.generated += len(c.token_ids)
        if c.usage is not None:
            self.prompt_tokens = c.usage.prompt_tokens
        if c.finish_reason:
            self.finished.append(c.finish_reason)

    def _whole(self, c: StreamChunk, now: float) -> None:
        first = now - c.decode_seconds
        if self.first is None:
            self.first = first
            self.m.ttft.labels(self.model).observe(first - self.t0)
            self.gw.ttft_sum += first - self.t0
            self.gw.ttft_count += 1
        itl = self.m.itl.labels(self.model)
        for _ in range(len(c.token_ids) - 1):        # the mean gap, once per token (as a stream counts)
            itl.observe(c.decode_seconds / (len(c.token_ids) - 1))
        self.last[c.index] = now
        self.generated += len(c.token_ids)

    def finish(self) -> None:
        self.m.e2e.labels(self.model).observe(time.monotonic() - self.t0)
        self.m.prompt_tokens.labels(self.model).inc(self.prompt_tokens)
        self.m.generation_tokens.labels(self.model).inc(self.generated)
        for reason in self.finished:
            self.m.request_success.labels(self.model, reason).inc()


# ---------------------------------------------------------------- helpers

def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events. When the client goes away, Starlette cancels the response; closing the
    body generator here (not at garbage collection) cancels the Generate RPCs right away."""

    media_type = "text/event-stream"

    def __init__(self, content, **kw):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, aw):
    """Await `aw` (a coroutine or async-generator step) unless the client disconnects first; then
    cancel it (cancelling the Generate RPCs it runs) and raise CancelledError."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise GatewayError(499, "client disconnected", "cancelled_error")  # nobody reads it
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _parse(model, body: dict):
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

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError):
        return error_response(e)

    @app.exception_handler(MiniPagedError)
    async def _sdk_error(request: Request, e: MiniPagedError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(bad_request(str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(GatewayError(e.status_code, str(e.detail), "invalid_request_error"))

    def authorize(request: Request) -> None:
        if config.token and request.headers.get("authorization", "") != f"Bearer {config.token}":
            raise GatewayError(401, "missing or wrong API key: send 'Authorization: Bearer <token>'",
                               "authentication_error", code="invalid_api_key")

    # ------------------------------------------------------------ OpenAI API

    async def model_card() -> dict:
        if gw.last_stats is None or not gw.last_stats.model:  # max_model_len is the service's: ask once
            try:
                await gw.stats()
            except MiniPagedError:
                pass
        card = {"id": gw.model_name, "object": "model", "created": gw.started, "owned_by": "minipaged",
                "root": config.model or gw.model_name, "parent": None}
        if gw.max_model_len:
            card["max_model_len"] = gw.max_model_len
        return card

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model_id:path}")  # openai's models.retrieve(); a checkpoint path holds slashes
    async def model(model_id: str, request: Request):
        authorize(request)
        gw.check_model(model_id)
        return await model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        t0 = time.monotonic()
        req = _parse(oa.CompletionRequest, await _json_body(request))
        await gw.require_model()  # first: without --model, the name to accept comes from the service
        gw.check_model(req.model)
        kw = oa.completion_kwargs(req)
        prompts = oa.completion_prompts(req)
        echo = prompt_ids = None
        if req.echo:
            echo = [p.get("prompt") if "prompt" in p else _decode_or_fail(gw, p["prompt_token_ids"])
                    for p in prompts]
        if "prompt_logprobs" in kw:   # the service scores token ids the gateway knows, to name them
            prompt_ids = [p["prompt_token_ids"] if "prompt_token_ids" in p else _encode_or_fail(gw, p["prompt"])
                          for p in prompts]
            prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        items = [{**kw, **p} for p in prompts]
        rid = oa.new_id("cmpl")
        stream = gw.generate_stream(items, req.n, t0, whole=not req.stream)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _start_sse(request, stream, _completion_events(gw, rid, req, stream, echo, include_usage,
                                                                          len(prompts), prompt_ids))
        choices = await _unless_disconnected(request, _collect(stream))
        per_prompt = [[c for c in choices.values() if c.index // req.n == p] for p in range(len(prompts))]
        return oa.completion_response(rid, gw.model_name, [choices[i] for i in sorted(choices)], per_prompt,
                                      gw.token_text_for(req), echo, req.n, prompt_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        t0 = time.monotonic()
        req = _parse(oa.ChatCompletionRequest, await _json_body(request))
        await gw.require_model()  # first: without --model, the name to accept comes from the service
        gw.check_model(req.model)
        messages = oa.chat_messages(req)
        tools = tc.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        template_kwargs = {**(req.chat_template_kwargs or {}), **({"tools": req.tools} if req.tools else {})}
        try:
            prompt = gw.template.render(messages, req.add_generation_prompt, **template_kwargs)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        kw = oa.chat_kwargs(req, _default_max_tokens(gw, prompt))
        kw.update(_forced_tool_kwargs(tools, kw))
        output = OutputOptions(reasoning=gw.config.reasoning_parser == "qwen3" and gw.template.thinks,
                               reasoning_open=rs.prompt_opens_reasoning(prompt), tools=tools)
        rid = oa.new_id("chatcmpl")
        stream = gw.generate_stream([{**kw, "prompt": prompt}], req.n, t0, whole=not req.stream)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await _start_sse(request, stream, _chat_events(gw, rid, req, stream, include_usage, output))
        choices = await _unless_disconnected(request, _collect(stream))
        return oa.chat_response(rid, gw.model_name, [choices[i] for i in sorted(choices)], gw.token_text_for(req),
                                output)

    # ------------------------------------------------------------ operations

    @app.get("/health")
    async def health():
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

    @app.get("/metrics")
    async def metrics():
        try:
            gw.metrics.stats.update(await gw.stats())
        except MiniPagedError as e:
            gw.metrics.stats.update(None, str(e))
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    dashboard_routes(app, gw)
    return _CountRequests(app, gw.metrics)


def _decode_or_fail(gw: Gateway, ids: list[int]) -> str:
    if gw.tokenizer is None:
        raise bad_request("echo of a token-id prompt needs the model's tokenizer on the gateway (--model PATH)",
                          "echo")
    return gw.tokenizer.decode(ids)


def _forced_tool_kwargs(tools: tc.ToolPlan, kw: dict) -> dict:
    """tool_choice "required" or a named function: the SDK's JSON-schema constraint forces a call."""
    schema = tc.forced_schema(tools)
    if schema is None:
        return {}
    if any(kw.get(k) not in (None, False) for k in ("json_schema", "regex", "choice", "json_object")):
        raise bad_request(f"tool_choice {tools.mode!r} constrains the output to a tool call: it cannot be "
                          f"combined with response_format or another structured output", "tool_choice")
    import inspect

    from client.messages import build_generate_request
    if "json_schema" not in inspect.signature(build_generate_request).parameters:
        raise bad_request(f"tool_choice {tools.mode!r} needs structured outputs (json_schema), which this "
                          f"build does not have; use \"auto\"", "tool_choice")
    return {"json_schema": schema}
def _encode_or_fail(gw: Gateway, text: str) -> list[int]:
    if gw.tokenizer is None:
        raise bad_request("echo with logprobs of a text prompt needs the model's tokenizer on the gateway "
                          "(--model PATH)", "echo")
    ids = list(gw.tokenizer.encode(text))
    if not ids:
        raise bad_request("the prompt is empty: it has no token", "prompt")
    return ids


def _default_max_tokens(gw: Gateway, prompt: str) -> int:
    """Chat requests without max_tokens: --default-max-tokens, within the model's context when the
    gateway can read the model (it then knows the prompt's length too)."""
    limit = gw.config.default_max_tokens
    if gw.max_model_len and gw.tokenizer is not None:
        limit = min(limit, max(1, gw.max_model_len - len(gw.tokenizer.encode(prompt))))
    return limit


async def _collect(stream) -> dict[int, oa.Choice]:
    choices: dict[int, oa.Choice] = {}
    async for idx, chunk in stream:
        choices.setdefault(idx, oa.Choice(idx)).add(chunk)
    return choices


async def _start_sse(request: Request, stream, events) -> Response:
    """Wait for the first event before answering, so an error the service raises at once (bad
    parameter, queue full, no chain) gets its real HTTP status instead of a 200 stream."""
    try:
        first = await _unless_disconnected(request, events.__anext__())
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        await stream.aclose()
        raise

    async def body():
        try:
            if first is not None:
                yield first
                async for event in events:
                    yield event
        finally:
            await events.aclose()
            await stream.aclose()
    return SSEResponse(body())


def _error_event(e: Exception) -> str:
    from .errors import as_gateway_error
    return _sse(as_gateway_error(e).body())


async def _completion_events(gw: Gateway, rid: str, req: oa.CompletionRequest, stream, echo, include_usage: bool,
                             num_prompts: int, prompt_ids=None):
    created, model, n = int(time.time()), gw.model_name, req.n
    offsets: dict[int, int] = {}
    choices: dict[int, oa.Choice] = {}
    prompt_lp: dict[int, tuple] = {}      # per prompt: its logprobs (the first chunk of its stream)
    started = False
    try:
        async for idx, chunk in stream:
            ch = choices.setdefault(idx, oa.Choice(idx))
            ch.add(chunk)
            if chunk.prompt_logprobs is not None:
                prompt_lp[idx // n] = (chunk.prompt_logprobs, chunk.prompt_top_logprobs)
            if echo and idx not in offsets:
                offsets[idx] = len(echo[idx // n])
                elp = None
                if prompt_ids is not None and idx // n in prompt_lp:
                    elp = oa.echo_logprobs(prompt_ids[idx // n], *prompt_lp[idx // n], gw.token_text_for(req))
                yield _sse(oa.completion_chunk(rid, created, model, idx, echo[idx // n], elp, None))
            part = oa.Choice(idx, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                             top=chunk.top_logprobs or [])
            lp = oa.completion_logprobs(part, gw.token_text_for(req), offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + len(chunk.text)
            finish = ch.finish_reason if chunk.finish_reason else None
            if chunk.text or finish or lp or not started:
                started = True
                yield _sse(oa.completion_chunk(rid, created, model, idx, chunk.text, lp, finish))
        if include_usage:
            per_prompt = [[c for c in choices.values() if c.index // n == p] for p in range(num_prompts)]
            yield _sse(oa.usage_chunk(rid, created, model, "text_completion", oa.total_usage(per_prompt)))
        yield "data: [DONE]\n\n"
    except MiniPagedError as e:  # after the first event: the status is sent already; say it in-band
        if not started:
            raise
        yield _error_event(e)
        yield "data: [DONE]\n\n"


async def _chat_events(gw: Gateway, rid: str, req: oa.ChatCompletionRequest, stream, include_usage: bool,
                       output: OutputOptions):
    created, model = int(time.time()), gw.model_name
    choices: dict[int, oa.Choice] = {}
    parsed: dict = {}  # index -> ChatOutput: reasoning and tool calls parsed out of the text deltas
    started = False
    try:
        async for idx, chunk in stream:
            if idx not in choices:
                choices[idx] = oa.Choice(idx)
                parsed[idx] = output.new()
                started = True
                yield _sse(oa.chat_chunk(rid, created, model, idx, {"role": "assistant", "content": ""}, None, None))
            ch = choices[idx]
            ch.add(chunk)
            part = oa.Choice(idx, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                             top=chunk.top_logprobs or [])
            lp = oa.chat_logprobs(part, gw.token_text_for(req))
            finish = ch.finish_reason if chunk.finish_reason else None
            delta = parsed[idx].feed(chunk.text) if chunk.text else {}
            if finish:
                delta = merge_deltas(delta, parsed[idx].finish())
                finish = parsed[idx].finish_reason(finish)
            if delta or finish or lp:
                yield _sse(oa.chat_chunk(rid, created, model, idx, delta, lp, finish))
        if include_usage:
            yield _sse(oa.usage_chunk(rid, created, model, "chat.completion.chunk", oa.total_usage([list(choices.values())])))
        yield "data: [DONE]\n\n"
    except MiniPagedError as e:
        if not started:
            raise
        yield _error_event(e)
        yield "data: [DONE]\n\n"


class _CountRequests:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects):
    counts HTTP requests by route and status for /metrics."""

    ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/",
              "/dashboard/state")

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
