"""The OpenAI API's shapes and their mapping onto our Generate request and back, as one namespace
(`from gateway import openai_api as oa`): requests in openai_requests.py (pydantic models ->
SDK keyword arguments), responses in openai_responses.py (stream chunks -> OpenAI's bodies).
Pure functions and models only: no I/O here (app.py and sse.py run the requests)."""
from __future__ import annotations

from .openai_requests import (CHAT_ROLES, DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, ChatMessage,
                              CompletionRequest, StreamOptions, chat_kwargs, chat_messages, completion_kwargs,
                              completion_prompts, sampling_kwargs, template_kwargs)
from .openai_responses import (FINISH_REASONS, Choice, chat_chunk, chat_logprobs, chat_response, chat_usage,
                               completion_chunk,
                               completion_logprobs, completion_response, echo_logprobs, join_logprobs, logprobs_end, new_id,
                               prompt_logprobs_of, total_usage, usage_chunk, usage_dict)

__all__ = ["CHAT_ROLES", "DEFAULT_COMPLETION_MAX_TOKENS", "ChatCompletionRequest", "ChatMessage", "CompletionRequest",
           "StreamOptions", "chat_kwargs", "chat_messages", "completion_kwargs", "completion_prompts",
           "sampling_kwargs", "template_kwargs", "FINISH_REASONS", "Choice", "chat_chunk", "chat_logprobs", "chat_response", "chat_usage",
           "completion_chunk", "completion_logprobs", "completion_response", "echo_logprobs", "join_logprobs", "logprobs_end",
           "new_id", "prompt_logprobs_of", "total_usage", "usage_chunk", "usage_dict"]
