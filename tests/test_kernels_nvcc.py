"""Every kernel source compiles with nvcc for real sm_80 and sm_90 code (cubin), warning-free:
`-Werror all-warnings` plus the host compiler's -Wall. Needs nvcc only, no GPU.

A successful compile is remembered under build/kernels/nvcc-<hash>/ keyed by the nvcc version,
the flags and the text of every source, so an unchanged tree does not recompile (the same input
gives the same result); any change to a source or flag compiles again."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from worker.kernels import ptxas, source

NVCC = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc")
                                and "/usr/local/cuda/bin/nvcc") or None
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")

BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build",
                     "kernels")


def _nvcc_version() -> str:
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", source.KERNEL_SOURCES)
def test_nvcc_compiles_warning_free(name, arch):
    flags = source.nvcc_flags(arch)
    key = hashlib.sha256("\n".join([_nvcc_version(), " ".join(flags), name,
                                    source.sources_hash()]).encode()).hexdigest()[:16]
    out_dir = os.path.join(BUILD, f"nvcc-{key}")
    stamp = os.path.join(out_dir, f"{name}.{arch}.ok")
    if os.path.exists(stamp):
        return
    os.makedirs(out_dir, exist_ok=True)
    cubin = os.path.join(out_dir, f"{name}.{arch}.cubin")
    cmd = [NVCC, *flags, source.source_path(name), "-o", cubin]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log}"
    assert "warning" not in log.lower(), f"{' '.join(cmd)} warned:\n{log}"
    assert os.path.getsize(cubin) > 0
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(" ".join(cmd) + "\n")


def test_nvcc_whole_module_compiles():
    """The single translation unit that PyCUDA's SourceModule compiles (all kernels, common.cu
    inlined) builds for sm_90 too, and exports every entry point under its plain C name."""
    text = source.module_source()
    flags = [f for f in source.nvcc_flags("sm_90") if f not in ("-I", source.KERNEL_DIR)]
    key = hashlib.sha256((_nvcc_version() + " ".join(flags) + text).encode()).hexdigest()[:16]
    out_dir = os.path.join(BUILD, f"nvcc-module-{key}")
    stamp = os.path.join(out_dir, "ok")
    if not os.path.exists(stamp):
        os.makedirs(out_dir, exist_ok=True)
        src = os.path.join(out_dir, "module.cu")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        cubin = os.path.join(out_dir, "module.cubin")
        proc = subprocess.run([NVCC, *flags, src, "-o", cubin], capture_output=True, text=True)
        log = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == 0 and "warning" not in log.lower(), log
        with open(cubin, "rb") as f:
            blob = f.read()
        missing = [n for n in source.kernel_signatures() if n.encode() + b"\0" not in blob]
        assert not missing, f"entry points missing from the cubin: {missing}"
        with open(stamp, "w", encoding="utf-8") as f:
            f.write("ok\n")


def test_ptxas_no_spills_on_sm_90():
    """Every entry point, compiled as PyCUDA compiles it for sm_90: no register spills, no stack
    frame (bench/kernels.py prints the same table with the CTAs per SM it allows)."""
    report, _ = ptxas.ptxas_report("sm_90", NVCC)
    assert sorted(r.name for r in report) == sorted(source.kernel_signatures())
    bad = [r for r in report if r.spill_stores or r.spill_loads or r.stack]
    assert not bad, "\n".join(ptxas.table(bad))


def test_ptxas_parse_and_occupancy():
    text = """ptxas info    : Compiling entry function 'paged_decode_bf16_d64' for 'sm_90'
ptxas info    : Function properties for paged_decode_bf16_d64
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 23744 bytes smem
ptxas info    : Compiling entry function 'paged_decode_reduce_f32_d64' for 'sm_90'
ptxas info    : Function properties for paged_decode_reduce_f32_d64
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers
"""
    a, b = ptxas.parse(text)
    assert (a.name, a.registers, a.spill_stores, a.spill_loads, a.stack, a.smem) == \
        ("paged_decode_bf16_d64", 64, 4, 4, 8, 23744)
    assert a.ctas_per_sm() == (8, "registers")          # 64 x 128 x 8 = the whole register file
    assert (b.threads, b.smem, b.ctas_per_sm()) == (64, 0, (32, "threads"))
    assert ptxas.KernelResources("paged_prefill_f32_d128", 128, 0, 0, 0, 35712).ctas_per_sm() == \
        (4, "registers")
    assert ptxas.KernelResources("paged_decode_f16_d64", 40, 0, 0, 0, 44224).ctas_per_sm() == (5, "smem")
