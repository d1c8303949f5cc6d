"""Model configuration shared by both planes: the embedded `tiny` Qwen3 and local checkpoints.

Only what the planes need is read: the shapes, RoPE, norm eps, tying and the EOS ids. Weights are
the worker's business (worker/weights.py)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# The embedded default: a small Qwen3 with a byte-level tokenizer (ids 0-255 are bytes).
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 256,
    "eos_token_id": 256,
}
TINY_SEED = 20260101


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    rope: dict = field(default_factory=dict)   # RoPE scaling ({}: none; see rope_scaling below)
    name: str = "tiny"
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict, name: str, source: str | None = None) -> "ModelConfig":
        """`source` names the file in error messages (default: `name`)."""
        check_fields(cfg, source or name)
        if cfg.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"{name}: model_type {cfg.get('model_type')!r} is not qwen3")
        key, rope = rope_field(cfg)
        if not isinstance(rope, dict):
            raise ValueError(f"{source or name}: field {key!r} must be a JSON object, got {rope!r}")
        theta = rope_theta(cfg)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,   # null too, as transformers
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            rope=rope_scaling(rope, cfg.get("max_position_embeddings", 32768), f"{source or name}: {key}",
                              cfg.get("original_max_position_embeddings")),
            name=name,
            raw=cfg,
        )

    @property
    def max_context(self) -> int:
        """The longest context served (positions 0 .. max_context - 1): max_position_embeddings, or
        what a RoPE scaling extends it to, as vLLM derives it (YaRN: original_max_position_embeddings
        x factor, Qwen3's 32,768 x 4; linear: max_position_embeddings x factor)."""
        kind = self.rope.get("rope_type", "default")
        if kind == "yarn":
            return int(self.rope["original_max_position_embeddings"] * self.rope["factor"])
        if kind == "linear":
            return int(self.max_position_embeddings * self.rope["factor"])
        return self.max_position_embeddings


ROPE_TYPES = ("default", "linear", "yarn")
_ROPE_POSITIVE = ("factor", "attention_factor")
_ROPE_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")   # 0 or null: transformers' default


def rope_field(cfg: dict) -> tuple[str, object]:
    """Where config.json keeps its RoPE parameters: `rope_scaling` first, as transformers reads it
    (a transformers-5 config also has `rope_parameters`, {"rope_type": "default", ...})."""
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key):
            return key, cfg[key]
    return "rope_scaling", {}


def rope_theta(cfg: dict) -> float:
    """RoPE's base, in transformers' order: the RoPE dict's, then config.json's top level, then 10000."""
    rope = rope_field(cfg)[1]
    return (rope.get("rope_theta") if isinstance(rope, dict) else None) or cfg.get("rope_theta") or 10000.0


def parse_rope_scaling(text: str) -> dict:
    """--rope-scaling's JSON (as vLLM's flag and Qwen3's model card write it), checked as config.json's
    would be: ValueError with the reason."""
    try:
        rope = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--rope-scaling: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rope, dict):
        raise ValueError(f"--rope-scaling: expected a JSON object, got {rope!r}")
    rope_scaling(rope, 1, "--rope-scaling")
    return rope


def _number(v, positive: bool) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 if positive else v >= 0)


def rope_scaling(rope: dict, max_positions: int, source: str, top_original=None) -> dict:
    """config.json's RoPE parameters (`source` names where they were read), checked and put in one
    form: {} for plain RoPE, else `rope_type` and its numbers (worker/rope.py computes with them).
    Dynamic NTK is refused: transformers recomputes it from each forward's longest sequence, which a
    server that batches many sequences cannot reproduce per request. `top_original` is config.json's
    top-level original_max_position_embeddings (Phi-3's layout): transformers lets it win over the
    RoPE dict's, and so do we."""
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {rope['partial_rotary_factor']!r} is not supported "
                         f"(Qwen3 rotates every dimension)")
    if kind == "default":
        return {}
    if "factor" not in rope:                     # transformers refuses it too (a required key)
        raise ValueError(f"{source}: rope type {kind!r} needs the field 'factor'")
    out = {"rope_type": kind}
    for key in _ROPE_POSITIVE + _ROPE_OPTIONAL:
        v = rope.get(key)
        if v is not None:
            if not _number(v, key in _ROPE_POSITIVE):
                raise ValueError(f"{source}: field {key!r} must be a {'positive' if key in _ROPE_POSITIVE else 'non-negative'} "
                                 f"number, got {v!r}")
            out[key] = float(v)
    original = top_original or rope.get("original_max_position_embeddings") or max_positions
    if not (_number(original, True) and float(original).is_integer()):
        raise ValueError(f"{source}: field 'original_max_position_embeddings' must be a positive integer, "
                         f"got {original!r}")
    if "factor" not in out:
        if kind == "linear":
            raise ValueError(f"{source}: rope type 'linear' needs a number in the field 'factor', got null")
        out["factor"] = max_positions / int(original)          # transformers' YaRN default for null
    if kind == "yarn":
        out["original_max_position_embeddings"] = int(original)
        if "truncate" in rope:
            out["truncate"] = bool(rope["truncate"])
    return out


REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
OPTIONAL_FLOATS = ("rms_norm_eps", "rope_theta")
# optional fields that may not be null (the required ones are checked as positive integers; a null
# num_key_value_heads or head_dim is derived, as transformers derives it)
NOT_NULL = ("max_position_embeddings", "rms_norm_eps")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(cfg, source: str) -> None:
    """One clear ValueError naming the file and the field, instead of a KeyError or a TypeError
    deep inside the model (a missing num_hidden_layers, hidden_size: "big")."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    for key in REQUIRED_INTS:
        if key not in cfg:
            raise ValueError(f"{source}: missing required field {key!r}")
    for key in REQUIRED_INTS + OPTIONAL_INTS:
        v = cfg.get(key)
        if (key in REQUIRED_INTS or v is not None) and not (_is_int(v) and v > 0):
            raise ValueError(f"{source}: field {key!r} must be a positive integer, got {v!r}")
    if quant := cfg.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ValueError(f"{source}: a quantized checkpoint ({method}) is not supported: its weights are "
                         f"integer codes this engine does not compute with; serve the unquantized weights")
    for key in NOT_NULL:            # present as null: transformers refuses these too
        if key in cfg and cfg[key] is None:
            raise ValueError(f"{source}: field {key!r} is null; give a number or leave the field out")
    rope = rope_field(cfg)[1]
    if cfg.get("rope_theta", 1) is None and not (isinstance(rope, dict) and rope.get("rope_theta")):
        raise ValueError(f"{source}: field 'rope_theta' is null and no rope_parameters give it")
    for key in OPTIONAL_FLOATS:
        v = cfg.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{source}: field {key!r} must be a positive number, got {v!r}")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ValueError(f"{source}: hidden_size ({cfg['hidden_size']}) is not a multiple of num_attention_heads "
                         f"({heads}), and no head_dim is given")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):            # one function, two names (transformers' ACT2FN)
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (Qwen3's MLP is SwiGLU: 'silu')")
    if sliding := _sliding_layers(cfg):
        raise ValueError(f"{source}: sliding-window attention ({sliding} layers of {cfg['num_hidden_layers']}: "
                         f"use_sliding_window, sliding_window {cfg.get('sliding_window')}) is not supported; "
                         f"every layer attends to the whole context (Qwen3's releases ship it off)")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (_is_int(eos) or (isinstance(eos, list) and all(_is_int(e) for e in eos))):
        raise ValueError(f"{source}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")


def _sliding_layers(cfg: dict) -> int:
    """How many layers transformers' Qwen3 would run with a sliding window (0 for every release)."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window", 4096)):   # transformers' defaults
        return 0
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return sum(t == "sliding_attention" for t in types)
    first = cfg.get("max_window_layers")
    return max(0, cfg["num_hidden_layers"] - (28 if first is None else first))


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None


WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")


def check_weights_present(model: str) -> None:
    """A checkpoint directory holds weights in one of the layouts worker/weights.py reads: cheap to
    check before anything is loaded, so a config-only directory is one line, not a traceback."""
    if model == "tiny":
        return
    if not any(os.path.isfile(os.path.join(model, f)) for f in WEIGHT_FILES):
        raise FileNotFoundError(f"{model}: no weights (expected one of {', '.join(WEIGHT_FILES)})")


def load_model_config(model: str, rope_scaling: dict | None = None) -> ModelConfig:
    """`tiny` or a local checkpoint directory holding config.json; `rope_scaling` (the workers'
    --rope-scaling) replaces what config.json says about RoPE scaling, its rope_theta kept."""
    if model == "tiny":
        cfg, path = TINY_CONFIG, "tiny"
    else:
        path = os.path.join(model, "config.json")
        if os.path.isdir(model) and not os.access(model, os.X_OK):   # (entering it is all we need)
            raise PermissionError(f"--model {model!r}: permission denied: this process (uid {os.getuid()}) cannot "
                                  f"enter that directory")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--model {model!r}: no config.json there (expected 'tiny' or a local "
                                    f"Hugging Face Qwen3 checkpoint directory)")
        cfg = read_json(path)
    if rope_scaling is not None and isinstance(cfg, dict):
        cfg = dict(cfg, rope_scaling=dict({"rope_theta": rope_theta(cfg)}, **rope_scaling))   # its own theta wins
    if model == "tiny":
        return ModelConfig.from_dict(cfg, "tiny")
    first = ModelConfig.from_dict(cfg, model, source=path)
    # generation_config.json may name more EOS ids (Qwen3 chat models do).
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = read_json(gen_path)
        gen_eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
        if gen_eos is not None:
            if not (_is_int(gen_eos) or (isinstance(gen_eos, list) and all(_is_int(e) for e in gen_eos))):
                raise ValueError(f"{gen_path}: field 'eos_token_id' must be an int or a list of ints, got {gen_eos!r}")
            cfg = dict(cfg, eos_token_id=sorted(set(([gen_eos] if _is_int(gen_eos) else gen_eos)
                                                    + first.eos_token_ids)))
            return ModelConfig.from_dict(cfg, model, source=path)
    return first


def layer_params(c: ModelConfig) -> int:
    """Weights of one decoder layer (attention projections and the MLP; norms are noise)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size


def lm_head_layers(c: ModelConfig) -> float:
    """The lm_head's weights in layers' worth: what the last pipeline stage reads beside its layers
    on every decode step (3.2 layers at Qwen3-8B, 9.9 at 0.6B, 0.13 at tiny)."""
    return c.vocab_size * c.hidden_size / layer_params(c)


def shape_signature(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> str:
    """The model's shapes as one comparable line: the service builds it from what the workers
    register, the gateway from the config.json its --model names (StatsReply.model_shape)."""
    return (f"vocab {vocab_size}, hidden {hidden_size}, {num_layers} layers, {num_heads} heads / "
            f"{num_kv_heads} KV heads of {head_dim}")


def config_shape(cfg: ModelConfig) -> str:
    return shape_signature(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                           cfg.num_key_value_heads, cfg.head_dim)
