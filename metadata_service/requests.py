"""Turning a GenerateRequest into a Sequence: validation and admission control.

Everything is checked before anything moves, so a rejected request leaves no trace. Requests are
normalised (prompt tokenized, seed chosen) so a stored job recomputes to the same tokens."""
from __future__ import annotations

import math
import secrets

import grpc

from minipaged.v1 import metadata_pb2
from minipaged.wire import INT32, WireError, pack, unpack

from .sequence import SamplingParams, Sequence
from .stop import StopChecker


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def normalize(req: metadata_pb2.GenerateRequest, engine) -> metadata_pb2.GenerateRequest:
    """Validate and return a copy with prompt_token_ids and seed filled in."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not engine.model_name:
        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                           "no worker chain has registered yet: the model (and its tokenizer and limits) "
                           "is unknown; retry when Stats().ready is true")
    out = metadata_pb2.GenerateRequest()
    out.CopyFrom(req)
    try:
        ids = unpack(req.prompt_token_ids, INT32, name="prompt_token_ids") if req.prompt_token_ids else None
        stop_ids = unpack(req.stop_token_ids, INT32, name="stop_token_ids")
    except WireError as e:
        raise RequestError(bad, str(e)) from None
    if ids is None:
        ids = engine.tokenizer.encode(req.prompt)
    ids = [int(i) for i in ids]
    if not ids:
        raise RequestError(bad, "the prompt is empty: give prompt or prompt_token_ids with at least one token")
    vocab = engine.vocab_size
    if vocab and (min(ids) < 0 or max(ids) >= vocab):
        raise RequestError(bad, f"prompt token ids must be in [0, {vocab}); got min {min(ids)}, max {max(ids)}")
    if stop_ids.size and vocab and (stop_ids.min() < 0 or stop_ids.max() >= vocab):
        raise RequestError(bad, f"stop_token_ids must be in [0, {vocab})")
    if req.max_new_tokens < 1:
        raise RequestError(bad, f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise RequestError(bad, f"temperature must be a finite number >= 0, got {req.temperature}")
    if not math.isfinite(req.top_p) or not 0 <= req.top_p <= 1:
        raise RequestError(bad, f"top_p must be in [0, 1], got {req.top_p}")
    if req.top_k < 0:
        raise RequestError(bad, f"top_k must be >= 0, got {req.top_k}")
    if len(req.stop) > 16 or any(len(s) > 256 for s in req.stop):
        raise RequestError(bad, "at most 16 stop strings of at most 256 characters each")
    total = len(ids) + req.max_new_tokens
    if total > engine.max_model_len:
        raise RequestError(bad, f"prompt ({len(ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                                f"exceeds max_model_len {engine.max_model_len}")
    need = -(-total // engine.block_size)
    pool = engine.max_pool_blocks  # a sequence lives in one chain's pool: the largest one bounds it
    if need > pool:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"this request needs {need} blocks of {engine.block_size} tokens but the whole pool "
                           f"holds {pool} ({pool * engine.block_size} tokens): it could never run")
    out.prompt_token_ids = pack(ids, INT32)
    out.prompt = ""
    if not out.HasField("seed"):
        out.seed = secrets.randbits(63)
    return out


def to_sequence(req: metadata_pb2.GenerateRequest, engine, sink=None, tag=None) -> Sequence:
    """A normalised request -> a Sequence ready for the engine."""
    params = SamplingParams(
        max_new_tokens=req.max_new_tokens, temperature=req.temperature,
        top_p=req.top_p if req.top_p > 0 else 1.0, top_k=req.top_k, seed=req.seed & (2**63 - 1),
        stop=tuple(req.stop), stop_token_ids=tuple(unpack(req.stop_token_ids, INT32).tolist()),
        ignore_eos=req.ignore_eos, return_logprobs=req.return_logprobs)
    seq = Sequence(unpack(req.prompt_token_ids, INT32).tolist(), params, sink=sink, tag=tag)
    if params.stop:
        seq.stop_checker = StopChecker(engine, params.stop)
    return seq


def final_text(seq: Sequence, engine) -> str:
    text = engine.decode(seq.output_token_ids)
    cut = seq.stop_checker.cut if seq.stop_checker is not None else None
    return text[:cut] if cut is not None else text


def usage(seq: Sequence) -> metadata_pb2.Usage:
    return metadata_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(seq.output_token_ids),
                              cached_tokens=seq.num_cached_tokens, preemptions=seq.preemptions)
