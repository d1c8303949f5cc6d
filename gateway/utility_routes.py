"""vLLM's utility routes beside the OpenAI API: /ping, /version, /tokenize and /detokenize, with
vLLM's request and response shapes, so tools written against its server find them. Tokenizing
uses the checkpoint's tokenizer on the gateway (the one the service uses, so the ids are the
served ones) and, for `messages`, the chat template the chat endpoint renders."""
from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from .errors import GatewayError, bad_request
from .openai_requests import ChatCompletionRequest
from .request_body import json_of, parse_as, raw_body


def package_version() -> str:
    try:
        return metadata.version("minipaged-qwen")
    except metadata.PackageNotFoundError:
        return "0.1.0"


class TokenizeRequest(BaseModel):
    """vLLM's completion form; its chat form (`messages` and the chat fields) is read as a chat
    request. add_special_tokens is accepted and changes nothing: Qwen3 adds none."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def utility_routes(app: FastAPI, gw, authorize) -> None:
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's liveness probe: 200 while the gateway answers (/health says whether it serves)."""
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        body = json_of(await raw_body(request))
        req = parse_as(TokenizeRequest, body)
        tok = await _tokenizer(gw, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give prompt or messages (one of them)", "prompt")
        text = req.prompt if req.messages is None else gw.render_chat(parse_as(ChatCompletionRequest, body))[1]
        ids = [int(t) for t in tok.encode(text)]     # what the service makes of this text
        strs = _pieces(tok, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": gw.max_model_len or 0, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        req = parse_as(DetokenizeRequest, json_of(await raw_body(request)))
        tok = await _tokenizer(gw, req.model)
        bad = next((t for t in req.tokens if t < 0), None)
        try:
            if bad is None:
                return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
        except (ValueError, OverflowError, IndexError, TypeError):
            bad = req.tokens
        raise bad_request(f"token ids not in the vocabulary: {bad}", "tokens")


def _pieces(tok, ids: list[int]) -> list[str]:
    """Each id's vocabulary piece (vLLM's token_strs), or its text for the byte-level tokenizer."""
    hf = getattr(tok, "hf_tokenizer", None)
    if hf is not None:
        return hf.convert_ids_to_tokens(ids)
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


async def _tokenizer(gw, model: str | None):
    await gw.require_model()
    gw.check_model(model)
    if gw.tokenizer is None:
        raise GatewayError(501, "this gateway has no tokenizer for the served model (a checkpoint without "
                                "tokenizer files): /tokenize and /detokenize need one", "invalid_request_error")
    return gw.tokenizer
