"""A token's raw bytes, for the `bytes` of chat logprobs.

OpenAI's `bytes` lets a client rebuild a character split over several tokens, so it must be the
token's own bytes, not the UTF-8 of its decoded text (a lone byte of a multi-byte character
decodes to U+FFFD, whose UTF-8 is EF BF BD whatever the byte was). Byte-level BPE tokenizers
(GPT-2, Qwen) spell each byte as one printable character (transformers' bytes_to_unicode): the
inverse map gives the bytes back; SentencePiece byte tokens are written <0xNN>; special tokens are
their text."""
from __future__ import annotations

import functools
import os
import re

from minipaged.tokenizer import ByteTokenizer

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """transformers' bytes_to_unicode, inverted (written out: it moved between modules)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The token's bytes, or None when there is no tokenizer to ask."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        return bytes([token_id]) if 0 <= token_id < 256 else tokenizer.decode([token_id]).encode()
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:
        return tokenizer.decode([token_id]).encode("utf-8")
    piece = hf.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if int(token_id) in set(hf.all_special_ids) or piece in getattr(hf, "added_tokens_encoder", {}):
        return piece.encode("utf-8")
    m = _HEX_BYTE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    dec = _byte_decoder()
    if all(ch in dec for ch in piece):
        return bytes(dec[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker is a space


class TokenStrings:
    """What logprobs show of a token: its text (or "token_id:N") and its raw bytes."""

    def __init__(self, text_fn, tokenizer, as_ids: bool = False):
        self._text, self._tokenizer, self._as_ids = text_fn, tokenizer, as_ids

    def __call__(self, token_id: int, context=None) -> str:
        """The token's text; with `context` (the sequence's tokens before it), vLLM's rule for a token
        that ends an unfinished character (U+FFFD): what it completes, read after up to 4 tokens of
        context, or "" while the character is still unfinished (its bytes then show on the token
        that completes it, so the strings add up to the text). It is vLLM 0.32's
        `_correct_decoded_token` (vllm/v1/engine/logprobs.py), the invalid byte's case included: its
        U+FFFD is in the text and on no token string, in both servers."""
        text = self._text(token_id)
        if context is None or self._as_ids or self._tokenizer is None or not text.endswith("\ufffd"):
            return text
        return self._completed(int(token_id), [int(t) for t in context[-4:]])

    def _completed(self, token_id: int, context: list[int]) -> str:
        decode = self._tokenizer.decode
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id], skip_special_tokens=False)
            if full.endswith("\ufffd"):
                continue
            clean = len(ctx)            # context tokens that are themselves bytes of this character
            while clean and self._text(ctx[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = decode(ctx[:clean], skip_special_tokens=False) if clean else ""
            return full[len(os.path.commonprefix([prefix, full])):]
        return ""

    def raw_bytes(self, token_id: int) -> list[int]:
        raw = token_bytes(self._tokenizer, token_id)
        return list(raw) if raw is not None else list(self._text(token_id).encode("utf-8"))
