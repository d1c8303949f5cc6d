"""ModelRunner: one stage's model, weights, K/V cache and sampler behind a small API that the
worker's Step handler drives. It keeps no per-sequence state (docs/architecture.md section 1)."""
from __future__ import annotations

import logging
import os
import time
import warnings

import numpy as np
import torch

from minipaged.config import ModelConfig, load_model_config
from worker import cpu_gemm, logits_processors, prompt_logprobs as plp, sampler
from worker.layers import cpu_bf16_mode
from worker.model import Qwen3Stage, StepBatch
from worker.paged_cache import PagedKVCache, as_dtype, bytes_per_block
from worker.dtype_choice import checkpoint_dtype, resolve_dtype
from worker.weights import fingerprint, stream_state, tap_probes

log = logging.getLogger("worker.model_runner")


def _tensor(arr, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """numpy (possibly a read-only view of wire bytes) -> device tensor, copying only when the
    dtype or device requires it."""
    if isinstance(arr, torch.Tensor):
        return arr.to(device=device, dtype=dtype)
    arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():      # read-only wire buffers: we never write through them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.to(device=device, dtype=dtype, non_blocking=True)


def cpu_compute_threads() -> int:
    """The intra-op thread count we recommend for one CPU worker: MINIPAGED_CPU_THREADS, else
    OMP_NUM_THREADS when set, else every core this process may use but one, which is left to the
    serving side (gRPC, the metadata service, other stages): vLLM's CPU default too. On a 2-core
    machine that is 1, and it matters most when the cores are shared: two OpenMP threads whose
    partner is descheduled wait at every op's barrier (a 64-sequence decode step measured 33 ms
    with 1 thread, 100-500 ms with 2, on this machine under other jobs' load)."""
    for var in ("MINIPAGED_CPU_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").strip().isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


class ModelRunner:
    def __init__(self, model: str, layer_start: int = 0, layer_end: int | None = None,
                 dtype: str = "float32", device: str = "cpu", backend: str = "torch",
                 rope_scaling: dict | None = None):
        if torch.device(device).type == "cpu" and os.environ.get("MINIPAGED_CPU_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["MINIPAGED_CPU_THREADS"]))  # else: as the process chose
        self.config: ModelConfig = load_model_config(model, rope_scaling)   # --rope-scaling, if given
        layer_end = self.config.num_hidden_layers if layer_end is None else layer_end
        self.device = torch.device(device)
        self.dtype = as_dtype(resolve_dtype(dtype, self.config, self.device.type))
        if self.device.type == "cpu" and self.dtype == torch.float16:
            raise ValueError(f"dtype {dtype} is not supported on CPU (use float32, float64 or bfloat16)")
        if self.device.type == "cuda" and self.dtype == torch.float64:
            raise ValueError("float64 is a CPU parity mode; use bfloat16/float16/float32 on CUDA")
        if backend in ("pycuda", "emulated"):   # refused here, not at the first step after loading
            from worker.kernels.launch import unsupported_shape
            c = self.config
            why = unsupported_shape(c.head_dim, c.num_attention_heads, c.num_key_value_heads)
            if why is not None:
                raise ValueError(f"the {backend} backend cannot run this model: {why}; use the torch backend")
        self.layer_start, self.layer_end = layer_start, layer_end
        # bfloat16 on a CPU with the compiled kernels: bfloat16 weights, GEMM inputs and K/V, the
        # activations between them in float32 (dtype_choice.py says why); the stage computes in float32
        self.mixed_bf16 = (self.device.type == "cpu" and self.dtype == torch.bfloat16 and backend == "torch"
                           and cpu_bf16_mode())
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not self.mixed_bf16:
            log.warning("--dtype bfloat16 on a CPU without bfloat16 instructions (AVX512_BF16 / AMX) or the "
                        "compiled kernels: torch's own bfloat16 kernels run, several times slower than float32 "
                        "here (--dtype auto picks float32 on this CPU)")
        compute = torch.float32 if self.mixed_bf16 else self.dtype
        self.stage = Qwen3Stage(self.config, layer_start, layer_end, compute, self.device, backend,
                                matrix_dtype=torch.bfloat16 if self.mixed_bf16 else None)
        t0 = time.monotonic()
        # one tensor at a time, straight into the parameters: peak memory is the weights, not 2x
        probes: dict = {}
        self.stage.load_weights(tap_probes(self.config, stream_state(model, self.config, layer_start,
                                                                      layer_end), probes))
        self.fingerprint = fingerprint(self.config, known=probes)
        # a bfloat16 checkpoint computed in float32: decode GEMMs read its 2-byte values (cpu_gemm.py)
        self.bf16_weights = False
        if self.mixed_bf16:
            self.stage.use_onednn_bf16_weights()
        else:
            self.bf16_weights = checkpoint_dtype(self.config) == "bfloat16" and self.stage.use_bf16_weights()
            self.stage.use_onednn_weights()
        n_bytes = sum(t.numel() * t.element_size() for t in self.stage.weight_tensors())
        log.info("model %s layers [%d, %d) ready: %.0f MB of %s weights in %.1f s%s", model, layer_start,
                 layer_end, n_bytes / 1e6, str(self.dtype).removeprefix("torch."), time.monotonic() - t0,
                 self._bf16_note())
        self.stage.eval()
        self.kv_cache: PagedKVCache | None = None

    def _bf16_note(self) -> str:
        if self.mixed_bf16:
            return " (oneDNN bfloat16 GEMMs, bfloat16 K/V, float32 activations between them)"
        if not self.bf16_weights:
            return ""
        linears = [m for m in self.stage.modules() if getattr(m, "packed", None) is not None]
        if any(getattr(m, "vnni", None) is not None for m in linears):
            return " (bfloat16 copies: AMX for 8+ rows, panels below; the lm_head in bfloat16 only)"
        if all(m.packed_rows == cpu_gemm.EVERY_BATCH for m in linears):
            return " (bfloat16 panels for every batch, no float32 copy)"
        return " (bfloat16 copies for small batches; the lm_head in bfloat16 only)"

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def kv_bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.num_layers, self.config.num_key_value_heads, block_size,
                               self.config.head_dim, self.dtype)

    def init_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A fresh cache: whatever the previous one held is gone."""
        self.kv_cache = None                 # free the old one before allocating the new
        self.kv_cache = PagedKVCache(self.num_layers, num_blocks, self.config.num_key_value_heads,
                                     block_size, self.config.head_dim, self.dtype, self.device)
        return self.kv_cache

    # Hidden states between stages travel as raw bytes in the model dtype (bfloat16 has no numpy dtype).
    def encode_hidden(self, hidden: torch.Tensor) -> tuple[bytes, str]:
        h = hidden.detach().contiguous().cpu()
        return h.view(torch.uint8).numpy().tobytes(), str(h.dtype).removeprefix("torch.")

    def decode_hidden(self, data: bytes, dtype: str, num_tokens: int) -> torch.Tensor:
        # writable memory (the stage may compute in place): the data link's own bytearray or its
        # shared-memory frame (held until the step is done), else a copy
        writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
        buf = data if writable else bytearray(data)
        h = torch.frombuffer(buf, dtype=as_dtype(dtype)).view(num_tokens, self.config.hidden_size)
        return h.to(self.device, self.stage.dtype)

    def make_batch(self, input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                   block_tables) -> StepBatch:
        qsl = np.asarray(query_start_loc)
        qlens = np.diff(qsl)
        dev = self.device
        return StepBatch(
            input_ids=None if input_ids is None else _tensor(input_ids, torch.int64, dev),
            positions=_tensor(positions, torch.int64, dev),
            slot_mapping=_tensor(slot_mapping, torch.int64, dev),
            query_start_loc=_tensor(qsl, torch.int32, dev),
            seq_lens=_tensor(seq_lens, torch.int32, dev),
            block_tables=_tensor(np.asarray(block_tables).reshape(len(qlens), -1), torch.int32, dev),
            max_query_len=int(qlens.max()) if qlens.size else 0,
            is_decode=bool(qlens.size) and bool((qlens == 1).all()),
        )

    def execute(self, batch: StepBatch, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("init_cache must be called before execute")
        with torch.inference_mode():
            return self.stage(batch, self.kv_cache, hidden_states)

    supports_extras = True  # penalties, min tokens, top logprobs (worker/logits_processors.py)

    def sample(self, hidden: torch.Tensor, query_start_loc, do_sample, temperature, top_p, top_k,
               seeds, offsets, return_logprobs: bool = False, return_logits: bool = False, extras=None):
        """Sample one token for each sequence with do_sample set, from its LAST query row.

        The sampling arrays are either per sequence ([B], the wire form; filtered by do_sample
        here) or already per sampled row ([S]). Returns (ids int32 [S], logprobs float32 [S] or
        None, logits float64 numpy [S, vocab] or None)."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        mask = np.asarray(do_sample).astype(bool).reshape(-1)
        rows = qsl[1:][mask] - 1
        pick = lambda a: (np.asarray(a).reshape(-1)[mask]                     # noqa: E731
                          if np.asarray(a).size == mask.size else np.asarray(a).reshape(-1))
        with torch.inference_mode():
            idx = torch.as_tensor(rows, device=hidden.device)
            logits = self.stage.compute_logits(hidden[idx])
            if extras is None:
                ids, logprobs = sampler.sample(logits, pick(temperature), pick(top_p), pick(top_k),
                                               pick(seeds), pick(offsets), return_logprobs)
                top = None
            else:  # min tokens, penalties, alternatives (worker/logits_processors.py)
                ids, logprobs, top = logits_processors.sample_with_rules(
                    logits, logits_processors.rows(extras, mask), pick(temperature), pick(top_p), pick(top_k),
                    pick(seeds), pick(offsets), return_logprobs, keep_raw=return_logits)
            out_logits = logits.to(torch.float64).cpu().numpy() if return_logits else None
        return ids, logprobs, out_logits, top

    def prompt_logprobs(self, hidden: torch.Tensor, rows: "plp.PromptRows"):
        """Prompt logprobs of the asked-for rows, in row chunks (worker/prompt_logprobs.py)."""
        return plp.compute(self.stage.compute_logits, hidden, rows, self.config.vocab_size)
