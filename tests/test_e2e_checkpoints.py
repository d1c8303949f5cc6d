"""Checkpoints beyond the defaults: one that ships its own tokenizer (text in, text out through the
model's tokenizer), generation_config EOS ids, and a worker whose model differs from the chain's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from client import LocalCluster
from client.cluster import free_port
from tests.checkpoints import load_oracle, make_checkpoint

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_tokenizer(directory: str, vocab: int) -> None:
    """Train a tiny BPE on a few sentences and save it as the checkpoint's own fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the paged cache maps tokens to slots", "a block table per sequence", "hello world"] * 20
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt-tok"))
    make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=320, seed=3, directory=d)
    add_tokenizer(d, 320)
    from transformers import AutoTokenizer
    eos = AutoTokenizer.from_pretrained(d).eos_token_id
    with open(os.path.join(d, "generation_config.json"), "w") as f:  # as real Qwen3 checkpoints do
        json.dump({"eos_token_id": [eos, 1], "bos_token_id": 0}, f)
    return d


def test_text_prompts_use_the_checkpoints_tokenizer(ckpt_with_tokenizer):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ckpt_with_tokenizer)
    model = load_oracle(ckpt_with_tokenizer, torch.float64)
    eos = {tok.eos_token_id, 1}
    with LocalCluster(model=ckpt_with_tokenizer, workers=2, dtype="float64") as c:
        for prompt in ("hello world", "the paged cache maps"):
            ids = tok.encode(prompt, add_special_tokens=False)
            r = c.client.generate(prompt=prompt, max_new_tokens=12)
            assert r.usage.prompt_tokens == len(ids)
            want = torch.tensor([ids])
            with torch.no_grad():
                for _ in range(12):
                    nxt = int(model(want).logits[0, -1].argmax())
                    want = torch.cat([want, torch.tensor([[nxt]])], dim=1)
                    if nxt in eos:  # both EOS ids of generation_config.json stop generation
                        break
            expected = want[0, len(ids):].tolist()
            assert r.token_ids == expected
            assert r.text == tok.decode(expected, skip_special_tokens=True)
            assert r.finish_reason == ("stop" if expected[-1] in eos else "length")
            streamed = "".join(ch.text for ch in c.client.stream(prompt=prompt, max_new_tokens=12))
            assert streamed == r.text


def test_a_worker_with_another_model_is_refused(ckpt_with_tokenizer, tmp_path):
    other = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=320, seed=4,
                            directory=str(tmp_path / "other"))
    with LocalCluster(model=ckpt_with_tokenizer, workers=1, dtype="float64") as c:
        log = tmp_path / "intruder.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "worker", "--metadata", c.address, "--port",
                                  str(free_port()), "--model", other, "--dtype", "float64"],
                                 cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert p.wait(timeout=60) == 3, log.read_text()   # refused: it exits non-zero, saying why
            assert b"model mismatch" in log.read_bytes()
            st = c.client.stats()
            assert st.num_workers == 1 and st.ready
            assert c.client.generate(prompt_token_ids=[5, 6], max_new_tokens=2).token_ids
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_pending_requests_pin_the_model_while_the_chain_is_down(ckpt_with_tokenizer, tmp_path):
    """Requests admitted for one model are never run by another, even after every worker is gone."""
    other = make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, vocab=320, seed=4,
                            directory=str(tmp_path / "other"))
    with LocalCluster(model=ckpt_with_tokenizer, workers=1, dtype="float64") as c:
        job = c.client.submit([{"prompt_token_ids": [5, 6, 7], "max_new_tokens": 200, "ignore_eos": True}])
        c.kill_worker(0)                                  # the job is now pending, with no chain
        log = tmp_path / "intruder.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "worker", "--metadata", c.address, "--port",
                                  str(free_port()), "--model", other, "--dtype", "float64"],
                                 cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        assert p.wait(timeout=60) == 3, log.read_text()
        assert b"still pending" in log.read_bytes()
        c.restart_worker(0)                               # the right model comes back and finishes it
        [r] = c.client.wait(job, timeout=120)
        assert len(r.token_ids) == 200 and r.finish_reason == "length"
