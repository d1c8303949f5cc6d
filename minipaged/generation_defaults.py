"""The server's sampling defaults: what a request's unset sampling fields take (the gateway applies
them, gateway/openai_requests.py; `minipaged serve` checks its flags here before starting anything).

vLLM's OpenAI server (`--generation-config auto`, its default) takes them from the checkpoint's
generation_config.json, so a Qwen3 checkpoint served with no sampling fields in the request samples
with temperature 0.6, top_p 0.95, top_k 20, as its model card recommends. We do the same, with
vLLM's flags and rules:
  - `--generation-config auto`: the `--model` directory's generation_config.json (or, without
    `--model`, the served model's, when its path is readable here); `vllm`: none (OpenAI's neutral
    defaults: temperature 1, no top-p / top-k / penalties); a directory: its generation_config.json;
  - `--override-generation-config JSON`: merged over that (`vllm` included);
  - the fields: temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, and max_new_tokens (the default max_tokens of a chat request, within the context; a
    completion's default stays 16, as in vLLM). Every one the file sets (not null) counts, whatever
    its value, and do_sample is not read (vLLM's rule too: transformers 5 has no defaults to diff
    against);
  - a field the request sets wins; beam search requests keep their own rule (an unset temperature
    is 0: beam search is greedy here).
A value out of its range (the service's: temperature >= 0, top_p in (0, 1], top_k >= -1, min_p in
[0, 1], repetition_penalty > 0, presence / frequency penalties in [-2, 2], max_new_tokens >= 1) is
refused at start with one line, rather than every request it would reach answering 400.
"""
from __future__ import annotations

import json
import math
import os

from minipaged.config import read_json

# field -> (type, the range the service accepts, that range in words)
FIELDS = {"temperature": (float, lambda v: v >= 0, ">= 0"),
          "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
          "top_k": (int, lambda v: -1 <= v < 2**31, "in [-1, 2^31), -1 or 0 = off"),
          "repetition_penalty": (float, lambda v: v > 0, "> 0"),
          "presence_penalty": (float, lambda v: -2 <= v <= 2, "in [-2, 2]"),
          "frequency_penalty": (float, lambda v: -2 <= v <= 2, "in [-2, 2]"),
          "min_p": (float, lambda v: 0 <= v <= 1, "in [0, 1]"),
          "max_new_tokens": (int, lambda v: 1 <= v < 2**31, "in [1, 2^31)")}
SOURCES = ("auto", "vllm")   # or a directory holding generation_config.json


def _read(directory: str) -> dict:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        raw = read_json(path)       # (bad JSON or text: a ValueError naming the file)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def _checked(raw: dict, where: str) -> dict:
    """The sampling fields of `raw`, typed; a wrong type or value is a ValueError naming it."""
    out = {}
    for name, (kind, in_range, range_text) in FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not math.isfinite(value):        # (JSON's Infinity / NaN parse as floats)
            raise ValueError(f"{where}: {name} must be finite, got {value!r}")
        if kind is int and value != int(value):
            raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
        value = kind(value)
        out[name] = value
        if not in_range(value):
            raise ValueError(f"{where}: {name} {value} is out of range ({range_text})")
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def parse_override(text: str | None) -> dict:
    """--override-generation-config: a JSON object (empty or None: no override)."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("--override-generation-config: expected a JSON object, e.g. '{\"temperature\": 0.7}'")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown field(s) {', '.join(unknown)} "
                         f"(known: {', '.join(FIELDS)})")
    return raw


def load(source: str, model: str | None, override: dict | None = None) -> dict:
    """The defaults for requests (request-field names: max_tokens, not max_new_tokens). `model`:
    the checkpoint directory the workers load (None or 'tiny': no file). Raises ValueError with one
    line for a bad file, source or override."""
    if source == "vllm":
        raw = {}
        where = "--override-generation-config"
    elif source == "auto":
        readable = model and model != "tiny" and os.path.isdir(model)
        raw = _read(model) if readable else {}
        where = os.path.join(model, "generation_config.json") if readable else "--override-generation-config"
    elif os.path.isdir(source):
        raw, where = _read(source), os.path.join(source, "generation_config.json")
    else:
        raise ValueError(f"--generation-config {source!r}: expected auto, vllm or a directory holding "
                         f"generation_config.json")
    override = override or {}       # checked on its own: its errors are the flag's, not the file's
    mine = _checked({k: v for k, v in raw.items() if k not in override}, where)
    return {**mine, **_checked(override, "--override-generation-config")}


def describe(defaults: dict, source: str, override: dict | None = None) -> str:
    """One log line: what unset request fields take, and where each came from."""
    if not defaults:
        return "sampling defaults: OpenAI's (temperature 1, no top-p / top-k / penalties)"
    override = override or {}
    origin = "generation_config.json" if source == "auto" else source
    parts = []
    for label, keys in ((origin, [k for k in defaults if k not in override]),
                        ("--override-generation-config", [k for k in defaults if k in override])):
        if keys:
            parts.append(f"{', '.join(f'{k} {defaults[k]}' for k in keys)} (from {label})")
    hint = "" if source == "vllm" else "; --generation-config vllm for OpenAI's"
    return f"sampling defaults for unset request fields: {'; '.join(parts)}{hint}"
