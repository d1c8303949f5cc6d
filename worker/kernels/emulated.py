"""EmulatedBackend: the CUDA kernels of worker/kernels/*.cu compiled with g++ against the SIMT
emulation header (simt_cpu.h: threads as fibers, __syncthreads and warp shuffles as switch points)
and run on CPU tensors through ctypes. Same source, same launch plan (launch.KernelBackendBase) as
the PyCUDA backend: this is how CI checks the kernels without a GPU. Slow (fibers), for tests.

The shared library is built once per source hash under build/kernels/emul-<hash>/ (git-ignored);
concurrent builders write to a temporary name and rename atomically.

Schedules (simt_schedule.h): "forward" (the natural order), or the hostile "reverse",
"random[:SEED]" and "warps[:SEED]", which expose races that the natural order hides. The library is
process-wide, so is the schedule: `set_schedule(spec)` or `with schedule(spec):`. The environment
variable MINIPAGED_SIMT_SCHEDULE sets it when the library loads, e.g. to run a whole suite hostile:
    MINIPAGED_SIMT_SCHEDULE=random:7 .venv/bin/python -m pytest -k emul
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import tempfile
import threading

import torch

from minipaged.paths import build_dir
from worker.kernels import source
from worker.kernels.launch import DEFAULT_NUM_SMS, KernelBackendBase, Launch

BUILD_DIR = os.environ.get("MINIPAGED_KERNEL_BUILD_DIR", build_dir("kernels"))
SCHEDULES = {"forward": 0, "reverse": 1, "random": 2, "warps": 3}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_schedule = "forward"


def library_path() -> str:
    return os.path.join(BUILD_DIR, f"emul-{source.sources_hash(' '.join(source.emulation_flags()))}",
                        "libminipaged_kernels_emul.so")


def compile_library(sources: list[str], path: str) -> None:
    """g++ the given .cu files (one translation unit, the emulation header force-included) into
    the shared library `path`, atomically."""
    out_dir = os.path.dirname(path)
    os.makedirs(out_dir, exist_ok=True)
    unit = os.path.join(out_dir, "all_kernels.cpp")
    tmp_unit = f"{unit}.{os.getpid()}.tmp"
    with open(tmp_unit, "w", encoding="utf-8") as f:
        f.writelines(f'#include "{s}"\n' for s in sources)
    os.replace(tmp_unit, unit)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [source.GXX, *source.emulation_flags(), unit, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"emulation build failed: {' '.join(cmd)}\n{proc.stderr}")
    with open(os.path.join(out_dir, "build.log"), "w", encoding="utf-8") as f:
        f.write(" ".join(cmd) + "\n" + proc.stderr)
    os.replace(tmp, path)


def build_library() -> str:
    """Compile the emulation library if this source hash has not been built yet; return its path."""
    path = library_path()
    if not os.path.exists(path):
        compile_library([source.source_path(n) for n in source.KERNEL_SOURCES], path)
    return path


def bind_library(path: str) -> ctypes.CDLL:
    """Load an emulation library and declare its entry points' argument types."""
    lib = ctypes.CDLL(path)
    dims = [ctypes.c_uint] * 6
    letters = {"P": ctypes.c_void_p, "i": ctypes.c_int, "f": ctypes.c_float}
    for name, sig in source.kernel_signatures().items():
        fn = getattr(lib, f"emu_{name}")
        fn.argtypes = dims + [letters[c] for c in sig]
        fn.restype = ctypes.c_int
    lib.simt_set_schedule.argtypes = [ctypes.c_int, ctypes.c_uint64]
    lib.simt_set_schedule.restype = ctypes.c_int
    return lib


def load_library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = bind_library(build_library())
            # kept only once the schedule is set: a bad MINIPAGED_SIMT_SCHEDULE fails every load,
            # not the first alone (after which the kernels would run the forward schedule quietly)
            _apply_schedule(lib, os.environ.get("MINIPAGED_SIMT_SCHEDULE") or _schedule)
            _lib = lib
        return _lib


def parse_schedule(spec: str) -> tuple[int, int]:
    """"forward" | "reverse" | "random[:SEED]" | "warps[:SEED]" -> (mode, seed)."""
    name, _, seed = spec.strip().lower().partition(":")
    if name not in SCHEDULES or (seed and not seed.isdigit()):
        raise ValueError(f"unknown SIMT schedule {spec!r}: expected one of {sorted(SCHEDULES)}, "
                         f"with an optional ':SEED' (an integer)")
    return SCHEDULES[name], int(seed or 0)


def _apply_schedule(lib: ctypes.CDLL, spec: str) -> None:
    global _schedule
    mode, seed = parse_schedule(spec)
    if lib.simt_set_schedule(mode, seed) != 0:
        raise ValueError(f"the emulation library refused schedule {spec!r}")
    _schedule = spec


def set_schedule(spec: str, lib: ctypes.CDLL | None = None) -> None:
    """The schedule of every later launch of `lib` (default: the process's library)."""
    lib = lib or load_library()
    with _lock:
        _apply_schedule(lib, spec)


def current_schedule() -> str:
    load_library()       # the environment's choice applies from the first load
    return _schedule


@contextlib.contextmanager
def schedule(spec: str, lib: ctypes.CDLL | None = None):
    previous = current_schedule()
    set_schedule(spec, lib)
    try:
        yield
    finally:
        set_schedule(previous, lib)


class EmulatedBackend(KernelBackendBase):
    name = "emulated"

    def __init__(self, device: str | torch.device = "cpu", num_sms: int = DEFAULT_NUM_SMS,
                 library: ctypes.CDLL | None = None):
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"the emulated kernel backend runs on the CPU, not {self.device}")
        self.num_sms = num_sms          # the planner's view of the GPU; H100/H200 by default
        self.last_num_splits = None
        self._lib = library or load_library()   # tests pass a library built from altered sources
        self._sigs = source.kernel_signatures()

    def _launch(self, launch: Launch) -> None:
        sig = self._sigs[launch.kernel]
        if len(sig) != len(launch.args):
            raise TypeError(f"{launch.kernel}: {len(launch.args)} arguments for signature {sig}")
        args = []
        for letter, a in zip(sig, launch.args):
            if letter == "P":
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{launch.kernel}: expected a tensor, got {type(a)}")
                args.append(ctypes.c_void_p(a.data_ptr()))
            elif letter == "i":
                args.append(ctypes.c_int(int(a)))
            else:
                args.append(ctypes.c_float(float(a)))
        rc = getattr(self._lib, f"emu_{launch.kernel}")(*launch.grid, *launch.block, *args)
        if rc != 0:
            raise RuntimeError(f"emulated launch of {launch.kernel} grid={launch.grid} "
                               f"block={launch.block} failed (rc={rc}: "
                               f"{'deadlock at a barrier' if rc == -1 else 'bad block size'})")
