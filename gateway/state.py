"""What the gateway's routes share (`Gateway`): the SDK client, the served model's identity, the
chat template, token strings and the metrics (one prompt's chunks are observed for them by
request_metrics.Observed)."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

from client.aio import AsyncClient
from client.errors import MiniPagedError
from client.messages import Stats, StreamChunk

from minipaged import generation_defaults as gd
from . import model_identity as identity
from . import reasoning as rs
from .chat_template import ChatTemplate
from .errors import GatewayError, bad_request
from .metrics import GatewayMetrics
from .request_metrics import Observed
from .token_bytes import TokenStrings

log = logging.getLogger("gateway")
DEFAULT_CHAT_MAX_TOKENS = 256
MAX_OPEN_STREAMS = 512     # Generate streams to the service at once (Gateway.stream_slots)
MODEL_REFRESH_S = 5.0  # Stats poll that keeps the served model's identity and context current


@dataclass
class GatewayConfig:
    metadata: str                         # HOST:PORT of the metadata service
    token: str | None = None              # HTTP clients must send "Authorization: Bearer <token>"
    metadata_token: str | None = None     # presented to the metadata service (default: token)
    model: str | None = None              # what the workers load (tiny or a checkpoint path)
    served_model_name: str | list[str] | None = None  # the API's name(s) (default: model); the first is reported
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    default_max_tokens: int | None = None  # chat requests without max_tokens (None: the file's, else 256)
    reasoning_parser: str = rs.DEFAULT_PARSER  # "qwen3": <think> split out where the template thinks
    generation_config: str = "auto"       # unset sampling fields: auto | vllm | DIR (minipaged/generation_defaults.py)
    override_generation_config: dict | None = None
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
        # Generate streams open to the service at once: a burst of thousands on one channel has gRPC
        # cancel some (seen at ~2,000); more prompts wait here, in order, as the SDK's batches do
        self.stream_slots = asyncio.Semaphore(MAX_OPEN_STREAMS)
        self.open_streams: set[asyncio.Queue] = set()   # generate_stream's queues (end_open_streams)
        self.ttft_sum, self.ttft_count = 0.0, 0  # for the dashboard's TTFT plot
        self.local_config = self._local_config(config.model)
        self.max_model_len = self.local_config.max_context if self.local_config else None
        self.mismatch: str | None = None      # why --model is not the served model (requests get 503)
        self._adopted = ""                    # without --model: the served model taken from the service
        self._warned: set[str] = set()
        self.sampling_defaults = gd.load(config.generation_config, config.model, config.override_generation_config)
        log.info("%s", gd.describe(self.sampling_defaults, config.generation_config, config.override_generation_config))

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
    def served_names(self) -> list[str]:
        """--served-model-name's names (vLLM's: requests may use any, responses carry the first)."""
        names = self.config.served_model_name or []
        return [names] if isinstance(names, str) else [n for n in names if n]

    @property
    def known_model_name(self) -> str:
        """The served name, or "" while neither the flags nor the service have named it."""
        c = self.config
        return (self.served_names or [""])[0] or c.model or _reported_model(self.last_stats)

    @property
    def model_name(self) -> str:
        return self.known_model_name or "minipaged"

    def render_chat(self, req) -> tuple[list[dict], str]:
        """A chat request's messages (oa.chat_messages) and the prompt the chat template makes of them:
        what /v1/chat/completions sends the service, and what /tokenize counts."""
        from . import openai_api as oa
        messages = oa.chat_messages(req)
        template_kwargs = oa.template_kwargs(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        try:
            return messages, self.template.render(messages, req.add_generation_prompt, req.continue_final_message,
                                                  **template_kwargs)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    def accepts_model(self, name: str | None) -> bool:
        if not name:
            return True
        known = {self.model_name, self.config.model or "", _reported_model(self.last_stats), *self.served_names}
        known |= {os.path.basename(os.path.normpath(k)) for k in known if k}
        return name in known - {""}

    def check_model(self, name: str | None) -> None:
        if not self.accepts_model(name):
            raise GatewayError(404, f"The model `{name}` does not exist. This gateway serves "
                                    f"`{self.model_name}` (GET /v1/models).", "invalid_request_error",
                               "model", "model_not_found")

    @property
    def think_ids(self) -> tuple:
        """The tokenizer's ids of <think> / </think> (reasoning_tokens), found once per tokenizer."""
        tok, known = self.tokenizer, getattr(self, "_think_ids", None)
        if known is None or known[0] is not tok:
            known = self._think_ids = (tok, rs.tag_ids(tok))
        return known[1]

    def prompt_len(self, item: dict) -> int | None:
        """A prompt's length in tokens, when the gateway can know it (token ids, or text and a tokenizer)."""
        if "prompt_token_ids" in item:
            return len(item["prompt_token_ids"])
        return len(self.tokenizer.encode(item["prompt"])) if self.tokenizer is not None else None

    def token_text_for(self, req) -> TokenStrings:
        as_ids = req.return_tokens_as_token_ids
        return TokenStrings(_token_id_text if as_ids else self.token_text, self.tokenizer, as_ids)

    def _token_text(self, token_id: int) -> str:
        """A token as text for logprobs (vLLM writes "token_id:N" where it has no tokenizer); a special
        token by its name ("<|im_end|>"), as vLLM shows it, not as the "" that output text makes of it."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
                self._adopt_sampling_defaults(None)   # not the previous model's
                return
            loaded = await asyncio.to_thread(lambda: (ChatTemplate(st.model), self._load_tokenizer(st.model)))
            self.template, self.tokenizer = loaded
            self.token_text.cache_clear()
            self._adopt_sampling_defaults(st.model)
            log.info("model taken from the service: %s (max_model_len %d, chat template: %s)", st.model,
                     st.max_model_len, self.template.source)

    def _adopt_sampling_defaults(self, model: str | None) -> None:
        """Without --model, `--generation-config auto` reads the served model's file once it is known
        (None: not readable here); what cannot be read leaves the override's defaults alone, never the
        previous model's."""
        c = self.config
        if c.generation_config != "auto":
            return
        try:
            self.sampling_defaults = gd.load("auto", model, c.override_generation_config)
        except ValueError as e:   # the workers serve it anyway
            self.sampling_defaults = gd.load("vllm", None, c.override_generation_config)
            log.error("%s: %s", e, gd.describe(self.sampling_defaults, "vllm", c.override_generation_config))
            return
        log.info("%s", gd.describe(self.sampling_defaults, "auto", c.override_generation_config))

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
        self.open_streams.add(queue)

        async def pump(p: int, kw: dict) -> None:
            obs = Observed(self, t0, n, lambda: self.prompt_len(kw))
            agen = None
            try:  # (a failure to even start the stream must reach the consumer too, or it waits forever)
                async with self.stream_slots:
                    agen = self.client.chunks(whole=whole, **kw)  # best_of > n (refused when streaming): winners at the end
                    async for chunk in agen:
                        obs.chunk(chunk)
                        await queue.put((p * n + chunk.index, chunk))
                    obs.finish()
                    await queue.put((p, end))
            except asyncio.CancelledError:
                obs.abort()
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                obs.fail(e)
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
            self.open_streams.discard(queue)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def end_open_streams(self, why: str) -> None:
        """Shutting down, the grace nearly spent: every request still answering ends now with an
        OpenAI error (a stream's last event then [DONE]; a whole request a JSON 503), rather than
        being cut mid-body when the server cancels its tasks."""
        err = GatewayError(503, why, "service_unavailable_error", code="shutting_down", retry_after=1)
        for queue in list(self.open_streams):
            queue.put_nowait((-1, err))


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


# ---------------------------------------------------------------- helpers
