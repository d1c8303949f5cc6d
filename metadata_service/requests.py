"""Turning a GenerateRequest into a Sequence: validation and admission control (what a finished
sequence returns is results.py).

Everything is checked before anything moves, so a rejected request leaves no trace. Requests are
normalised (prompt tokenized, seed chosen) so a stored job recomputes to the same tokens."""
from __future__ import annotations

import math
import random
import secrets

import grpc

from minipaged.v1 import metadata_pb2
import numpy as np

from minipaged.constants import MAX_CHOICES, OPENAI_MAX_TOP_LOGPROBS
from minipaged.wire import INT32, WireError, pack, unpack

from .block_append import blocks_for_tokens, kv_tokens
from .grammar import GrammarError, new_matcher, spec_of
from .beam import MAX_BEAM_CANDIDATES, MAX_BEAM_WIDTH, BeamGroup, beam_candidates
from .beam_scorer import candidates_per_beam, parse_early_stopping
from . import prompt_logprobs
from .sequence import SamplingParams, Sequence
from .stop import StopChecker

_SEEDS = random.Random(secrets.randbits(128))   # seeds for requests without one (stored with the job)



class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def normalize(req: metadata_pb2.GenerateRequest, engine) -> metadata_pb2.GenerateRequest:
    """Validate and return a copy with prompt_token_ids and seed filled in."""
    if not engine.model_name:
        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                           "no worker chain has registered yet: the model (and its tokenizer and limits) "
                           "is unknown; retry when Stats().ready is true")
    if req.prompt and req.prompt_token_ids:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "give prompt or prompt_token_ids, not both")
    out = metadata_pb2.GenerateRequest()
    out.CopyFrom(req)
    ids = _prompt_ids(req, engine)
    _check_sampling(req)
    if req.HasField("prompt_logprobs") and getattr(engine, "simulated", False):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           "prompt logprobs need a real model: this service's workers are simulated (--simulate), "
                           "and compute no logits")
    _check_beams(req, engine)
    _check_fits(req, int(ids.size), engine)
    if compile_grammar(req, engine) is None and req.HasField("grammar_after_token_id"):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           "grammar_after_token_id needs a structured-output constraint (json_schema, regex, "
                           "choice or json_object)")
    if req.HasField("grammar_after_token_id") and not 0 <= req.grammar_after_token_id < engine.vocab_size:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"grammar_after_token_id must be a token id in "
                                                             f"[0, {engine.vocab_size}), got {req.grammar_after_token_id}")
    out.prompt_token_ids = pack(ids, INT32)
    out.prompt = ""
    if not out.HasField("seed"):
        out.seed = _SEEDS.getrandbits(63)
    return out


def _prompt_ids(req: metadata_pb2.GenerateRequest, engine) -> np.ndarray:
    """The prompt as int64 ids (tokenized when given as text), checked against the vocabulary, as
    the stop token ids are."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    try:
        ids = unpack(req.prompt_token_ids, INT32, name="prompt_token_ids") if req.prompt_token_ids else None
        stop_ids = unpack(req.stop_token_ids, INT32, name="stop_token_ids")
    except WireError as e:
        raise RequestError(bad, str(e)) from None
    if ids is None:
        if req.prompt and getattr(engine, "text_prompt_problem", None):  # (an empty one is "empty" below)
            raise RequestError(bad, engine.text_prompt_problem)
        _check_text_fits(req, engine)
        ids = engine.tokenizer.encode_array(req.prompt)
    ids = np.asarray(ids, dtype=np.int64)   # vectorized: a job may bring millions of prompt tokens
    if not ids.size:
        raise RequestError(bad, "the prompt is empty: it needs at least one token")
    vocab = engine.vocab_size
    lo, hi = int(ids.min()), int(ids.max())
    if vocab and (lo < 0 or hi >= vocab):
        raise RequestError(bad, f"prompt token ids must be in [0, {vocab}); got min {lo}, max {hi}")
    if stop_ids.size and vocab and (stop_ids.min() < 0 or stop_ids.max() >= vocab):
        raise RequestError(bad, f"stop_token_ids must be in [0, {vocab})")
    return ids


def _check_text_fits(req: metadata_pb2.GenerateRequest, engine) -> None:
    """A text prompt too long for the context whatever its tokens are, refused before tokenizing it
    (tens of MB took seconds, and stalled the service's other calls)."""
    per_token = getattr(engine.tokenizer, "max_token_bytes", None)
    limit = engine.max_model_len
    if not per_token or not limit or len(req.prompt) * 4 // per_token < limit:   # (4: the most bytes a char)
        return
    n_bytes = len(req.prompt.encode("utf-8"))
    least = -(-n_bytes // per_token)
    if least + req.max_new_tokens > limit:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"This model's maximum context length is {limit} tokens (max_model_len). However, "
                           f"your prompt is at least {least} tokens ({n_bytes} bytes of text, at most {per_token} "
                           f"bytes a token) and {req.max_new_tokens} are requested in the completion. Please "
                           f"reduce the length of the prompt or completion.")


def _check_sampling(req: metadata_pb2.GenerateRequest) -> None:
    """Lengths, sampling parameters, choices, logprobs and stop strings, each within its range."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    plp = req.HasField("prompt_logprobs")
    if req.max_new_tokens < (0 if plp else 1):
        raise RequestError(bad, f"max_new_tokens must be >= 1 (0 only with prompt_logprobs), got {req.max_new_tokens}")
    if plp and not 0 <= req.prompt_logprobs <= OPENAI_MAX_TOP_LOGPROBS:
        raise RequestError(bad, f"prompt_logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.prompt_logprobs}")
    if plp and req.max_new_tokens == 0 and (max(1, req.n) > 1 or req.best_of > 1):
        raise RequestError(bad, "max_new_tokens = 0 returns the prompt only: n and best_of must be 1")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise RequestError(bad, f"temperature must be a finite number >= 0, got {req.temperature}")
    if req.HasField("top_p") and (not math.isfinite(req.top_p) or not 0 < req.top_p <= 1):
        raise RequestError(bad, f"top_p must be in (0, 1] (leave it unset for no nucleus filtering), got {req.top_p}")
    if req.top_k < -1:            # -1: off, as 0 (vLLM's spelling of it)
        raise RequestError(bad, f"top_k must be -1 or 0 (off) or at least 1, got {req.top_k}")
    if not math.isfinite(req.min_p) or not 0 <= req.min_p <= 1:
        raise RequestError(bad, f"min_p must be in [0, 1] (0 = off), got {req.min_p}")
    n, best_of = max(1, req.n), req.best_of or max(1, req.n)
    if not 1 <= n <= MAX_CHOICES or req.n < 0:
        raise RequestError(bad, f"n must be in [1, {MAX_CHOICES}], got {req.n}")
    if not n <= best_of <= MAX_CHOICES:
        raise RequestError(bad, f"best_of must be in [n, {MAX_CHOICES}] (n = {n}), got {req.best_of}")
    if not 0 <= req.min_new_tokens <= req.max_new_tokens:
        raise RequestError(bad, f"min_new_tokens must be in [0, max_new_tokens = {req.max_new_tokens}], "
                                f"got {req.min_new_tokens}")
    if not math.isfinite(req.repetition_penalty) or req.repetition_penalty < 0:
        raise RequestError(bad, f"repetition_penalty must be > 0 (1 or unset = off), got {req.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if not math.isfinite(v) or not -2.0 <= v <= 2.0:
            raise RequestError(bad, f"{name} must be in [-2, 2], got {v}")
    if not 0 <= req.top_logprobs <= OPENAI_MAX_TOP_LOGPROBS:
        raise RequestError(bad, f"top_logprobs must be in [0, {OPENAI_MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if len(req.stop) > 16 or any(len(s) > 256 for s in req.stop):
        raise RequestError(bad, "at most 16 stop strings of at most 256 characters each")
    if "" in req.stop:            # vLLM's refusal: an empty stop string would match everywhere
        raise RequestError(bad, "stop cannot contain an empty string.")


def _check_fits(req: metadata_pb2.GenerateRequest, prompt_len: int, engine) -> None:
    """Within max_model_len, and no larger than the largest chain's pool (else it could never run)."""
    total = prompt_len + req.max_new_tokens
    if total > engine.max_model_len:
        # vLLM's (and OpenAI's) words, which clients match to tell a context overflow apart
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"This model's maximum context length is {engine.max_model_len} tokens (max_model_len). "
                           f"However, you requested {total} tokens ({prompt_len} in the prompt, "
                           f"{req.max_new_tokens} in the completion). Please reduce the length of the prompt "
                           f"or completion.")
    bs, slots = engine.block_size, kv_tokens(prompt_len, req.max_new_tokens)
    need = blocks_for_tokens(slots, bs)
    if req.beam_width:   # beams step together after the whole prompt (beam.py): all of them at once
        cfg = getattr(engine, "cfg", None)
        # a preempted beam recomputes its prompt from the prefix cache; without one, on its own:
        # then the K beams need their blocks unshared, or they would preempt each other forever
        shared = prompt_len // bs if cfg is None or cfg.enable_prefix_caching else 0
        need = shared + req.beam_width * blocks_for_tokens(slots - shared * bs, bs)
    # n / best_of: the choices fork after all but the last prompt token (groups.py), as many as have
    # room; the rest, and any preempted later, recompute on their own, as vLLM's child requests: one
    # choice must fit, not all of them together.
    pool = engine.max_pool_blocks  # a sequence lives in one chain's pool: the largest one bounds it
    if need > pool:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"this request needs {need} blocks of {engine.block_size} tokens but the whole pool "
                           f"holds {pool} ({pool * engine.block_size} tokens): it could never run"
                           + (" (with --no-prefix-caching a beam search's beams share no prompt block)"
                              if req.beam_width and not shared else ""))


def _check_beams(req: metadata_pb2.GenerateRequest, engine) -> None:
    """Beam search is deterministic and scores raw logprobs: sampling rules do not combine with it."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    K = req.beam_width
    if K == 0:
        if req.HasField("length_penalty") or req.early_stopping:
            raise RequestError(bad, "length_penalty and early_stopping apply to beam search only (set beam_width)")
        return
    if not 1 <= K <= MAX_BEAM_WIDTH:
        raise RequestError(bad, f"beam_width must be in [1, {MAX_BEAM_WIDTH}] (0 = off), got {K}")
    if engine.vocab_size and K > engine.vocab_size:   # fewer distinct first tokens than beams: not K choices
        raise RequestError(bad, f"beam_width {K} is more than the model's {engine.vocab_size} tokens")
    if req.n not in (0, 1, K) or (req.n == 1 and K != 1):
        raise RequestError(bad, f"beam search returns its {K} beams: n must be unset or equal beam_width "
                                f"({K}), got {req.n}")
    if req.best_of:
        raise RequestError(bad, "best_of does not combine with beam search (the beams are the candidates)")
    sampling = [f"{name} {value:.6g}" for name, value, on in (
        ("temperature", req.temperature, req.temperature > 0), ("top_p", req.top_p, req.HasField("top_p") and req.top_p < 1),
        ("top_k", req.top_k, req.top_k > 0), ("min_p", req.min_p, req.min_p > 0)) if on]
    if sampling:    # name only what was set (float32 on the wire: shown rounded)
        raise RequestError(bad, f"beam search is deterministic: it takes no {', '.join(sampling)} "
                                f"(temperature must be 0 and top_p / top_k / min_p unset)")
    others = [name for name, on in (("stop strings", bool(req.stop)), ("min_new_tokens", req.min_new_tokens > 0),
                                    ("repetition_penalty", req.repetition_penalty not in (0, 1)),
                                    ("presence_penalty", req.presence_penalty != 0),
                                    ("frequency_penalty", req.frequency_penalty != 0),
                                    ("top_logprobs", req.top_logprobs > 0),
                                    ("structured outputs", bool(req.json_schema or req.regex or req.choice
                                                                or req.json_object)),
                                    ("max_new_tokens 0 (prompt logprobs alone)", req.max_new_tokens == 0)) if on]
    if others:
        raise RequestError(bad, f"beam search does not support {', '.join(others)}")
    lp = req.length_penalty if req.HasField("length_penalty") else 1.0
    if not math.isfinite(lp):
        raise RequestError(bad, f"length_penalty must be a finite number, got {lp}")
    try:
        parse_early_stopping(req.early_stopping)
    except ValueError as e:
        raise RequestError(bad, str(e)) from None
    eos = set(unpack(req.stop_token_ids, INT32).tolist()) | (set() if req.ignore_eos else set(engine.eos_ids))
    m = candidates_per_beam(K, len(eos))
    if m > MAX_BEAM_CANDIDATES:
        raise RequestError(bad, f"beam_width {K} with {len(eos)} EOS / stop token ids needs {m} candidates per "
                                f"beam; the limit is {MAX_BEAM_CANDIDATES}")


def to_sequence(req: metadata_pb2.GenerateRequest, engine, sink=None, tag=None) -> Sequence:
    """A normalised request -> a Sequence ready for the engine."""
    n = max(1, req.n)
    params = SamplingParams(
        max_new_tokens=req.max_new_tokens, temperature=req.temperature,
        top_p=req.top_p if req.HasField("top_p") else 1.0, top_k=max(0, req.top_k), seed=req.seed,
        stop=tuple(req.stop), stop_token_ids=tuple(unpack(req.stop_token_ids, INT32).tolist()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos, return_logprobs=req.return_logprobs or req.top_logprobs > 0,
        n=n, best_of=req.best_of or n, min_new_tokens=req.min_new_tokens,
        repetition_penalty=req.repetition_penalty or 1.0, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, top_logprobs=req.top_logprobs, min_p=req.min_p,
        show_logprobs=req.return_logprobs or req.top_logprobs > 0, grammar=compile_grammar(req, engine),
        grammar_after_token=req.grammar_after_token_id if req.HasField("grammar_after_token_id") else -1,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else -1,
        per_token_events=not req.final_only)
    if params.best_of > params.n:   # choosing the best needs every candidate's logprobs
        params.return_logprobs = True
    if req.beam_width:
        _beam_params(params, req, engine)
    seq = Sequence(unpack(req.prompt_token_ids, INT32).tolist(), params, sink=sink, tag=tag)
    if params.prompt_logprobs >= 0:
        seq.prompt_lp = prompt_logprobs.PromptState.new(seq.num_prompt_tokens, params.prompt_logprobs)
    prepare(seq, engine)
    if req.beam_width:
        seq.group = BeamGroup(seq, engine)
        return seq
    if params.best_of > 1:
        from .groups import SequenceGroup
        seq.group = SequenceGroup(seq, engine)
    return seq


def reprepare(seq: Sequence, req: metadata_pb2.GenerateRequest, engine) -> None:
    """A sequence made before the service knew its model (a job resumed at start, before any worker
    registered): what depends on the model (grammar and its vocabulary, EOS ids for min tokens and
    beams, the tokenizer for stop strings) is made again, before it runs."""
    p = seq.params
    p.grammar = compile_grammar(req, engine)
    if req.beam_width:
        _beam_params(p, req, engine)
        seq.group.adopt_model(engine)
    prepare(seq, engine)


def compile_grammar(req: metadata_pb2.GenerateRequest, engine):
    """The request's structured-output grammar (xgrammar CompiledGrammar, cached), or None."""
    try:
        spec = spec_of(req)
        return None if spec is None else engine.grammars().compile(spec)
    except GrammarError as e:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def _beam_params(params: SamplingParams, req, engine) -> None:
    """One sequence per beam, greedy, each step returning its top M logprobs (beam_scorer.py)."""
    params.n = params.best_of = 1
    params.beam_width = req.beam_width
    params.length_penalty = req.length_penalty if req.HasField("length_penalty") else 1.0
    params.early_stopping = parse_early_stopping(req.early_stopping)
    params.top_logprobs = beam_candidates(params, engine)
    params.extras = True              # the top logprobs ride on the worker's extras path


def prepare(seq: Sequence, engine) -> None:
    """What each sequence of a request needs of its own (a forked child gets its own too)."""
    p = seq.params
    if p.grammar is not None:
        seq.matcher = new_matcher(p.grammar, p.grammar_after_token)
    if p.stop:
        seq.stop_checker = StopChecker(engine, p.stop)
    if p.min_new_tokens:
        seq.suppress_ids = tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(engine.eos_ids))))
