"""The compiled CPU kernels (worker/cpu_attn_*.cpp and the files built with them) compile wherever a
C++ compiler is: a compile error only switches every CPU path to its torch fallback (logged once)
and the kernels' own tests to skips, so without this test a broken kernel file would pass CI."""
from __future__ import annotations

import os
import platform
import shutil

import pytest

from worker import cpu_kernels


@pytest.mark.skipif(shutil.which(cpu_kernels.CXX) is None, reason="no C++ compiler here")
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the kernels target x86-64")
@pytest.mark.skipif(os.environ.get("MINIPAGED_CPU_KERNELS", "1") == "0", reason="switched off")
def test_the_cpu_kernels_build_and_load_here():
    path = cpu_kernels.build_library()       # raises with the compiler's message
    assert os.path.exists(path)
    assert cpu_kernels.load_library() is not None
