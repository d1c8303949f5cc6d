"""Weights: the embedded `tiny` model's deterministic random weights, and loading only the tensors
one pipeline stage needs from a local Hugging Face Qwen3 checkpoint.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`, ...) everywhere, so
`Qwen3ForCausalLM.load_state_dict(tiny_state_dict(cfg))` builds the very same model in transformers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings

import torch

from minipaged.config import TINY_SEED, ModelConfig

log = logging.getLogger("worker.weights")

_LAYER_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model, in the (fixed) order tiny_state_dict draws them."""
    H, D = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * D, config.num_key_value_heads * D, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        dims = {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
                "self_attn.o_proj": (H, q), "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H),
                "mlp.down_proj": (H, inter)}
        for name in _LAYER_MATRICES:
            shapes[p + name + ".weight"] = dims[name]
            if config.attention_bias and name.startswith("self_attn"):
                shapes[p + name + ".bias"] = dims[name][:1]
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            shapes[p + norm + ".weight"] = (D,)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, H)
    return shapes


def tiny_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    """float32, on CPU, from torch.Generator().manual_seed(TINY_SEED) drawn in param_shapes order:
    N(0, 0.02) for matrices and embeddings, ones for norm weights, zeros for biases."""
    gen = torch.Generator().manual_seed(TINY_SEED)
    out = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * 0.02
    return out


_BASE_MODEL_NAMES = ("embed_tokens.", "layers.", "norm.")


def hf_name(name: str) -> str:
    """A bare Qwen3Model export (AutoModel / sentence-transformers save_pretrained) names its
    tensors without the causal LM's "model." prefix; transformers loads both, and so do we."""
    return "model." + name if name.startswith(_BASE_MODEL_NAMES) else name


def stage_needs(name: str, config: ModelConfig, layer_start: int, layer_end: int) -> bool:
    """Is this checkpoint tensor used by the stage serving layers [layer_start, layer_end)?"""
    last = layer_end == config.num_hidden_layers
    if name.startswith("model.layers."):
        index = name.split(".")[2]
        if not index.isdigit():
            raise ValueError(f"{name}: not a layer tensor name (model.layers.<index>...)")
        return layer_start <= int(index) < layer_end
    if name == "model.embed_tokens.weight":
        return layer_start == 0 or (last and config.tie_word_embeddings)
    if name in ("model.norm.weight", "lm_head.weight"):
        return last and not (name == "lm_head.weight" and config.tie_word_embeddings)
    return False


def _checkpoint_files(path: str) -> list[str]:
    """Weight files of a checkpoint directory: sharded or single safetensors, else pytorch .bin."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        if os.path.isfile(os.path.join(path, single)):
            return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


def _header(f, full: str) -> tuple[int, dict]:
    """(where the data starts, the tensor entries) of an open safetensors file, checked: a file
    too short or truncated is a ValueError naming it."""
    import struct
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{full}: not a safetensors file ({size} bytes, shorter than its header's length)")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise ValueError(f"{full}: a {n}-byte header in a {size}-byte file (truncated?)")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise ValueError(f"{full}: its header is not JSON ({e})") from None
    header.pop("__metadata__", None)
    return 8 + n, header


def _safetensors_tensors(full: str, want):
    """(name, tensor) for each wanted tensor of one safetensors file, one at a time, straight off a
    memory map of the file. Each tensor is a view of the map, valid until the next one is yielded:
    then its pages are dropped (MADV_DONTNEED), so the file's pages never pile up in this process's
    resident memory (a 1.2 GB shard read through safe_open stays resident until it is closed)."""
    import mmap
    size = os.path.getsize(full)
    with open(full, "rb") as f:
        base, header = _header(f, full)
        if not header:
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        page = mmap.PAGESIZE
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):  # file order
            if not want(name):
                continue
            lo, hi = (base + o for o in meta["data_offsets"])
            if hi > size:
                raise ValueError(f"{full}: {name} ends at byte {hi}, past the file's {size} (truncated?)")
            dtype = _ST_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ValueError(f"{full}: {name} has dtype {meta['dtype']}, which this loader cannot read")
            with warnings.catch_warnings():  # read-only map: the consumer copies, never writes
                warnings.simplefilter("ignore", UserWarning)
                t = (torch.frombuffer(mm, dtype=dtype, offset=lo, count=(hi - lo) // dtype.itemsize)
                     if hi > lo else torch.empty(0, dtype=dtype))
            yield name, t.view(meta["shape"])
            del t
            start = lo // page * page
            if hasattr(mm, "madvise") and hi > start:
                mm.madvise(mmap.MADV_DONTNEED, start, hi - start)
    finally:
        try:
            mm.close()
        except BufferError:  # a consumer kept a view: the map goes when that view does
            pass


def tensor_names(path: str) -> set[str]:
    """Every tensor name of a safetensors checkpoint directory (headers only; empty for .bin ones)."""
    names: set[str] = set()
    for fname in _checkpoint_files(path):
        if fname.endswith(".safetensors"):
            full = os.path.join(path, fname)
            with open(full, "rb") as f:
                names.update(hf_name(n) for n in _header(f, full)[1])
    return names


def iter_tensors(path: str, want, log_every_s: float = 5.0):
    """(name, tensor) for every tensor of a checkpoint directory that want(name) accepts, one at a
    time (see _safetensors_tensors: a tensor is only valid until the next is yielded). Logs
    progress (bytes read) every log_every_s seconds and the total at the end: a large checkpoint
    takes minutes, and a silent worker looks hung."""
    files = _checkpoint_files(path)
    wanted = want
    want = lambda raw: wanted(hf_name(raw))  # noqa: E731  (the names yielded are hf_name's too)
    total = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    done, t0, last = 0, time.monotonic(), time.monotonic()
    for i, fname in enumerate(files):
        full = os.path.join(path, fname)
        if fname.endswith(".safetensors"):
            for name, t in _safetensors_tensors(full, want):
                yield hf_name(name), t
                done += t.numel() * t.element_size()
                if time.monotonic() - last >= log_every_s:
                    last = time.monotonic()
                    log.info("loading weights: %.0f MB read (file %d/%d, %.0f MB in all), %.1f s",
                             done / 1e6, i + 1, len(files), total / 1e6, last - t0)
        else:
            # mmap: only the pages of the tensors we keep are read.
            sd = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
            for name in [k for k in sd if want(k)]:
                t = sd.pop(name)
                yield hf_name(name), t
                done += t.numel() * t.element_size()
            del sd
    log.info("weights loaded: %.0f MB of tensors from %d file(s) in %.1f s", done / 1e6, len(files),
             time.monotonic() - t0)


def _read_tensors(path: str, want) -> dict[str, torch.Tensor]:
    """The tensors whose name satisfies want(name), as tensors of their own (copies of the map)."""
    return {name: t.clone() for name, t in iter_tensors(path, want, log_every_s=float("inf"))}


def load_state_dict(model: str, config: ModelConfig, layer_start: int,
                    layer_end: int) -> dict[str, torch.Tensor]:
    """The tensors of layers [layer_start, layer_end) (+ embeddings / final norm / lm_head as the
    stage's position needs), from "tiny" or a local checkpoint directory."""
    want = lambda name: stage_needs(name, config, layer_start, layer_end)  # noqa: E731
    if model == "tiny":
        return {k: v for k, v in tiny_state_dict(config).items() if want(k)}
    return _read_tensors(model, want)


def stream_state(model: str, config: ModelConfig, layer_start: int, layer_end: int):
    """What load_state_dict returns, as (name, tensor) pairs one at a time (see iter_tensors), for
    loading straight into a model's parameters without holding a second copy of the weights."""
    want = lambda name: stage_needs(name, config, layer_start, layer_end)  # noqa: E731
    if model == "tiny":
        return iter(load_state_dict(model, config, layer_start, layer_end).items())
    return iter_tensors(model, want)


def _probe_names(config: ModelConfig) -> list[str]:
    last = config.num_hidden_layers - 1
    names = ["model.embed_tokens.weight", f"model.layers.{last}.mlp.down_proj.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    return names + ([] if config.tie_word_embeddings else ["lm_head.weight"])


def fingerprint(config: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None,
                known: dict | None = None) -> str:
    """Identity of (config, weights) that every stage of one model computes identically.

    Decision: the stage's own state_dict is NOT hashed (stages hold disjoint tensors). Instead every
    stage reads the same few probe tensors of the WHOLE model (the embedding, the first and last
    layer's matrices, the final norm, an untied lm_head) straight from the source: re-generated for
    "tiny", read lazily from the checkpoint files otherwise (safetensors reads just those tensors).
    Their float64 sums and sums of squares, plus the config's shape fields, go into a sha256.
    Different weights change these sums unless the checkpoints differ only outside the probes.
    `known`: probe sums already taken while loading (tap_probes); only the others are read."""
    shape_fields = {k: getattr(config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
        "attention_bias")}
    if config.rope:                       # only when set: plain-RoPE fingerprints stay as they were
        shape_fields["rope"] = config.rope
    names = set(_probe_names(config))
    sums = {k: v for k, v in (known or {}).items() if k in names}
    want = lambda n: n in names and n not in sums  # noqa: E731
    if config.name == "tiny":
        probes = ((k, v) for k, v in tiny_state_dict(config).items() if want(k))
    else:  # streamed, summed in row chunks: no float64 copy of a 151,936-row embedding
        probes = iter_tensors(config.name, want, log_every_s=float("inf")) if names - sums.keys() else ()
    for name, t in probes:
        sums[name] = probe_sums(t)
    h = hashlib.sha256(json.dumps(shape_fields, sort_keys=True).encode())
    for name in sorted(sums):
        shape, s1, s2 = sums[name]
        h.update(f"{name}:{shape}:{s1:.12e}:{s2:.12e}".encode())
    if config.name != "tiny":
        _hash_samples(config.name, h)
    return h.hexdigest()[:16]


def _hash_samples(path: str, h, window: int = 64) -> None:
    """Every safetensors tensor's name, dtype, shape and three windows of its bytes (start, middle,
    end) into `h`: a fine-tune that changed only some matrices (a merged LoRA's v_proj) changes them,
    where the probe sums see only the probes. A few reads per tensor, the same on every stage."""
    samples: dict[str, bytes] = {}       # by name: one file or many shards hash the same
    for fname in _checkpoint_files(path):
        if not fname.endswith(".safetensors"):
            continue
        full = os.path.join(path, fname)
        with open(full, "rb") as f:
            base, header = _header(f, full)
            for name, meta in header.items():
                lo, hi = (base + o for o in meta["data_offsets"])
                parts = [f"{name}:{meta['dtype']}:{meta['shape']}".encode()]
                for at in sorted({lo, max(lo, (lo + hi) // 2 - window // 2), max(lo, hi - window)}):
                    f.seek(at)
                    parts.append(f.read(min(window, hi - at)))
                samples[name] = b"".join(parts)
    for name in sorted(samples):
        h.update(samples[name])


def probe_sums(t: torch.Tensor) -> tuple[tuple[int, ...], float, float]:
    """(shape, float64 sum, float64 sum of squares) of one probe tensor, in row chunks."""
    flat = t.reshape(t.shape[0] if t.dim() else 1, -1)
    s1 = s2 = 0.0
    for lo in range(0, flat.shape[0], 8192):
        c = flat[lo:lo + 8192].to(torch.float64)
        s1, s2 = s1 + c.sum().item(), s2 + c.square().sum().item()
    return tuple(t.shape), s1, s2


def tap_probes(config: ModelConfig, pairs, out: dict):
    """Pass (name, tensor) pairs through, noting the probe sums of those that are probes (so a
    stage that loads them need not read them again for its fingerprint)."""
    names = set(_probe_names(config))
    for name, t in pairs:
        if name in names:
            out[name] = probe_sums(t)
        yield name, t
