"""Small random Hugging Face Qwen3 checkpoints for parity tests, written with save_pretrained.

The oracle (transformers' Qwen3ForCausalLM) and our worker then load the very same files."""
from __future__ import annotations

import os
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def qwen3_config(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, tie=True, vocab=96,
                 intermediate=None, max_positions=512, theta=10000.0) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                       num_hidden_layers=num_layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tie,
                       max_position_embeddings=max_positions, rope_theta=theta, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None)


def make_checkpoint(num_layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, tie=True, vocab=96,
                    seed=0, directory: str | None = None, **config_kwargs) -> str:
    """Build a random Qwen3 (norm weights perturbed too, so they matter) and save it; returns the
    checkpoint directory (a fresh temp dir unless given)."""
    config = qwen3_config(num_layers, hidden, heads, kv_heads, head_dim, tie, vocab, **config_kwargs)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    directory = directory or tempfile.mkdtemp(prefix="qwen3-ckpt-")
    model.save_pretrained(directory)
    return directory


def load_oracle(directory: str, dtype: torch.dtype = torch.float64,
                attn_implementation: str = "sdpa") -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                             attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def weight_files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith((".safetensors", ".bin", ".json")))
