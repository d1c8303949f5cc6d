"""What each kernel costs in registers, spills, stack and shared memory (`nvcc -Xptxas -v`, no GPU
needed), and the CTAs per SM that allows: the first thing to read next to a timing table.

The module is compiled exactly as PyCUDA compiles it (source.module_source(), pycuda_options()),
for real sm_90 code by default. The output is cached under build/kernels/ptxas-<hash>.txt, keyed by
the nvcc version, the flags and the source text (an unchanged tree does not recompile).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from minipaged.paths import build_dir
from worker.kernels import launch, source

BUILD_DIR = build_dir("kernels")

# Hopper (sm_90) per-SM limits: 64K registers allocated per warp in units of 256, 228 KB of shared
# memory with 1 KB reserved per CTA, 64 warps, 32 CTAs.
SM_REGISTERS, REG_UNIT, SM_SMEM, SMEM_RESERVED, SM_WARPS, SM_CTAS = 65536, 256, 233472, 1024, 64, 32


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",)
                                         if os.path.exists(p)), None)


def block_threads(kernel: str) -> int:
    """Threads per CTA of each entry point, as KernelBackendBase launches it."""
    if kernel.startswith("paged_decode_reduce_"):
        return int(kernel.rsplit("_d", 1)[1])          # one thread per head dimension
    if kernel.startswith("paged_decode_"):
        return launch.DEC_THREADS
    if kernel.startswith("paged_prefill_"):
        return launch.PF_THREADS
    return launch.CACHE_THREADS


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int          # bytes
    spill_loads: int           # bytes
    stack: int                 # bytes of stack frame
    smem: int                  # bytes of static shared memory

    @property
    def threads(self) -> int:
        return block_threads(self.name)

    def ctas_per_sm(self) -> tuple[int, str]:
        """Resident CTAs per SM and what limits them (registers, shared memory or threads)."""
        warps = -(-self.threads // 32)
        per_warp = -(-max(self.registers, 1) * 32 // REG_UNIT) * REG_UNIT
        limits = {"threads": min(SM_WARPS // warps, SM_CTAS),      # on a tie, name this first
                  "registers": SM_REGISTERS // per_warp // warps,
                  "smem": SM_SMEM // (self.smem + SMEM_RESERVED)}
        why = min(limits, key=limits.get)
        return limits[why], why


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse(text: str) -> list[KernelResources]:
    """The per-entry lines of `ptxas -v` output, in the order ptxas prints them."""
    out, name, frame = [], None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and name:
            out.append(KernelResources(name, int(m.group(1)), frame[1], frame[2], frame[0],
                                       int(m.group(2) or 0)))
            name = None
    return out


def ptxas_report(arch: str = "sm_90", nvcc: str | None = None) -> tuple[list[KernelResources], str]:
    """(resources of every entry point, nvcc version line). Raises RuntimeError if nvcc fails."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, /usr/local/cuda/bin)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    flags = ["-cubin", f"-arch={arch}", *source.pycuda_options(), "-Xptxas", "-v"]
    text = source.module_source()
    key = hashlib.sha256("\n".join([version, " ".join(flags), text]).encode()).hexdigest()[:16]
    cached = os.path.join(BUILD_DIR, f"ptxas-{key}.txt")
    if not os.path.exists(cached):
        work = os.path.join(BUILD_DIR, f"ptxas-{key}.{os.getpid()}")
        os.makedirs(work, exist_ok=True)
        src = os.path.join(work, "module.cu")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        proc = subprocess.run([nvcc, *flags, src, "-o", os.path.join(work, "module.cubin")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc {' '.join(flags)} failed:\n{proc.stderr[-4000:]}")
        with open(f"{cached}.tmp{os.getpid()}", "w", encoding="utf-8") as f:
            f.write(proc.stdout + proc.stderr)
        os.replace(f"{cached}.tmp{os.getpid()}", cached)
        shutil.rmtree(work, ignore_errors=True)
    with open(cached, encoding="utf-8") as f:
        report = parse(f.read())
    line = next((ln for ln in version.splitlines() if "release" in ln), version.strip()[-60:])
    return sorted(report, key=lambda r: r.name), line.strip()


def table(resources: list[KernelResources]) -> list[str]:
    """Markdown rows: kernel | threads | registers | spill st/ld | stack | smem | CTAs/SM."""
    rows = ["| kernel | threads | regs | spill st/ld B | stack B | smem B | CTAs/SM (limit) |",
            "|---|---|---|---|---|---|---|"]
    for r in resources:
        ctas, why = r.ctas_per_sm()
        rows.append(f"| {r.name} | {r.threads} | {r.registers} | {r.spill_stores}/{r.spill_loads} "
                    f"| {r.stack} | {r.smem} | {ctas} ({why}) |")
    return rows
