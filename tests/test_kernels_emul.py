"""The CUDA kernels (worker/kernels/*.cu) run on the CPU through the SIMT emulation (simt_cpu.h,
g++), with the same launch plan as the GPU backend, against the torch reference backend run in
float64. Outputs and split workspaces are poisoned with NaN before every run.

Sizes are small: fibers are slow (every __syncthreads / shuffle is a context switch)."""
from __future__ import annotations

import math

import pytest
import torch

from worker.attention_torch import TorchBackend
from worker.kernels import emulated, launch, source
from worker.kernels.emulated import EmulatedBackend

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(scope="module")
def emul():
    b = EmulatedBackend()
    b.poison_outputs = True
    return b


REF = TorchBackend()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (an element was not written)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_paged(seq_lens, num_kv_heads, block_size, head_dim, dtype, gen, extra_blocks=3):
    """Random caches and shuffled block tables (rows padded with -1) for the given contexts."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(need) + 1
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    return kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32)


def ref_decode(q, kc, vc, tables, lens, scale):
    return REF.paged_decode(q.double(), kc.double(), vc.double(), tables, lens, scale)


def ref_prefill(q, kc, vc, tables, lens, qsl, max_q, scale):
    return REF.paged_prefill(q.double(), kc.double(), vc.double(), tables, lens, qsl, max_q, scale)


# ------------------------------------------------------------------------------- reshape_and_cache
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,slot_dtype", [
    (1, 64, 2, torch.int64), (7, 128, 1, torch.int32), (16, 64, 4, torch.int32),
    (32, 128, 2, torch.int64), (16, 12, 2, torch.int32),   # head_dim 12: the scalar path
])
def test_emul_write_kv(emul, dtype, block_size, head_dim, num_kv_heads, slot_dtype):
    gen = torch.Generator().manual_seed(1000 + block_size + head_dim)
    num_blocks, T = 16, 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(slot_dtype)
    slots[[2, 7]] = -1                                     # padding tokens
    key = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.full(shape, float("nan"), dtype=dtype)
    vc = torch.full(shape, float("nan"), dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    emul.write_kv(key, value, kc, vc, slots)
    REF.write_kv(key, value, kr, vr, slots)
    assert torch.equal(kc.isnan(), kr.isnan()) and torch.equal(vc.isnan(), vr.isnan())
    written = ~kr.isnan()
    assert written.sum() == (T - 2) * num_kv_heads * head_dim
    assert torch.equal(kc[written], kr[written]) and torch.equal(vc[written], vr[written])


def test_emul_write_kv_min_block(emul):
    """block size 1 with every slot of the cache written, in shuffled order."""
    gen = torch.Generator().manual_seed(7)
    T, kvh, D = 9, 2, 64
    slots = torch.randperm(T, generator=gen)
    key = torch.randn(T, kvh, D, generator=gen)
    value = torch.randn(T, kvh, D, generator=gen)
    kc = torch.full((T, kvh, 1, D), float("nan"))
    vc = torch.full((T, kvh, 1, D), float("nan"))
    emul.write_kv(key, value, kc, vc, slots)
    assert torch.equal(kc[slots, :, 0], key) and torch.equal(vc[slots, :, 0], value)


# ------------------------------------------------------------------------------- decode
DECODE_CASES = [
    # block_size, head_dim, num_heads, num_kv_heads, seq_lens
    (16, 128, 8, 1, [1, 17, 33]),        # GQA 8, seq_len 1
    (7, 64, 4, 2, [5, 30, 7]),           # GQA 2, odd block size
    (1, 64, 2, 2, [1, 9]),               # MHA, block size 1
    (32, 128, 8, 2, [40, 65]),           # GQA 4
    (16, 64, 16, 1, [20]),               # GQA 16 (the largest group)
]


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,seq_lens", DECODE_CASES)
def test_emul_decode(emul, block_size, head_dim, num_heads, num_kv_heads, seq_lens):
    gen = torch.Generator().manual_seed(block_size * 131 + head_dim + num_heads)
    kc, vc, tables, lens = make_paged(seq_lens, num_kv_heads, block_size, head_dim,
                                      torch.float32, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = emul.paged_decode(q, kc, vc, tables, lens, scale)
    assert emul.last_num_splits == 1
    assert rel_err(out, ref_decode(q, kc, vc, tables, lens, scale)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emul_decode_half(emul, dtype):
    gen = torch.Generator().manual_seed(5)
    kc, vc, tables, lens = make_paged([23, 3], 2, 16, 128, dtype, gen)
    q = torch.randn(2, 8, 128, generator=gen).to(dtype)
    out = emul.paged_decode(q, kc, vc, tables, lens, 0.125)
    assert out.dtype == dtype
    assert rel_err(out, ref_decode(q, kc, vc, tables, lens, 0.125)) < TOL[dtype]


@pytest.mark.parametrize("dtype,head_dim,num_heads", [
    (torch.float32, 64, 4), (torch.bfloat16, 128, 4), (torch.float16, 64, 8)])
def test_emul_decode_split_kv(emul, dtype, head_dim, num_heads):
    """A long context with a small batch takes the split-KV path (partials + reduce). The second
    sequence is short, so some of its splits are empty."""
    gen = torch.Generator().manual_seed(11 + head_dim)
    seq_lens = [900, 40]
    kc, vc, tables, lens = make_paged(seq_lens, 2, 16, head_dim, dtype, gen)
    q = torch.randn(2, num_heads, head_dim, generator=gen).to(dtype)
    expected_splits = launch.choose_num_splits(2, 2, tables.shape[1] * 16)
    assert expected_splits > 1
    out = emul.paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5)
    assert emul.last_num_splits == expected_splits
    assert rel_err(out, ref_decode(q, kc, vc, tables, lens, head_dim ** -0.5)) < TOL[dtype]


def test_emul_planner():
    assert launch.choose_num_splits(256, 8, 512) == 1            # big batch: no split
    assert launch.choose_num_splits(1, 8, 200) == 1              # short context: no split
    assert launch.choose_num_splits(1, 8, 8192) == 32            # small batch, long context
    assert launch.choose_num_splits(16, 8, 8192) == 3            # ceil(264 / 128)
    assert launch.choose_num_splits(1, 8, 1024) == 4             # bounded by tokens per split


# ------------------------------------------------------------------------------- prefill
PREFILL_CASES = [
    # block_size, head_dim, num_heads, num_kv_heads, [(cached_prefix, qlen), ...]
    (7, 64, 4, 2, [(0, 5), (13, 7), (30, 1)]),      # GQA 2, prefix not block-aligned
    (16, 128, 8, 1, [(0, 20), (16, 6)]),            # GQA 8 (q_tile 4), aligned prefix
    (32, 64, 2, 2, [(3, 40)]),                      # MHA, q_tile 32 -> 2 query tiles
    (1, 128, 8, 2, [(5, 9), (0, 1)]),               # GQA 4, block size 1
]


def _prefill_inputs(block_size, head_dim, num_heads, num_kv_heads, seqs, dtype, gen):
    seq_lens = [p + n for p, n in seqs]
    kc, vc, tables, lens = make_paged(seq_lens, num_kv_heads, block_size, head_dim, dtype, gen)
    qlens = [n for _, n in seqs]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return q, kc, vc, tables, lens, qsl, max(qlens)


@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,seqs", PREFILL_CASES)
def test_emul_prefill(emul, block_size, head_dim, num_heads, num_kv_heads, seqs):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim + num_heads)
    args = _prefill_inputs(block_size, head_dim, num_heads, num_kv_heads, seqs, torch.float32,
                           gen)
    scale = head_dim ** -0.5
    out = emul.paged_prefill(*args, scale)
    assert rel_err(out, ref_prefill(*args, scale)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emul_prefill_half(emul, dtype):
    gen = torch.Generator().manual_seed(3)
    args = _prefill_inputs(16, 128, 4, 1, [(10, 12), (0, 3)], dtype, gen)
    out = emul.paged_prefill(*args, 0.1)
    assert out.dtype == dtype
    assert rel_err(out, ref_prefill(*args, 0.1)) < TOL[dtype]


def test_emul_write_then_prefill_then_decode(emul):
    """The way a worker uses them: write a prompt's K/V through reshape_and_cache (with padding
    slots), chunked prefill over the cached prefix, then decode steps, all through the kernels."""
    gen = torch.Generator().manual_seed(21)
    bs, kvh, H, D, num_blocks = 7, 2, 8, 64, 12
    # Garbage (not NaN: the torch reference multiplies masked slots by 0) in unwritten slots.
    kc = torch.randn(num_blocks, kvh, bs, D, generator=gen) * 1e3
    vc = torch.randn(num_blocks, kvh, bs, D, generator=gen) * 1e3
    table = torch.randperm(num_blocks, generator=gen)[:6].to(torch.int32)[None]
    n_ctx = 30
    k_all = torch.randn(n_ctx + 1, kvh, D, generator=gen)
    v_all = torch.randn(n_ctx + 1, kvh, D, generator=gen)
    pos = torch.arange(n_ctx + 1)
    slots_all = table[0, pos // bs].long() * bs + pos % bs
    # chunk 1: positions 0..17, chunk 2: 18..29 (prefix 18 cached); padding slots in between
    for lo, hi in [(0, 18), (18, 30)]:
        slots = torch.cat([slots_all[lo:hi], torch.tensor([-1, -1])])
        kk = torch.cat([k_all[lo:hi], torch.randn(2, kvh, D, generator=gen)])
        vv = torch.cat([v_all[lo:hi], torch.randn(2, kvh, D, generator=gen)])
        emul.write_kv(kk, vv, kc, vc, slots)
        q = torch.randn(hi - lo, H, D, generator=gen)
        lens = torch.tensor([hi], dtype=torch.int32)
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        out = emul.paged_prefill(q, kc, vc, table, lens, qsl, hi - lo, D ** -0.5)
        assert rel_err(out, ref_prefill(q, kc, vc, table, lens, qsl, hi - lo, D ** -0.5)) < 2e-5
    emul.write_kv(k_all[30:], v_all[30:], kc, vc, slots_all[30:])
    q = torch.randn(1, H, D, generator=gen)
    lens = torch.tensor([31], dtype=torch.int32)
    out = emul.paged_decode(q, kc, vc, table, lens, D ** -0.5)
    assert rel_err(out, ref_decode(q, kc, vc, table, lens, D ** -0.5)) < 2e-5
    # the decode result equals dense attention over the tokens written
    kf = k_all.repeat_interleave(H // kvh, dim=1).double()
    vf = v_all.repeat_interleave(H // kvh, dim=1).double()
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), kf) * D ** -0.5, -1)
    assert rel_err(out[0], torch.einsum("hn,nhd->hd", p, vf)) < 2e-5


@pytest.mark.parametrize("seed", range(12))
def test_emul_random_shapes(emul, seed):
    """Random block size / head_dim / GQA ratio / lengths / dtype: decode and prefill together."""
    gen = torch.Generator().manual_seed(4242 + seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    bs, D, G = pick([1, 7, 16, 32]), pick([64, 128]), pick([1, 2, 4, 8])
    kvh, dtype = pick([1, 2]), pick([torch.float32, torch.float32, torch.bfloat16])
    B = int(torch.randint(1, 4, (1,), generator=gen))
    qlens = torch.randint(1, 24, (B,), generator=gen).tolist()
    prefixes = [pick([0, 1, bs, 2 * bs + 3, 45]) for _ in range(B)]
    seq_lens = [p + n for p, n in zip(prefixes, qlens)]
    kc, vc, tables, lens = make_paged(seq_lens, kvh, bs, D, dtype, gen)
    scale = float(torch.rand(1, generator=gen)) * D ** -0.5 * 2
    q = torch.randn(B, G * kvh, D, generator=gen).to(dtype)
    out = emul.paged_decode(q, kc, vc, tables, lens, scale)
    assert rel_err(out, ref_decode(q, kc, vc, tables, lens, scale)) < TOL[dtype]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(int(qsl[-1]), G * kvh, D, generator=gen).to(dtype)
    out = emul.paged_prefill(qp, kc, vc, tables, lens, qsl, max(qlens), scale)
    assert rel_err(out, ref_prefill(qp, kc, vc, tables, lens, qsl, max(qlens), scale)) < TOL[dtype]


def test_emul_input_handling(emul):
    """int64 tables and a non-contiguous query are accepted (converted); what cannot be fixed up
    (cache layout, dtype mismatch, head_dim, group size) raises."""
    gen = torch.Generator().manual_seed(8)
    kc, vc, tables, lens = make_paged([19, 4], 2, 16, 64, torch.float32, gen)
    q = torch.randn(2, 64, 4, generator=gen).transpose(1, 2)        # non-contiguous [2, 4, 64]
    out = emul.paged_decode(q, kc, vc, tables.long(), lens.long(), 0.125)
    assert rel_err(out, ref_decode(q, kc, vc, tables, lens, 0.125)) < 2e-5
    # an empty context (a padding row of a batch) gives zeros, like the torch backend
    out = emul.paged_decode(q, kc, vc, tables, torch.tensor([0, 4], dtype=torch.int32), 0.125)
    assert torch.equal(out[0], torch.zeros(4, 64))
    with pytest.raises(TypeError):
        emul.paged_decode(q.double(), kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError):
        emul.paged_decode(torch.randn(2, 4, 32), kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError):
        emul.paged_decode(q, kc.transpose(1, 2), vc.transpose(1, 2), tables, lens, 1.0)
    with pytest.raises(ValueError):
        emul.paged_decode(torch.randn(2, 3, 64), kc, vc, tables, lens, 1.0)
    with pytest.raises(ValueError):
        emul.paged_decode(torch.randn(2, 34, 64), kc, vc, tables, lens, 1.0)   # group 17 > 16
    with pytest.raises(ValueError, match="query has 3 rows, seq_lens 2"):     # the grid is the query's:
        emul.paged_decode(torch.randn(3, 4, 64), kc, vc, tables, lens, 1.0)   # row 2 read past seq_lens


def test_emul_bad_schedule_fails_every_load(monkeypatch):
    """(Before: the first load raised, and every later one ran the forward schedule quietly.)"""
    kept = emulated._lib
    monkeypatch.setenv("MINIPAGED_SIMT_SCHEDULE", "randon:7")
    try:
        emulated._lib = None
        for _ in range(2):
            with pytest.raises(ValueError, match="unknown SIMT schedule"):
                EmulatedBackend()
    finally:
        emulated._lib = kept


def test_shapes_the_kernels_cannot_run_are_refused_at_start(tmp_path, capsys):
    """A checkpoint whose attention the CUDA kernels are not built for (head_dim 80, a group of
    32): the GPU worker's default falls back to the torch backend with a warning, `--backend
    pycuda` and the ModelRunner refuse it at start (before: accepted, then every step failed)."""
    from tests.checkpoints import make_checkpoint
    from worker.flags import resolve_args
    from worker.model_runner import ModelRunner
    assert launch.unsupported_shape(128, 32, 8) is None
    for name, kw in {"d80": dict(hidden=160, heads=2, kv_heads=1, head_dim=80),
                     "g32": dict(hidden=64, heads=32, kv_heads=1, head_dim=64)}.items():
        path = make_checkpoint(num_layers=1, directory=str(tmp_path / name), **kw)
        args = resolve_args(["--model", path, "--device", "cuda"])
        assert args.backend == "torch" and "attention runs on the torch backend" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            resolve_args(["--model", path, "--device", "cuda", "--backend", "pycuda"])
        assert "cannot run this model" in capsys.readouterr().err
        with pytest.raises(ValueError, match="the emulated backend cannot run this model"):
            ModelRunner(path, dtype="float32", backend="emulated")
    assert resolve_args(["--model", "tiny", "--device", "cuda"]).backend == "pycuda"


def test_emul_via_get_backend():
    from worker.attention import get_backend
    be = get_backend("emulated", "cpu")
    assert isinstance(be, EmulatedBackend) and be.name == "emulated"


# ------------------------------------------------------------------------------- the emulator itself
SIMT_PROBE = r"""
__global__ void probe(int* out, int mode) {
    __shared__ int s[256];
    const int t = threadIdx.x, lane = t & 31;
    if (mode == 0) {                 // barrier: everyone sees everyone's write
        s[t] = t * 3;
        __syncthreads();
        out[t] = s[(t + 37) % blockDim.x] + 1000 * blockIdx.x;
    } else if (mode == 1) {          // shuffles
        int a = __shfl_xor_sync(0xffffffffu, t, 5);
        int b = __shfl_down_sync(0xffffffffu, t, 3);
        int c = __shfl_up_sync(0xffffffffu, t, 2, 16);
        int d = __shfl_sync(0xffffffffu, t, 7, 8);
        int e = __shfl_xor_sync(0xffffffffu, lane, 8, 16);
        int f = __shfl_xor_sync(0xffffffffu, lane, 16, 16);   // an earlier group: read; a later: own
        out[6 * t + 0] = a; out[6 * t + 1] = b; out[6 * t + 2] = c; out[6 * t + 3] = d;
        out[6 * t + 4] = e; out[6 * t + 5] = f;
    } else if (mode == 2) {          // half a warp in a barrier, half in a shuffle: reported
        if (lane < 16) __syncthreads();
        else (void)__shfl_xor_sync(0xffffffffu, t, 1);
        out[t] = 1;
    } else {                         // exited threads do not hold a barrier back
        if (t >= 40) return;
        s[t] = t;
        __syncthreads();
        out[t] = s[39 - t];
    }
}
SIMT_EMU_ENTRY(probe, int* out COMMA int mode, out COMMA mode)
"""


def test_emul_simt_primitives(tmp_path):
    with emulated.schedule("forward"):   # "last block wins" below is the forward block order
        _simt_primitives(tmp_path)


def _simt_primitives(tmp_path):
    import ctypes
    import subprocess
    so = tmp_path / "probe.so"
    src = tmp_path / "probe.cpp"
    src.write_text("#define COMMA ,\n" + SIMT_PROBE)
    subprocess.run([source.GXX, *source.emulation_flags(), str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.simt_set_schedule.argtypes = [ctypes.c_int, ctypes.c_uint64]
    assert lib.simt_set_schedule(0, 0) == 0     # process-wide state, set through either library
    fn = lib.emu_probe
    fn.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p, ctypes.c_int]
    n = 96
    out = torch.full((6 * n,), -1, dtype=torch.int32)
    assert fn(2, 1, 1, n, 1, 1, out.data_ptr(), 0) == 0   # last block (x=1) wins
    t = torch.arange(n)
    assert torch.equal(out[:n], ((t + 37) % n) * 3 + 1000)
    assert fn(1, 1, 1, n, 1, 1, out.data_ptr(), 1) == 0
    o = out.view(n, 6)
    lane, base = t % 32, t - t % 32
    assert torch.equal(o[:, 0], base + (lane ^ 5))
    assert torch.equal(o[:, 1], torch.where(lane + 3 < 32, t + 3, t))
    assert torch.equal(o[:, 2], torch.where(lane % 16 >= 2, t - 2, t))
    assert torch.equal(o[:, 3], base + (lane // 8) * 8 + 7)
    assert torch.equal(o[:, 4], lane ^ 8)
    assert torch.equal(o[:, 5], torch.where(lane >= 16, lane - 16, lane))   # PTX shfl.bfly's rule
    assert fn(1, 1, 1, 64, 1, 1, out.data_ptr(), 2) == -1
    out.fill_(-1)
    assert fn(1, 1, 1, 64, 1, 1, out.data_ptr(), 3) == 0
    assert torch.equal(out[:40], 39 - torch.arange(40, dtype=torch.int32))
    assert fn(1, 1, 1, 64, 1, 1, out.data_ptr(), 0) == 0  # usable again after a deadlock
