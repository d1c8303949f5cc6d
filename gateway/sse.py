"""Server-sent events: OpenAI's streamed completions and chat completions over a merged chunk
stream (gateway/state.py's Gateway.generate_stream), and the non-streaming collect."""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from client.errors import MiniPagedError

from . import openai_api as oa
from .chat_output import OutputOptions
from .chat_output import merge as merge_deltas
from .errors import GatewayError

if TYPE_CHECKING:
    from .state import Gateway


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


def _before(ch: oa.Choice, chunk) -> list[int]:
    """The last tokens of a choice before this chunk's: what a token string may read (token_bytes.py)."""
    end = len(ch.token_ids) - len(chunk.token_ids)
    return ch.token_ids[max(0, end - 4):end]


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
                    offsets[idx] = oa.logprobs_end(elp)   # offsets count token strings, as vLLM's
                yield _sse(oa.completion_chunk(rid, created, model, idx, echo[idx // n], elp, None))
            part = oa.Choice(idx, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                             top=chunk.top_logprobs or [])
            lp = oa.completion_logprobs(part, gw.token_text_for(req), offsets.get(idx, 0), _before(ch, chunk))
            if lp and lp["tokens"]:
                offsets[idx] = oa.logprobs_end(lp)
            finish = ch.finish_reason if chunk.finish_reason else None
            if chunk.text or finish or lp or not started:
                started = True
                yield _sse(oa.completion_chunk(rid, created, model, idx, chunk.text, lp, finish,
                                               ch.stop_reason if finish else None))
        if include_usage:
            per_prompt = [[c for c in choices.values() if c.index // n == p] for p in range(num_prompts)]
            yield _sse(oa.usage_chunk(rid, created, model, "text_completion", oa.total_usage(per_prompt)))
        yield "data: [DONE]\n\n"
    except (MiniPagedError, GatewayError) as e:  # after the first event: the status is sent already; say it in-band
        if not started:
            raise
        yield _error_event(e)
        yield "data: [DONE]\n\n"


async def _chat_events(gw: Gateway, rid: str, req: oa.ChatCompletionRequest, stream, include_usage: bool,
                       output: OutputOptions, echo: str | None = None):
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
                yield _sse(oa.chat_chunk(rid, created, model, idx, {"role": output.role, "content": ""}, None, None))
                if echo:
                    yield _sse(oa.chat_chunk(rid, created, model, idx, {"content": echo}, None, None))
            ch = choices[idx]
            ch.add(chunk)
            part = oa.Choice(idx, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                             top=chunk.top_logprobs or [])
            lp = oa.chat_logprobs(part, gw.token_text_for(req), _before(ch, chunk))
            finish = ch.finish_reason if chunk.finish_reason else None
            delta = parsed[idx].feed(chunk.text) if chunk.text else {}
            if finish:
                delta = merge_deltas(delta, parsed[idx].finish())
                finish = parsed[idx].finish_reason(finish)
            if delta or finish or lp:
                yield _sse(oa.chat_chunk(rid, created, model, idx, delta, lp, finish, ch.stop_reason))
        if include_usage:
            yield _sse(oa.usage_chunk(rid, created, model, "chat.completion.chunk",
                                      oa.chat_usage(list(choices.values()), output)))
        yield "data: [DONE]\n\n"
    except (MiniPagedError, GatewayError) as e:
        if not started:
            raise
        yield _error_event(e)
        yield "data: [DONE]\n\n"
