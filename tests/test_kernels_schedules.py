"""The kernels under hostile schedules (worker/kernels/simt_schedule.h): fibers in reverse, in seeded
random order between barriers, warps (and blocks) in any order. A GPU promises no order, so every
emulated kernel must give bit-identical results under every schedule; and a missing barrier that
the natural order hides must be caught."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import zlib

import pytest
import torch

from tests.test_kernels_emul import _prefill_inputs, make_paged, ref_decode, rel_err
from worker.kernels import emulated, source
from worker.kernels.emulated import EmulatedBackend

HOSTILE = ["reverse", "random:1", "random:2", "warps:3"]


def run_case(be: EmulatedBackend, case: str) -> torch.Tensor:
    """One kernel launch plan on fixed inputs (the same inputs every call)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    if case.startswith("write_kv"):
        dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
        slots = torch.randperm(16 * 7, generator=gen)[:13]
        slots[[2, 7]] = -1
        k, v = (torch.randn(13, 2, 64, generator=gen).to(dtype) for _ in range(2))
        kc = torch.zeros(16, 2, 7, 64, dtype=dtype)
        vc = torch.zeros_like(kc)
        be.write_kv(k, v, kc, vc, slots)
        return torch.cat([kc.flatten(), vc.flatten()])
    if case.startswith("decode"):
        # name: decode_<dtype>_d<D>_g<G>_<seq lens>; [900, 40] takes split-KV with empty splits
        _, dt, d, g, lens = case.split("_")
        dtype, D, G = getattr(torch, dt), int(d[1:]), int(g[1:])
        seq_lens = [int(x) for x in lens.split("-")]
        kc, vc, tables, sl = make_paged(seq_lens, 2, 16, D, dtype, gen)
        q = torch.randn(len(seq_lens), 2 * G, D, generator=gen).to(dtype)
        return be.paged_decode(q, kc, vc, tables, sl, D ** -0.5)
    _, dt, bs, d, h, kvh = case.split("_")      # prefill_<dtype>_b<bs>_d<D>_h<H>_k<KVH>
    args = _prefill_inputs(int(bs[1:]), int(d[1:]), int(h[1:]), int(kvh[1:]),
                           [(0, 5), (13, 40), (30, 1)], getattr(torch, dt), gen)
    return be.paged_prefill(*args, int(d[1:]) ** -0.5)


CASES = ["write_kv_f32", "write_kv_bf16",
         "decode_float32_d128_g8_1-17-33", "decode_bfloat16_d64_g2_23-3",
         "decode_float32_d64_g2_900-40", "decode_bfloat16_d128_g4_900-40",
         "prefill_float32_b7_d64_h4_k2", "prefill_bfloat16_b16_d128_h16_k1",
         "prefill_float32_b32_d64_h2_k2"]


def assert_schedule_invariant(be: EmulatedBackend, case: str, schedules=HOSTILE,
                              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The output under every schedule equals, bit for bit, the output under "forward"."""
    with emulated.schedule("forward", lib):
        want = run_case(be, case)
    for spec in schedules:
        with emulated.schedule(spec, lib):
            got = run_case(be, case)
        same = got.isnan() == want.isnan()
        diff = (got.double() - want.double()).abs().nan_to_num(0.0)
        bad = int((~same | (diff > 0)).sum())
        assert bad == 0, (f"{case}: {bad} of {got.numel()} output elements differ under schedule "
                          f"{spec!r} from 'forward' (max abs diff {diff.max().item():.3g}): the "
                          f"result depends on the order of threads or blocks, i.e. a race")
    return want


@pytest.fixture(scope="module")
def emul():
    b = EmulatedBackend()
    b.poison_outputs = True
    return b


@pytest.mark.parametrize("case", CASES)
def test_emul_identical_under_every_schedule(emul, case):
    out = assert_schedule_invariant(emul, case)
    assert not out.isnan().any()


def test_emul_schedule_parsing_and_scope():
    assert emulated.parse_schedule("random:42") == (2, 42)
    assert emulated.parse_schedule("WARPS") == (3, 0)
    for bad in ("sideways", "random:x", "reverse:-1"):
        with pytest.raises(ValueError):
            emulated.parse_schedule(bad)
    before = emulated.current_schedule()
    with emulated.schedule("reverse"):
        assert emulated.current_schedule() == "reverse"
    assert emulated.current_schedule() == before


# --------------------------------------------------------------------- a planted missing barrier
# The first __syncthreads of paged_decode (after the Q tile, sM and sL are set up) looks redundant:
# the K/V tile loop starts with a barrier of its own. It is not, for an EMPTY split-KV chunk: the
# loop does not run, and the thread that writes that split's (max, sum) reads sM[g] / sL[g], which
# thread g initialised. With G = 2 and D = 64 that reader is thread 64, reading thread 1's write:
# thread 1 runs first in the natural order, so only a hostile schedule shows the stale values
# (the previous block's) that a GPU may read.
FIRST_BARRIER = "    for (int r = 0; r < ACC; ++r) acc[r] = 0.0f;\n    __syncthreads();\n"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    d = tmp_path_factory.mktemp("planted")
    for name in (source.COMMON_SOURCE, *source.KERNEL_SOURCES):
        shutil.copy(source.source_path(name), d / name)
    text = (d / "paged_decode.cu").read_text()
    assert text.count(FIRST_BARRIER) == 1
    (d / "paged_decode.cu").write_text(text.replace(FIRST_BARRIER, FIRST_BARRIER.split("\n")[0] + "\n"))
    so = str(d / "lib_planted.so")
    emulated.compile_library([str(d / n) for n in source.KERNEL_SOURCES], so)
    lib = emulated.bind_library(so)
    b = EmulatedBackend(library=lib)
    b.poison_outputs = True
    return b, lib


def test_emul_hostile_schedule_catches_a_missing_barrier(emul, planted):
    be, lib = planted
    case = "decode_float32_d64_g2_900-40"
    with emulated.schedule("forward", lib):                 # the natural order hides the bug
        assert torch.equal(run_case(be, case), run_case(emul, case))
    for spec in ("reverse", "random:1"):
        with pytest.raises(AssertionError, match="a race") as caught:
            assert_schedule_invariant(be, case, [spec], lib)
        print(f"planted missing barrier, {spec}: {str(caught.value).splitlines()[0]}")  # -s shows it
    with emulated.schedule("reverse", lib):                 # and the result is wrong, not just different
        gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
        kc, vc, tables, sl = make_paged([900, 40], 2, 16, 64, torch.float32, gen)
        q = torch.randn(2, 4, 64, generator=gen)
        assert rel_err(be.paged_decode(q, kc, vc, tables, sl, 0.125),
                       ref_decode(q, kc, vc, tables, sl, 0.125)) > 1e-3


PROBE = r"""
__global__ void neighbour(int* out) {   // reads the lower neighbour's write with NO barrier
    __shared__ int s[64];
    const int t = threadIdx.x;
    s[t] = t + 100 * blockIdx.x;
    out[blockIdx.x * 64 + t] = s[t > 0 ? t - 1 : 0];
}
SIMT_EMU_ENTRY(neighbour, int* out, out)
"""


def test_emul_hostile_schedule_catches_a_neighbour_read(tmp_path):
    src, so = tmp_path / "probe.cpp", tmp_path / "probe.so"
    src.write_text(PROBE)
    subprocess.run([source.GXX, *source.emulation_flags(), str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.emu_neighbour.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p]
    lib.simt_set_schedule.argtypes = [ctypes.c_int, ctypes.c_uint64]
    t = torch.arange(64, dtype=torch.int32)
    want = torch.cat([(t - 1).clamp_min(0) + 100 * b for b in range(3)])
    results = {}
    try:
        for spec in ("forward", *HOSTILE):
            assert lib.simt_set_schedule(*emulated.parse_schedule(spec)) == 0
            out = torch.full((192,), -1, dtype=torch.int32)
            assert lib.emu_neighbour(3, 1, 1, 64, 1, 1, out.data_ptr()) == 0
            results[spec] = torch.equal(out, want)
    finally:
        emulated.set_schedule("forward")       # the schedule is process-wide
    assert results == {"forward": True, **{s: False for s in HOSTILE}}
