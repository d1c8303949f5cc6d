"""Host tensors in 2 MiB pages: the K/V cache, which a decode step reads at blocks scattered over
all of it, so that with 4 KiB pages nearly every block read also misses the TLB. Linux gives an
anonymous mapping transparent huge pages when it is advised to (MADV_HUGEPAGE; the default
`madvise` mode of /sys/kernel/mm/transparent_hugepage/enabled), before its pages are first
touched. A hint only: where the kernel has none, or this is not Linux, nothing changes.
MINIPAGED_HUGEPAGES=0 turns it off.
Only whole 2 MiB pages inside the allocation are advised. The packed weight panels (read end to end,
6 MB a matrix at the 0.6B shape) were tried too: one huge page of three per matrix (malloc aligns to
4 KiB) and no difference measured at 1 or 4 rows, so they stay as they are."""
from __future__ import annotations

import ctypes
import os
import sys

import torch

_HUGE = 1 << 21
_MADV_HUGEPAGE = 14


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, its whole 2 MiB pages advised to be huge (nothing touched yet)."""
    t = torch.empty(shape, dtype=dtype)
    if os.environ.get("MINIPAGED_HUGEPAGES", "1") != "0":
        advise(t.data_ptr(), t.numel() * t.element_size())
    return t


def advise(ptr: int, nbytes: int) -> None:
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    length = (ptr + nbytes - start) & ~(_HUGE - 1)
    if length <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
