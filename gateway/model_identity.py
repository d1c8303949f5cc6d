"""Which model the gateway speaks for, checked against the one the workers serve.

`--model` names what the workers load so the gateway can read its tokenizer, chat template and
context here. Trusting it blindly advertised the wrong name and max_model_len (issue 21), so:

- at start, `--model` must be `tiny` or a readable checkpoint with a valid config.json (else the
  gateway exits with one line naming the file and field);
- every Stats reply is compared with it: the service reports the served model's path, its shapes
  (StatsReply.model_shape, from what the workers registered) and its fingerprint. Different shapes
  mean another model: generation requests are refused (503, naming both) and /health says why.
  Same shapes at another path are allowed with a warning (the gateway has no torch to hash the
  weights; the fingerprint is logged so they can be compared);
- without `--model` the gateway takes the served model from the service: its name, its
  max_model_len, and, when the path is readable here (one host, or a shared models volume), its
  tokenizer and chat template.
max_model_len is always the service's once it reports one: that is the limit it enforces."""
from __future__ import annotations

import os

from minipaged.config import ModelConfig, config_shape, load_model_config


def check_model_arg(model: str | None) -> ModelConfig | None:
    """The --model config, or raises ValueError / OSError with one line (the gateway refuses to start)."""
    if not model:
        return None
    if model != "tiny" and not os.path.isdir(model):
        raise FileNotFoundError(f"--model {model}: no such directory here (give 'tiny', a checkpoint directory "
                                f"readable by the gateway, or leave --model out to take the model from the service)")
    return load_model_config(model)


def same_path(a: str, b: str) -> bool:
    if a == b:
        return True
    if "tiny" in (a, b):
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def readable_checkpoint(path: str) -> bool:
    return path == "tiny" or os.path.isfile(os.path.join(path, "config.json"))


def mismatch(model: str, cfg: ModelConfig | None, stats) -> str | None:
    """Why `--model` is not the model the service serves, or None (also while it serves none yet)."""
    served, served_shape = getattr(stats, "model", ""), getattr(stats, "model_shape", "")
    if not served or cfg is None or not served_shape:
        return None
    ours = config_shape(cfg)
    if ours != served_shape:
        return (f"gateway --model {model} ({ours}) is not the model the workers serve: {served} ({served_shape}); "
                f"restart the gateway with --model {served}, or without --model to take it from the service")
    return None


def path_warning(model: str, stats) -> str | None:
    """Same shapes, another path: probably a copy, but the weights cannot be compared here."""
    served = getattr(stats, "model", "")
    if not served or same_path(model, served):
        return None
    return (f"gateway --model {model} and the workers' {served} are different paths with the same shapes; "
            f"the gateway cannot compare weights (workers' fingerprint {getattr(stats, 'model_fingerprint', '')})")
