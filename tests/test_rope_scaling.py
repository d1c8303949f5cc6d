"""RoPE scaling in config.json (YaRN, as Qwen3's model card enables 131k contexts, and linear): the
frequencies and cos/sin equal transformers' bit for bit, greedy tokens past max_position_embeddings
equal transformers' generate through the whole service (1 and 2 stages, float64), the context limit
follows the scaling, and what is not supported is refused by name."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from client.errors import InvalidArgument
from minipaged.config import ModelConfig, load_model_config
from tests.checkpoints import load_oracle, make_checkpoint
from worker.layers import RotaryEmbedding
from worker.rope import inv_freq_and_scale

YARN_QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
ROPES = {
    "yarn as Qwen3's card": YARN_QWEN,
    "yarn, own attention factor and betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                             "attention_factor": 0.9, "beta_fast": 16, "beta_slow": 2},
    "yarn, mscale": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 48,
                     "mscale": 0.8, "mscale_all_dim": 0.5},
    "yarn, no truncation": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 40,
                            "truncate": False},
    "yarn, original from max_position_embeddings": {"rope_type": "yarn", "factor": 2.0},
    "linear": {"rope_type": "linear", "factor": 2.5},
}


def hf_config(rope: dict, theta=10000.0, head_dim=32, max_positions=64) -> Qwen3Config:
    return Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                       max_position_embeddings=max_positions, rope_parameters=dict(rope, rope_theta=theta))


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("head_dim", [32, 128])
def test_frequencies_and_cos_sin_equal_transformers(name, head_dim):
    cfg = hf_config(ROPES[name], theta=1e6 if head_dim == 128 else 1e4, head_dim=head_dim)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](cfg, None)
    ours = ModelConfig.from_dict(cfg.to_dict(), "test")
    freq, scale = inv_freq_and_scale(ours.head_dim, ours.rope_theta, ours.rope)
    assert torch.equal(freq, want_freq) and scale == want_scale
    pos = torch.arange(0, 600)
    x = torch.zeros(1, pos.numel(), head_dim, dtype=torch.float64)
    cos_hf, sin_hf = Qwen3RotaryEmbedding(cfg)(x, pos[None])
    cos, sin = RotaryEmbedding(head_dim, ours.rope_theta, ours.rope)(pos, torch.float64)
    assert torch.equal(cos, cos_hf[0]) and torch.equal(sin, sin_hf[0])


def test_config_json_is_read_as_transformers_reads_it():
    """rope_scaling before a transformers-5 config's rope_parameters, the theta inside the dict before
    the top-level one, 0 or null for the optional YaRN numbers, an integral float length."""
    v5 = hf_config({}, theta=1e6).to_dict()                      # rope_parameters: {"rope_type": "default", ...}
    assert v5["rope_parameters"]["rope_type"] == "default"
    for cfg in (dict(v5, rope_scaling=dict(YARN_QWEN)), dict(v5, rope_theta=10.0)):
        hf = Qwen3Config.from_dict(json.loads(json.dumps(cfg))).rope_parameters
        ours = ModelConfig.from_dict(cfg, "t")
        assert (ours.rope.get("rope_type", "default"), ours.rope_theta) == (hf["rope_type"], hf["rope_theta"])
    odd = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64.0, "beta_slow": 0, "mscale": 0,
           "rope_theta": 10000.0}
    want = ROPE_INIT_FUNCTIONS["yarn"](hf_config(odd), None)
    ours = ModelConfig.from_dict(hf_config(odd).to_dict(), "t")
    got = inv_freq_and_scale(ours.head_dim, ours.rope_theta, ours.rope)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    phi3 = dict(hf_config({"rope_type": "yarn", "factor": 4.0}).to_dict(), original_max_position_embeddings=16)
    hf = Qwen3Config.from_dict(json.loads(json.dumps(phi3)))      # the top-level length wins, as Phi-3 saves it
    want = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    ours = ModelConfig.from_dict(phi3, "t")
    assert ours.rope["original_max_position_embeddings"] == 16 and ours.max_context == 64
    assert torch.equal(inv_freq_and_scale(ours.head_dim, ours.rope_theta, ours.rope)[0], want[0])
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 1}
    assert ModelConfig.from_dict(dict(base, hidden_act="swish"), "t")       # SiLU's other name
    for sliding in (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
                    dict(use_sliding_window=True, max_window_layers=2)):   # transformers' window: 4096
        with pytest.raises(ValueError, match="sliding-window attention"):
            ModelConfig.from_dict(dict(base, **sliding), "t")


def test_context_limit_follows_the_scaling():
    """As vLLM derives max_model_len: YaRN original x factor, linear max_position_embeddings x factor."""
    def ctx(rope):
        return ModelConfig.from_dict(hf_config(rope, max_positions=100).to_dict(), "t").max_context
    assert ctx({}) == 100
    assert ctx({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}) == 128
    assert ctx({"rope_type": "yarn", "factor": 2.0}) == 200
    assert ctx({"rope_type": "linear", "factor": 1.5}) == 150
    qwen = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 1, "max_position_embeddings": 40960,    # Qwen3-0.6B + its card's YaRN lines
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert ModelConfig.from_dict(qwen, "q").max_context == 131072


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic' is not supported (supported: default, linear, yarn)"),
    ({"type": "longrope", "factor": 2.0}, "rope type 'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": -1}, "rope_scaling: field 'factor' must be a positive number"),
    ({"rope_type": "yarn"}, "rope_scaling: rope type 'yarn' needs the field 'factor'"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "big"},
     "'original_max_position_embeddings' must be a positive integer"),
    ({"rope_type": "linear", "factor": None}, "rope type 'linear' needs a number in the field 'factor'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ("yarn", "field 'rope_scaling' must be a JSON object"),
])
def test_unsupported_scaling_is_refused_by_name(tmp_path, rope, message):
    cfg = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 1, "rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(str(tmp_path))


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("yarn"))
    make_checkpoint(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, vocab=96, seed=5, directory=d,
                    max_positions=64)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)              # written as Qwen3's card says: rope_scaling beside rope_theta
    cfg.update(rope_theta=10000.0, rope_scaling=YARN_QWEN)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_yarn_greedy_tokens_past_max_positions_equal_transformers(yarn_checkpoint, workers):
    """Prompts of 70-150 ids, 12 new tokens: positions up to 161 on a model whose
    max_position_embeddings is 64 (YaRN x4 of 64 allows 256), float64, through the service."""
    from client import LocalCluster
    hf = load_oracle(yarn_checkpoint, torch.float64)
    assert hf.model.rotary_emb.attention_scaling != 1.0          # the oracle does scale
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 96, n).tolist() for n in (70, 150, 9)]
    with LocalCluster(model=yarn_checkpoint, workers=workers, dtype="float64") as c:
        for p in prompts:
            with torch.no_grad():
                want = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                   pad_token_id=0)[0, len(p):].tolist()
            r = c.client.generate(prompt_token_ids=p, max_new_tokens=12, ignore_eos=True)
            assert r.token_ids == want
        too_long = [5] * 250
        with pytest.raises(Exception, match="256"):             # the limit is the scaled context
            c.client.generate(prompt_token_ids=too_long, max_new_tokens=12)


@pytest.mark.slow
def test_rope_scaling_flag_gives_the_config_it_names(yarn_checkpoint, tmp_path):
    """`--rope-scaling` on the workers (vLLM's flag, as Qwen3's card uses it) over a checkpoint whose
    config.json has none: the tokens of the same weights with that scaling in config.json."""
    import shutil
    from client import LocalCluster
    plain = str(tmp_path / "plain")
    shutil.copytree(yarn_checkpoint, plain)
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_scaling")
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    hf = load_oracle(yarn_checkpoint, torch.float64)
    p = np.random.default_rng(8).integers(2, 96, 120).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                           pad_token_id=0)[0, len(p):].tolist()
    with LocalCluster(model=plain, workers=2, dtype="float64", extra_service_args=["--max-model-len", "9999"],
                      extra_worker_args=["--rope-scaling", json.dumps(YARN_QWEN)]) as c:
        assert c.client.generate(prompt_token_ids=p, max_new_tokens=10, ignore_eos=True).token_ids == want
        assert c.client.stats().max_model_len == 256   # a larger --max-model-len serves the model's context
        with pytest.raises(InvalidArgument, match="maximum context length is 256 tokens"):   # refused up front
            c.client.generate(prompt_token_ids=[5] * 250, max_new_tokens=10)


@pytest.mark.parametrize("flag, message", [
    ('{"rope_type": "dynamic", "factor": 2}', "--rope-scaling: rope type 'dynamic' is not supported"),
    ("yarn", "--rope-scaling: not valid JSON"),
])
def test_a_bad_rope_scaling_flag_is_one_line(flag, message):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "worker", "--model", "tiny", "--standalone", "--rope-scaling", flag],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "client", "serve", "tiny", "--rope-scaling", flag],
                       cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and message in r.stdout + r.stderr, (r.stdout, r.stderr)
