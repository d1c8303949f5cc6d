"""What the Engine knows of the model its chains serve (a mixin): tokenizer, EOS ids, vocab size,
shape and length limit, adopted from a chain's stages when it starts and kept while no chain is up
(a restarted service learns them from the first chain that forms)."""
from __future__ import annotations

import logging

from minipaged.config import shape_signature
from minipaged.tokenizer import ByteTokenizer, byte_fallback_problem, load_tokenizer
from minipaged.wire import INT32, unpack

from .grammar import Grammars

log = logging.getLogger("metadata_service.engine")


class ServedModel:
    """Mixed into Engine: uses its tokenizer, model_* fields, eos_ids, vocab_size and callbacks."""

    # the model's tokenizer, whichever chain is current (stop checkers and results use these)
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def grammars(self) -> Grammars:
        """The served model's grammar compiler (structured outputs), made on first use and again
        when the model (tokenizer, vocab size or EOS ids) changes."""
        key = (id(self.tokenizer), self.vocab_size, frozenset(self.eos_ids))
        with self._grammars_lock:
            if self._grammars is None or self._grammars[0] != key:
                self._grammars = (key, Grammars(self.tokenizer, self.vocab_size, self.eos_ids))
            return self._grammars[1]

    def _pinned_model(self):
        """While admitted requests are pending, only workers of their model may join."""
        pending = bool(self.parked) or any(c.load() for c in list(self.chains.values()))
        return (self.model_fingerprint, self.model_label or "the previous model") \
            if pending and self.model_fingerprint else None

    def _adopt_model(self, stages) -> None:
        info = stages[0].info
        if info.model_fingerprint != self.model_fingerprint or info.model_name != self.model_name:
            self.tokenizer = load_tokenizer(info.model_name)
            self.model_name = self.model_label = info.model_name
            if info.model_fingerprint != self.model_fingerprint:
                self.model_fingerprint = info.model_fingerprint
                for cb in self.on_model_changed:
                    cb(info.model_fingerprint, info.model_name)
        self.eos_ids = set(unpack(stages[-1].info.eos_token_ids, INT32).tolist())
        if isinstance(self.tokenizer, ByteTokenizer) and self.tokenizer.special != self.eos_ids:
            self.tokenizer = ByteTokenizer(self.eos_ids)   # an EOS byte ends the text, never in it
        self.vocab_size = info.vocab_size
        self.simulated = bool(info.simulate)   # timing-only workers: no prompt logprobs (requests.py)
        self.text_prompt_problem = byte_fallback_problem(info.model_name, info.vocab_size)
        if self.text_prompt_problem:
            log.warning("%s", self.text_prompt_problem)
        self.model_shape = shape_signature(info.vocab_size, info.hidden_size, info.num_layers,
                                           info.num_attention_heads, info.num_kv_heads, info.head_dim)
        self.max_model_len = min(self.max_model_len_flag or info.max_position_embeddings, info.max_position_embeddings)
        if self.max_model_len_flag > info.max_position_embeddings:   # the workers would refuse those positions
            log.warning("--max-model-len %d is longer than the model's context, %d tokens: serving %d",
                        self.max_model_len_flag, info.max_position_embeddings, self.max_model_len)
        if not self.model_known.is_set():   # before its chain takes any sequence (a resumed job's), and
            for cb in self.on_model_known:  # before a parked call wakes to find them half made
                cb()
        self.model_known.set()
