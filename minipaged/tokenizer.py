"""Tokenizers for both planes: the byte-level one of `tiny`, or the checkpoint's own (transformers)."""
from __future__ import annotations

import functools
import os

import numpy as np


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes; 256 = <|endoftext|> (EOS), 257/258 = <|im_start|>/<|im_end|>.
    `special`: the model's EOS ids, which decode skips even below 256 (a checkpoint without
    tokenizer files may name a byte its EOS: that id ends the text, it is not part of it, as a
    transformers tokenizer's skip_special_tokens has it)."""

    eos_token_ids = [256]

    def __init__(self, special=()):
        self.special = frozenset(int(i) for i in special)

    max_token_bytes = 1   # every id is one byte of the text (names are not parsed from text)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """encode() without a Python int per byte: a 60 MB prompt was seconds under the GIL."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    NAMES = {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:     # logprobs and echoes name special tokens, as transformers' do
            out, run = [], []           # (bytes between names decode together: a character's bytes
            for i in ids:               # are one character, not one U+FFFD each)
                name = self.NAMES.get(int(i))
                if name:
                    out += [self.decode(run), name]
                    run = []
                else:
                    run.append(i)
            return "".join(out) + self.decode(run)
        skip = self.special
        return bytes(int(i) for i in ids if 0 <= int(i) < 256 and int(i) not in skip).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy import: only when a checkpoint has one

        self._tok = AutoTokenizer.from_pretrained(path)
        self.hf_tokenizer = self._tok   # for xgrammar's TokenizerInfo (structured outputs)
        eos = self._tok.eos_token_id
        self.eos_token_ids = [] if eos is None else [eos]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False), dtype=np.int64)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's piece spells (a byte-level piece spells each byte with one
        character of up to 2 bytes, so this over-counts: a safe bound). A text of B bytes is then at
        least B / max_token_bytes tokens, known before tokenizing it."""
        pieces = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
        return max([len(p.encode("utf-8")) for p in pieces if p] + [1])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(model: str) -> bool:
    return model != "tiny" and os.path.isdir(model) and any(
        os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(model: str):
    """The tokenizer for `--model`: byte-level for `tiny` and for checkpoints that ship none."""
    return HFTokenizer(model) if has_tokenizer_files(model) else ByteTokenizer()


def byte_fallback_problem(model: str, vocab_size: int) -> str | None:
    """Why text prompts cannot work, or None: a checkpoint without tokenizer files falls back to
    the byte-level tokenizer, whose ids 0-255 (and EOS 256) must exist in the model's vocab."""
    if has_tokenizer_files(model) or vocab_size >= 256:
        return None
    return (f"{model} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}) and its vocab_size {vocab_size} is "
            f"under 256: the byte-level fallback tokenizer needs vocab_size >= 256, so text prompts cannot be "
            f"encoded; send prompt_token_ids, or add the checkpoint's tokenizer files")


class IncrementalDetokenizer:
    """Text deltas for a growing token list. Holds back trailing U+FFFD (an incomplete UTF-8
    sequence, or invalid bytes) until a later token ends the text in a character, as vLLM's
    detokenizer (tokenizers' DecodeStream) does; what is still held at the end is never text
    (results.final_text drops it too), so the deltas concatenate to the final text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        if not text.startswith(self.emitted):  # a tokenizer that rewrote earlier text: emit nothing
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta
