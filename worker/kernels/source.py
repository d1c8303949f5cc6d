"""What the kernels are and how they compile, shared by the kernel backends and the tools: the
source files, every entry point with its argument signature, the single translation unit PyCUDA
compiles, and the nvcc / PyCUDA / g++ (emulation) flags. How they are launched: launch.py.
"""
from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

KERNEL_DIR = os.path.dirname(os.path.abspath(__file__))
COMMON_SOURCE = "common.cu"
KERNEL_SOURCES = ("reshape_and_cache.cu", "paged_decode.cu", "paged_prefill.cu")
EMULATION_HEADER = "simt_cpu.h"           # force-included; it includes the schedule header
EMULATION_HEADERS = (EMULATION_HEADER, "simt_schedule.h")

HEAD_DIMS = (64, 128)       # the kernels are instantiated for these (and the dtypes below)
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Argument signatures in PyCUDA's prepare() letters: P pointer, i int32, f float32.
_CACHE_SIG = "PPPPPiiii"
_DECODE_SIG = "PPPPPPPPPfiiiii"
_REDUCE_SIG = "PPPPii"
_PREFILL_SIG = "PPPPPPPfiiiii"


@functools.cache
def kernel_signatures() -> Mapping[str, str]:
    """Every extern "C" entry point and its argument signature (built once: read-only)."""
    sigs = {}
    for sfx in DTYPE_SUFFIX.values():
        sigs[f"reshape_and_cache_{sfx}"] = _CACHE_SIG
        for d in HEAD_DIMS:
            sigs[f"paged_decode_{sfx}_d{d}"] = _DECODE_SIG
            sigs[f"paged_decode_reduce_{sfx}_d{d}"] = _REDUCE_SIG
            sigs[f"paged_prefill_{sfx}_d{d}"] = _PREFILL_SIG
    return MappingProxyType(sigs)


def source_path(name: str) -> str:
    return os.path.join(KERNEL_DIR, name)


def read_source(name: str) -> str:
    with open(source_path(name), encoding="utf-8") as f:
        return f.read()


def module_source() -> str:
    """All kernels as ONE self-contained translation unit (common.cu inlined once, the
    `#include "common.cu"` lines dropped), for PyCUDA's SourceModule: no include path needed, and
    PyCUDA's compile cache keys on the full text."""
    parts = [read_source(COMMON_SOURCE)]
    for name in KERNEL_SOURCES:
        lines = [ln for ln in read_source(name).splitlines()
                 if ln.strip() != '#include "common.cu"']
        parts.append(f"// ---- {name}\n" + "\n".join(lines))
    return "\n".join(parts) + "\n"


def sources_hash(extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for name in EMULATION_HEADERS + (COMMON_SOURCE,) + KERNEL_SOURCES:
        h.update(name.encode())
        h.update(read_source(name).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- compile flags
NVCC_WARNING_FLAGS = ["-Xcompiler", "-Wall", "-Werror", "all-warnings"]


def nvcc_flags(arch: str) -> list[str]:
    """Flags for the warning-free standalone check (`nvcc -cubin`, tests/test_kernels_nvcc.py)."""
    return ["-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-I", KERNEL_DIR] + NVCC_WARNING_FLAGS


def pycuda_options() -> list[str]:
    """Options for PyCUDA's SourceModule (it adds -arch and -cubin itself)."""
    return ["-std=c++17", "-O3", "-lineinfo"]


GXX = os.environ.get("CXX_EMULATION", "g++")


def emulation_flags() -> list[str]:
    """g++ flags for the emulation library. MINIPAGED_EMUL_CXXFLAGS appends more, e.g.
    "-fsanitize=address -O1 -g" to check the kernels' memory accesses (run python with
    LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0)."""
    extra = os.environ.get("MINIPAGED_EMUL_CXXFLAGS", "").split()
    return ["-x", "c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing",
            "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-include", source_path(EMULATION_HEADER),
            *extra]
