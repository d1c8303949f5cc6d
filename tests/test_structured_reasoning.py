"""Structured outputs after reasoning (Probe W, ninth round): a template that opens <think> (Qwen3
Thinking-2507's) makes the model reason first. vLLM applies the grammar once the reasoning has
ended; from the first token, the constrained answer was all read as reasoning, content null. A
scripted Qwen3 (Qwen's real tokenizer) reasons, writes </think>, then answers: the answer is
constrained, the reasoning is not."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from client import LocalCluster
from metadata_service.grammar import AfterToken
from tests.qwen_tokenizer import make_scripted_checkpoint, qwen3_tokenizer_dir

THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class _Grammar:
    """A matcher that allows only token 7, then is done."""
    def __init__(self):
        self.seen = []

    def fill_next_token_bitmask(self, mask, row):
        mask[row] = 1 << 7

    def accept_token(self, t):
        if t == 7:
            self.seen.append(t)
        return t == 7

    def is_terminated(self):
        return self.seen == [7]


def test_the_grammar_waits_for_its_token():
    import torch
    m = AfterToken(_Grammar(), token=3)
    mask = torch.zeros((1, 1), dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 0)
    assert mask[0, 0] == -1 and m.accept_token(9) and not m.is_terminated()   # dormant: anything goes
    assert m.accept_token(3) and m.matcher.seen == []                         # the token itself is not fed
    m.fill_next_token_bitmask(mask, 0)
    assert mask[0, 0] == 1 << 7 and not m.accept_token(8) and m.accept_token(7) and m.is_terminated()


@pytest.fixture(scope="module")
def thinking_ckpt(tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    end, eos = tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<|im_end|>")
    answer = tok.encode("Let me think.") + [end] + tok.encode('{"a": 1}') + [eos]
    d = make_scripted_checkpoint(str(tmp_path_factory.mktemp("thinking")), [198] + answer, hidden=64)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = THINKING_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.slow
def test_a_thinking_template_constrains_the_answer_after_its_reasoning(thinking_ckpt):
    body = {"model": thinking_ckpt, "messages": [{"role": "user", "content": "a?"}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
    with LocalCluster(model=thinking_ckpt, workers=1, dtype="float32", http=True) as c:
        url = f"{c.http_url}/v1/chat/completions"
        msg = httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]
        assert msg["reasoning"] == "Let me think." and json.loads(msg["content"]) == {"a": 1}, msg
        free = httpx.post(url, json={**body, "response_format": None}, timeout=120).json()["choices"][0]["message"]
        assert free["reasoning"] == "Let me think." and free["content"] == '{"a": 1}'
        # a constraint the script's answer breaks: the answer after </think> still obeys it
        body["response_format"]["json_schema"]["schema"] = {"type": "object", "properties": {"b": {"enum": [2]}},
                                                          "required": ["b"], "additionalProperties": False}
        r = httpx.post(url, json={**body, "max_tokens": 200}, timeout=120).json()["choices"][0]
        assert r["message"]["reasoning"] == "Let me think."
        if r["finish_reason"] == "stop":
            assert json.loads(r["message"]["content"]) == {"b": 2}, r
        st = c.client.stats()
        assert st.invariants_ok and st.used_blocks == 0
