"""The real CUDA kernels through PyCudaBackend against the torch backend (run in float64 on the
same device) for float32 / float16 / bfloat16 storage. Needs a CUDA device and PyCUDA: run by
scripts/gpu_check.sh (`pytest -m gpu`); skipped with a reason elsewhere."""
from __future__ import annotations

import math
import threading

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False)"),
]

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def gpu():
    from worker.kernels.pycuda_backend import PyCudaBackend
    b = PyCudaBackend("cuda")
    b.poison_outputs = True
    return b


@pytest.fixture(scope="module")
def ref():
    from worker.attention_torch import TorchBackend
    return TorchBackend()


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (an element was not written)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_paged(seq_lens, kvh, bs, D, dtype, gen, extra_blocks=5):
    need = [math.ceil(n / bs) for n in seq_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    shape = (num_blocks, kvh, bs, D)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    return (kc.cuda(), vc.cuda(), tables.cuda(), torch.tensor(seq_lens, dtype=torch.int32).cuda())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,D,kvh", [(1, 64, 2), (7, 128, 1), (16, 128, 8), (32, 64, 4)])
def test_gpu_write_kv(gpu, ref, dtype, bs, D, kvh):
    gen = torch.Generator().manual_seed(bs + D + kvh)
    num_blocks, T = 64, 50
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
    slots[::7] = -1
    key = torch.randn(T, kvh, D, generator=gen).to(dtype).cuda()
    value = torch.randn(T, kvh, D, generator=gen).to(dtype).cuda()
    kc = torch.full((num_blocks, kvh, bs, D), float("nan"), dtype=dtype, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    kr, vr = kc.clone(), vc.clone()
    gpu.write_kv(key, value, kc, vc, slots.cuda())
    ref.write_kv(key, value, kr, vr, slots.cuda())
    torch.cuda.synchronize()
    assert torch.equal(kc.isnan(), kr.isnan()) and torch.equal(vc.isnan(), vr.isnan())
    w = ~kr.isnan()
    assert torch.equal(kc[w], kr[w]) and torch.equal(vc[w], vr[w])


DECODE = [  # bs, D, H, KVH, seq_lens
    (16, 128, 16, 8, [1, 17, 300, 1000]),
    (7, 64, 4, 2, [5, 30, 7]),
    (1, 64, 2, 2, [1, 9, 100]),
    (32, 128, 32, 8, [40, 65, 2000]),
    (16, 128, 64, 4, [513]),               # GQA 16
    (16, 128, 16, 8, [8000]),              # split-KV, many splits
    (16, 128, 16, 8, [700] * 64),          # batch fills the GPU
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,D,H,KVH,seq_lens", DECODE)
def test_gpu_decode(gpu, ref, dtype, bs, D, H, KVH, seq_lens):
    gen = torch.Generator().manual_seed(bs * 31 + D + H + len(seq_lens))
    kc, vc, tables, lens = make_paged(seq_lens, KVH, bs, D, dtype, gen)
    q = torch.randn(len(seq_lens), H, D, generator=gen).to(dtype).cuda()
    out = gpu.paged_decode(q, kc, vc, tables, lens, D ** -0.5)
    expect = ref.paged_decode(q.double(), kc.double(), vc.double(), tables, lens, D ** -0.5)
    torch.cuda.synchronize()
    assert out.dtype == dtype
    assert rel_err(out, expect) < TOL[dtype]


def test_gpu_decode_splits_chosen(gpu, ref):
    gen = torch.Generator().manual_seed(99)
    kc, vc, tables, lens = make_paged([4000, 10], 8, 16, 128, torch.float16, gen)
    q = torch.randn(2, 16, 128, generator=gen).half().cuda()
    out = gpu.paged_decode(q, kc, vc, tables, lens, 0.088)
    assert gpu.last_num_splits > 1
    expect = ref.paged_decode(q.double(), kc.double(), vc.double(), tables, lens, 0.088)
    assert rel_err(out, expect) < TOL[torch.float16]


PREFILL = [  # bs, D, H, KVH, [(prefix, qlen)]
    (7, 64, 4, 2, [(0, 5), (13, 7), (30, 1)]),
    (16, 128, 16, 8, [(0, 200), (160, 37), (0, 1)]),
    (32, 128, 32, 4, [(100, 64)]),
    (1, 128, 8, 2, [(5, 9), (0, 1)]),
    (16, 64, 16, 1, [(48, 300)]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,D,H,KVH,seqs", PREFILL)
def test_gpu_prefill(gpu, ref, dtype, bs, D, H, KVH, seqs):
    gen = torch.Generator().manual_seed(bs * 17 + D + H)
    lens_list = [p + n for p, n in seqs]
    kc, vc, tables, lens = make_paged(lens_list, KVH, bs, D, dtype, gen)
    qlens = [n for _, n in seqs]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    q = torch.randn(sum(qlens), H, D, generator=gen).to(dtype).cuda()
    out = gpu.paged_prefill(q, kc, vc, tables, lens, qsl, max(qlens), D ** -0.5)
    expect = ref.paged_prefill(q.double(), kc.double(), vc.double(), tables, lens, qsl,
                               max(qlens), D ** -0.5)
    torch.cuda.synchronize()
    assert rel_err(out, expect) < TOL[dtype]


def test_gpu_non_default_stream(gpu, ref):
    """On a side stream, the kernels are ordered with the torch work around them."""
    gen = torch.Generator().manual_seed(5)
    kc, vc, tables, lens = make_paged([1500, 33], 8, 16, 128, torch.bfloat16, gen)
    q0 = torch.randn(2, 16, 128, generator=gen).bfloat16().cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q = q0 * 2.0                       # produced on the side stream just before the launch
        out = gpu.paged_decode(q, kc, vc, tables, lens, 0.05)
        out2 = out * 1.0                   # consumed on the side stream just after
    torch.cuda.current_stream().wait_stream(s)
    expect = ref.paged_decode(q0.double() * 2.0, kc.double(), vc.double(), tables, lens, 0.05)
    torch.cuda.synchronize()
    assert rel_err(out2, expect) < TOL[torch.bfloat16]


def _in_thread(fn):
    """fn() on a fresh thread; its result, or its exception raised here."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_gpu_backend_built_and_used_on_other_threads(ref):
    """PyCUDA's context stack is per thread: the backend pushes the primary context only while it
    is built, so one built on a worker thread launches from this thread, and from a fresh one."""
    from worker.kernels.pycuda_backend import PyCudaBackend
    be = _in_thread(lambda: PyCudaBackend("cuda"))
    gen = torch.Generator().manual_seed(13)
    kc, vc, tables, lens = make_paged([300, 20], 2, 16, 128, torch.bfloat16, gen)
    q = torch.randn(2, 8, 128, generator=gen).bfloat16().cuda()
    expect = ref.paged_decode(q.double(), kc.double(), vc.double(), tables, lens, 0.09)
    here = be.paged_decode(q, kc, vc, tables, lens, 0.09)
    there = _in_thread(lambda: (be.paged_decode(q, kc, vc, tables, lens, 0.09),
                                torch.cuda.synchronize())[0])
    torch.cuda.synchronize()
    assert rel_err(here, expect) < TOL[torch.bfloat16]
    assert torch.equal(here, there)
