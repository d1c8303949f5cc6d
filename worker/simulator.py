"""A simulated GPU for measuring scale without GPUs (`python -m worker --simulate h200|PROFILE.json`).

`SimRunner` replaces the ModelRunner and nothing else: the worker process still registers, serves
InitCache/Step/StepStream over the real RPCs, validates every Step and forwards hidden-state-sized
payloads to the next stage. It loads no weights and computes nothing: each step sleeps (never
spins, so many simulated workers share two cores) for the time a roofline model of this stage's
layer range gives, then returns deterministic pseudo-random tokens. Dynamo's "mocker" engine is the
precedent; what this measures is the real host side: scheduler, block manager, wire, processes.

The device is asynchronous, as a GPU is: a step occupies the simulated device from when it is
queued (or when the previous step ends) for the model's time, and the worker prepares the next step
on the CPU meanwhile; replies and forwarded hidden states leave when the device is done.

Timing model (one step of T query tokens over B sequences with context lengths ctx_b, on the stage's
L layers; all byte counts in the model dtype):
    weight bytes   W   = L * P_layer * bytes  (+ lm_head on the last stage, + T embedding rows on the first)
    K/V read bytes R   = L * kv_tok * sum_b ctx_b        (attention reads each context once)
    K/V write      Wr  = L * kv_tok * T                  (kv_tok = 2 * kv_heads * head_dim * bytes)
    FLOPs          F   = 2 * T * L * P_layer + 2 * S * vocab * hidden (last stage, S sampled rows)
                         + L * 4 * heads * head_dim * sum_b q_b * (ctx_b - q_b / 2)   (causal attention)
    step seconds   t   = step_overhead + L * layer_overhead
                         + max((W + R + Wr) / (bandwidth * bandwidth_efficiency), F / (peak_flops * flops_efficiency))
KV tier moves (saves device -> host, loads host -> device, each way at `host_link`) run on their
own copy engine beside the compute, layer by layer: the step takes max(compute, copies) plus one
layer's share of the copies (the first layer's loads cannot overlap anything).
A prefill -> decode move (a step with no rows) reads its blocks at `kv_link` on the link's own
timeline, beside the compute, as the real worker's PullQueue does: it ends blocks * block bytes /
kv_link after the steps sent before it (and the moves before it on the link).
A profile may instead fix the step time (`fixed_step_s`). Capacity: the K/V budget is
memory_bytes * memory_fraction - W_stage (this stage's weights), like vLLM's gpu_memory_utilization.

Tokens: a hash (splitmix64) of (the request's seed when it samples, else 0; the position; the last
input token). Stage 0 writes the input ids into the first bytes of the hidden-state payload so the
last stage can see them; the same request always gets the same tokens, never an EOS id."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from minipaged.config import ModelConfig, load_model_config
from minipaged.constants import DTYPE_BYTES, kv_bytes_per_block
from minipaged.rng import splitmix64


@dataclass
class Profile:
    name: str = "h200"
    memory_bytes: float = 141e9          # H200: 141 GB HBM3e (NVIDIA H200 datasheet)
    bandwidth: float = 4.8e12            # 4.8 TB/s HBM bandwidth (datasheet)
    peak_flops: float = 989e12           # ~989 TFLOP/s dense BF16 (datasheet: 1979 with sparsity)
    bandwidth_efficiency: float = 0.8    # what good kernels reach of peak bandwidth (decode is ~70-85%)
    flops_efficiency: float = 0.6        # achieved MFU of large prefill GEMMs
    step_overhead_s: float = 300e-6      # per step: launches, sampler, host sync (CUDA-graph decode: less)
    layer_overhead_s: float = 10e-6      # per layer: ~10 kernel launches that are not hidden
    memory_fraction: float = 0.9         # share of memory for weights + K/V (vLLM's default 0.9)
    fixed_step_s: float = 0.0            # > 0: every step takes exactly this long (no roofline)
    host_link: float = 55e9              # KV tier <-> device, bytes/s each way (PCIe Gen5 x16, ~55 GB/s achievable)
    kv_link: float = 50e9                # prefill -> decode K/V moves, bytes/s (one 400 Gb/s NIC per GPU)


BUILTIN = {"h200": Profile()}


def load_profile(spec: str) -> Profile:
    """'h200' or a JSON file with any of Profile's fields (the rest keep the h200 values)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if not os.path.isfile(spec):
        raise ValueError(f"--simulate {spec!r}: not a built-in profile ({', '.join(BUILTIN)}) nor a JSON file")
    try:
        with open(spec) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:        # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError(f"--simulate {spec}: not a readable JSON profile ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--simulate {spec}: a profile is a JSON object of Profile's fields")
    known = {f.name for f in fields(Profile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{spec}: unknown profile keys {sorted(unknown)} (known: {sorted(known)})")
    return Profile(**{**asdict(Profile()), "name": os.path.basename(spec), **data})


class TimingModel:
    def __init__(self, profile: Profile, config: ModelConfig, layer_start: int, layer_end: int, dtype_bytes: int):
        c, b = config, dtype_bytes
        self.profile, self.layers = profile, layer_end - layer_start
        self.is_first, self.is_last = layer_start == 0, layer_end == c.num_hidden_layers
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.params_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
        self.head_params = c.vocab_size * c.hidden_size if self.is_last else 0
        self.embed_params = c.vocab_size * c.hidden_size if self.is_first else 0
        self.weight_bytes = (self.layers * self.params_layer + self.head_params + self.embed_params) * b
        self.kv_heads, self.head_dim = c.num_key_value_heads, c.head_dim
        self.kv_tok = kv_bytes_per_block(1, c.num_key_value_heads, c.head_dim, 1, b)   # one layer, one token
        self.attn_flops = 4 * c.num_attention_heads * c.head_dim
        self.hidden, self.vocab, self.bytes = c.hidden_size, c.vocab_size, b

    def step_seconds(self, q_lens: np.ndarray, seq_lens: np.ndarray, num_sampled: int) -> float:
        p = self.profile
        if p.fixed_step_s > 0:
            return p.fixed_step_s
        T = int(q_lens.sum())
        ctx = seq_lens.astype(np.float64)
        moved = ((self.layers * self.params_layer + self.head_params) * self.bytes + T * self.hidden * self.bytes
                 + self.layers * self.kv_tok * (ctx.sum() + T))
        flops = (2.0 * T * self.layers * self.params_layer + 2.0 * num_sampled * self.head_params
                 + self.layers * self.attn_flops * float((q_lens * (ctx - q_lens / 2.0)).sum()))
        roof = max(moved / (p.bandwidth * p.bandwidth_efficiency), flops / (p.peak_flops * p.flops_efficiency))
        return p.step_overhead_s + self.layers * p.layer_overhead_s + roof

    def copy_seconds(self, saved: int, loaded: int, block_size: int) -> float:
        """KV tier moves of one step: each direction at the host link's bandwidth, both at once."""
        return max(saved, loaded) * self.layers * self.kv_tok * block_size / self.profile.host_link

    def kv_budget_bytes(self) -> int:
        return max(0, int(self.profile.memory_bytes * self.profile.memory_fraction - self.weight_bytes))


class _NoCache:
    """Block copies (copy-on-write) have no data to move in a simulation; tier moves only take time
    (SimRunner.execute reads and clears `moved`)."""
    tier_slots = 0

    def __init__(self):
        self.moved = (0, 0)      # (saved, loaded) blocks of the step about to run

    def copy_blocks(self, src, dst) -> None:
        pass

    def attach_tier(self, num_slots: int) -> None:
        self.tier_slots = num_slots

    def tier_moves(self, save_blocks, save_slots, load_slots, load_blocks) -> None:
        self.moved = (len(save_blocks), len(load_blocks))

    def read_blocks(self, ids) -> bytes:
        return b""                # no content: the reading stage times the bytes it would move

    def write_blocks(self, ids, data) -> None:
        pass                      # SimRunner.pull_ready_at times the bytes


@dataclass
class SimBatch:
    input_ids: np.ndarray | None
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


@dataclass
class SimHidden:
    input_ids: np.ndarray      # int32 [T]: carried to the last stage for the token hash
    positions: np.ndarray
    payload: bytes | None = None   # the bytes received from the previous stage (passed on as they are)


class SimRunner:
    supports_extras = True  # penalties and the like only change which token: the hash ignores them

    def __init__(self, model: str, layer_start: int, layer_end: int, dtype: str, profile: Profile,
                 rope_scaling: dict | None = None):
        self.config = load_model_config(model, rope_scaling)
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = layer_start == 0, layer_end == self.config.num_hidden_layers
        self.dtype_name, self.bytes = dtype, DTYPE_BYTES[dtype]
        self.timing = TimingModel(profile, self.config, layer_start, layer_end, self.bytes)
        self.weight_bytes = self.timing.weight_bytes
        self.host_link, self.peak_flops = profile.host_link, profile.peak_flops * profile.flops_efficiency
        # never the fingerprint of real weights: simulated and real workers cannot share a chain
        key = json.dumps([asdict(self.config), "simulated", dtype], sort_keys=True, default=str)
        self.fingerprint = "sim-" + hashlib.sha256(key.encode()).hexdigest()[:24]
        self.eos = np.asarray(sorted(set(self.config.eos_token_ids)), dtype=np.int64)
        self.kv_cache = None
        self.busy_s = 0.0
        # The simulated device runs asynchronously, like a GPU: execute() queues the step on its
        # timeline and returns; its results exist at ready_at. The server holds the reply (and the
        # forwarded hidden states) until then, while it already prepares the next step.
        self.ready_at = 0.0
        self.link_free_at = 0.0   # the K/V link's own timeline (prefill -> decode moves)
        self.last_step_s = 0.0
        self._zeros = b""

    def kv_bytes_per_block(self, block_size: int) -> int:
        t = self.timing
        return kv_bytes_per_block(t.layers, t.kv_heads, t.head_dim, block_size, t.bytes)

    def init_cache(self, num_blocks: int, block_size: int):
        self.kv_cache = _NoCache()   # nothing is allocated: the capacity is only bookkeeping
        self.block_size = block_size
        return self.kv_cache

    def make_batch(self, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables) -> SimBatch:
        return SimBatch(None if input_ids is None else np.asarray(input_ids), np.asarray(positions),
                        np.asarray(query_start_loc), np.asarray(seq_lens))

    def execute(self, batch: SimBatch, hidden_in: SimHidden | None = None) -> SimHidden:
        q_lens = np.diff(batch.query_start_loc)
        sampled = len(q_lens) if self.is_last else 0
        t = self.timing.step_seconds(q_lens, batch.seq_lens, sampled)
        if self.kv_cache is not None and any(self.kv_cache.moved):
            copy = self.timing.copy_seconds(*self.kv_cache.moved, self.block_size)
            t = max(t, copy) + copy / max(self.timing.layers, 1)
            self.kv_cache.moved = (0, 0)
        self.ready_at = max(time.monotonic(), self.ready_at) + t   # waited for by sleeping, never spinning
        self.last_step_s = t
        self.busy_s += t
        if hidden_in is not None:
            return SimHidden(hidden_in.input_ids, batch.positions, hidden_in.payload)
        return SimHidden(np.asarray(batch.input_ids, dtype=np.int32), batch.positions)

    def pull_ready_at(self, blocks: int, after: float) -> float:
        """When a K/V move of `blocks` blocks is in: its bytes over the K/V link, once the steps sent
        before it have run and the link has finished the moves before it. The NIC writes the device
        memory beside the compute (its ~1% of HBM bandwidth at 50 GB/s is not modelled)."""
        t = blocks * self.kv_bytes_per_block(self.block_size) / self.timing.profile.kv_link
        self.link_free_at = max(time.monotonic(), after, self.link_free_at) + t
        return self.link_free_at

    def encode_hidden(self, hidden: SimHidden) -> tuple[bytes | tuple, str]:
        """The size real hidden states have: the input ids, then zeros (a later stage passes the
        received bytes on unchanged: no copy)."""
        if hidden.payload is not None:
            return hidden.payload, self.dtype_name
        T = len(hidden.input_ids)
        tail = T * self.config.hidden_size * self.bytes - 4 * T
        if len(self._zeros) < tail:
            self._zeros = bytes(max(tail, 2 * len(self._zeros)))
        # two parts, sent one after the other: the zeros are shared and never change
        return (hidden.input_ids.astype("<i4").tobytes(), memoryview(self._zeros)[:tail]), self.dtype_name

    def decode_hidden(self, data: bytes, dtype: str, num_tokens: int) -> SimHidden:
        return SimHidden(np.frombuffer(data, dtype="<i4", count=num_tokens), None, data)

    def sample(self, hidden: SimHidden, query_start_loc, do_sample, temperature, top_p, top_k, seeds, offsets,
               return_logprobs=False, return_logits=False, extras=None):
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        mask = np.asarray(do_sample).astype(bool)
        rows = qsl[1:][mask] - 1
        toks = np.asarray(hidden.input_ids, dtype=np.int64)[rows]
        pos = np.asarray(hidden.positions, dtype=np.int64)[rows] if hidden.positions is not None else rows
        seed = np.where(np.asarray(temperature)[mask] > 0, np.asarray(seeds, dtype=np.int64)[mask], 0)
        h = splitmix64(splitmix64(seed.astype(np.uint64))
                       ^ splitmix64(pos.astype(np.uint64) * np.uint64(1 << 20) + toks.astype(np.uint64)))
        ids = (h % np.uint64(self.config.vocab_size)).astype(np.int64)
        for _ in range(len(self.eos)):  # step over EOS ids so simulated outputs run to their length
            hit = np.zeros(ids.size, dtype=bool)
            for e in self.eos.tolist():   # one compare per EOS id (np.isin sorts: 10x the cost here)
                hit |= ids == e
            ids = np.where(hit, (ids + 1) % self.config.vocab_size, ids)
        if extras is not None and extras.grammar_rows is not None:  # structured outputs: an allowed token
            ids = _grammar_pick(ids, (np.cumsum(mask) - 1)[extras.grammar_rows], extras.grammar_bitmask,
                                self.config.vocab_size)
        n = len(ids)
        logprobs = np.full(n, -1.0, dtype=np.float32) if return_logprobs else None
        top = None
        if extras is not None and extras.top_logprobs:
            k = extras.top_logprobs
            top = (np.repeat(ids[:, None], k, axis=1).astype(np.int32), np.full((n, k), -1.0, dtype=np.float32))
        return ids.astype(np.int32), logprobs, None, top


def _grammar_pick(ids: np.ndarray, rows: np.ndarray, bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """The first allowed token at or after the hashed one (cyclic), per constrained row."""
    ids = ids.copy()
    ok = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    for r, row_ok in zip(rows.tolist(), ok):
        allowed = np.flatnonzero(row_ok)
        if allowed.size:
            ids[r] = allowed[np.searchsorted(allowed, ids[r]) % allowed.size]
    return ids
