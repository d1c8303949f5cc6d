"""Structured outputs in the metadata plane (docs/architecture.md section 10): xgrammar keeps the grammar state.

A request with a JSON schema, a regex, a choice or json_object gets a grammar compiled against the
served model's vocabulary (once per distinct grammar: xgrammar's GrammarCompiler caches the
compiled result). Each constrained sequence owns one GrammarMatcher; before a step that samples
for it, the matcher fills that row's next-token bitmask (int32 words, bit j of word w = token
32 * w + j), the rows travel packed in the Step and the last stage masks the logits. The matcher
advances on the token that comes back; it terminates once the grammar is complete and a stop
token (the model's EOS ids) was taken, and the sequence then finishes with "stop".

A constrained sequence's next bitmask depends on its last token, so it never runs ahead with async
scheduling (the scheduler treats it as it treats penalized sequences).

Vocabulary: the checkpoint's tokenizer (transformers) gives xgrammar its encoded vocabulary; the
byte-level tokenizer of `tiny` and of checkpoints without one has ids 0-255 = the bytes, every
other id (specials, EOS, the rows past the tokenizer) is a special token no grammar emits. The
bitmask always spans the model's vocab_size (embedding rows), which may exceed the tokenizer's.

JSON is generated compactly (any_whitespace off, separators ", " and ": "): with free whitespace a
weak model can emit blanks until max_new_tokens, and xgrammar's masks get larger."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np

from minipaged.tokenizer import ByteTokenizer

MAX_SPEC_CHARS = 1 << 20          # a schema / regex / choice list larger than this is refused
MAX_CHOICES = 1024


class GrammarError(ValueError):
    """A constraint that cannot be compiled (the message says why)."""


def _xgr():
    """xgrammar, imported on first use: a service that never sees a constraint does not need it
    (it pulls torch and transformers; `pip install minipaged[structured]`)."""
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarError(f"structured outputs need xgrammar on the metadata service (pip install "
                           f"xgrammar==0.2.8): {e}") from None
    return xgrammar


@dataclass(frozen=True)
class GrammarSpec:
    kind: str       # "json_schema", "json_object", "regex" or "choice"
    text: str       # the schema as JSON, the regex, or the choices as a JSON list


def spec_of(req) -> GrammarSpec | None:
    """The request's constraint (a GenerateRequest), or None; several at once is an error."""
    given = [k for k, on in (("json_schema", bool(req.json_schema)), ("json_object", req.json_object),
                             ("regex", bool(req.regex)), ("choice", len(req.choice) > 0)) if on]
    if len(given) > 1:
        raise GrammarError(f"give at most one of json_schema, json_object, regex, choice; got {', '.join(given)}")
    if not given:
        return None
    kind = given[0]
    if kind == "json_schema":
        text = req.json_schema
    elif kind == "regex":
        text = req.regex
    elif kind == "choice":
        if len(req.choice) > MAX_CHOICES or any(not c for c in req.choice):
            raise GrammarError(f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        text = json.dumps(list(req.choice), ensure_ascii=False)
    else:
        text = ""
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"the {kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}")
    return GrammarSpec(kind, text)


# What xgrammar 0.2.8 would compile and then ignore, so the output would break the schema while
# finishing "stop": refused instead (vLLM refuses the same under xgrammar). Formats it enforces:
STRING_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                  "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
_IGNORED = ("not", "if", "dependentRequired", "dependentSchemas", "contains")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems")


def unsupported_keyword(schema, path: str = "#") -> str | None:
    """The first keyword the grammar could not enforce ("#/properties/x: uniqueItems ..."), or None."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    why = next((k for k in _IGNORED if k in schema), None)
    if why is None and schema.get("uniqueItems"):            # (false is the default: nothing to enforce)
        why = "uniqueItems"
    if why is None and "multipleOf" in schema and "number" in types:   # (an integer's is enforced)
        why = "multipleOf on a number"
    if why is None and ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        why = "minLength / maxLength with a pattern or format"
    if why is None and "format" in schema and "string" in types and schema["format"] not in STRING_FORMATS:
        why = f"format {schema['format']!r}"
    if why is None and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        why = "allOf of several schemas"
    if why is None and "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema):
        why = "propertyNames with properties"
    if why is not None:
        return f"{path}: {why} is not supported (the output could break it)"
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                found = unsupported_keyword(sub, f"{path}/{key}/{name}")
                if found:
                    return found
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key) or () if isinstance(schema.get(key), list) else ()):
            found = unsupported_keyword(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in _SUBSCHEMAS:
        found = unsupported_keyword(schema.get(key), f"{path}/{key}")
        if found:
            return found
    return None


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def tokenizer_info(tokenizer, vocab_size: int, stop_ids) -> "xgr.TokenizerInfo":
    """xgrammar's view of the served vocabulary: vocab_size is the model's (embedding rows)."""
    xgr = _xgr()
    stop = sorted(int(i) for i in stop_ids if 0 <= int(i) < vocab_size)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop or None)
    if not isinstance(tokenizer, ByteTokenizer):
        raise GrammarError(f"structured outputs need a byte-level or a transformers tokenizer, "
                           f"not {type(tokenizer).__name__}")
    # ids 0-255 are the bytes; EOS and every id above are specials (an empty string: never content;
    # listed, not left to vocab_size's padding, which xgrammar would not let be a stop token)
    vocab = [bytes([i]) for i in range(min(256, vocab_size))] + [b""] * max(0, vocab_size - 256)
    for i in stop:
        if i < len(vocab):
            vocab[i] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop or None)


class Grammars:
    """One model's grammar compiler. Built lazily (the TokenizerInfo of a 151,936-token vocabulary
    takes seconds), then shared by every RPC thread; xgrammar's compiler is thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, tuple(stop_ids)
        self._lock = threading.Lock()
        self._compiler = None

    @property
    def compiler(self) -> "xgr.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                self._compiler = _xgr().GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """-> the compiled grammar (cached by xgrammar), or GrammarError with xgrammar's reason."""
        c = self.compiler
        try:
            if spec.kind == "json_schema":
                schema = json.loads(spec.text)
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
                unsupported = unsupported_keyword(schema)
                if unsupported:
                    raise GrammarError(f"invalid json_schema: {unsupported}")
                return c.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            return c.compile_grammar(choice_ebnf(json.loads(spec.text)))
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("json_schema is nested too deeply") from None
        except (RuntimeError, ValueError, TypeError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"invalid {spec.kind}: {_reason(e)}") from None


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ... (JSON string escapes are valid EBNF string escapes in xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(e: Exception) -> str:
    """xgrammar's C++ errors start with '[time] file.cc:line: '; keep the sentence."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1].strip()
    return text or type(e).__name__


def new_matcher(compiled: "xgr.CompiledGrammar", after_token: int = -1):
    """A GrammarMatcher, or one that waits for `after_token` (>= 0) before it constrains anything."""
    matcher = _xgr().GrammarMatcher(compiled)
    return matcher if after_token < 0 else AfterToken(matcher, after_token)


class AfterToken:
    """A matcher dormant until `token` is generated (a reasoning model's </think>: vLLM applies the
    grammar after the reasoning ends). Dormant, it allows every token and accepts what comes; the
    token itself is not fed to the grammar, every one after it is. The matcher interface the
    service uses: fill_next_token_bitmask, accept_token, is_terminated."""

    def __init__(self, matcher, token: int):
        self.matcher, self.token, self.active = matcher, int(token), False

    def fill_next_token_bitmask(self, mask, row: int) -> None:
        if self.active:
            self.matcher.fill_next_token_bitmask(mask, row)
        else:
            mask[row] = -1

    def accept_token(self, token: int) -> bool:
        if self.active:
            return self.matcher.accept_token(token)
        self.active = int(token) == self.token
        return True

    def is_terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()


def fill_bitmask(matchers: list, vocab_size: int) -> np.ndarray:
    """int32 [len(matchers), ceil(vocab/32)]: each matcher's allowed next tokens, one row each.
    Serial on purpose: xgrammar's BatchGrammarMatcher threads cost more than they save on the few
    cores a metadata service gets (measured: 64 rows 0.4 ms serial, 0.6-75 ms with 2 threads)."""
    mask = _xgr().allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(mask, i)
    return mask.numpy()


def advance(matcher: "xgr.GrammarMatcher", token: int) -> str:
    """Feed a sampled token: "" (go on), "stop" (the grammar is done) or "rejected" (the data
    plane returned a token the bitmask did not allow: a worker that ignored the mask)."""
    if not matcher.accept_token(int(token)):
        return "rejected"
    return "stop" if matcher.is_terminated() else ""
