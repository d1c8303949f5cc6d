"""Host-side launch logic shared by the kernel backends (worker/kernels/launch.py, source.py): the signature
table is built once, and launches past CUDA's grid and block limits are refused on the host with
a message that says what to change, before any kernel runs (a GPU would answer 'invalid argument')."""
from __future__ import annotations

import pytest
import torch

from worker.kernels import launch, source
from worker.kernels.emulated import EmulatedBackend
from worker.kernels.launch import Launch


def test_signatures_built_once_and_read_only():
    sigs = source.kernel_signatures()
    assert sigs is source.kernel_signatures()
    assert sigs["paged_prefill_bf16_d128"] == "PPPPPPPfiiiii"
    with pytest.raises(TypeError):
        sigs["paged_prefill_bf16_d128"] = "P"


@pytest.mark.parametrize("grid,block", [((1, 65536, 1), (128, 1, 1)), ((1, 1, 65536), (128, 1, 1)),
                                        ((2**31, 1, 1), (128, 1, 1)), ((1, 1, 1), (1025, 1, 1)),
                                        ((1, 1, 1), (32, 32, 2))])
def test_launch_limits(grid, block):
    with pytest.raises(ValueError, match="paged_prefill_f32_d64"):
        Launch("paged_prefill_f32_d64", grid, block, ())
    Launch("paged_prefill_f32_d64", (2**31 - 1, 65535, 65535), (1024, 1, 1), ())


def test_prefill_grid_y_refused_on_the_host():
    """16 query heads per KV head: q_tile = 32 / 16 = 2 queries per CTA, so a prefill longer than
    131,070 tokens per sequence per step would need more than 65,535 CTAs along y."""
    be = EmulatedBackend()
    H, KVH, D, bs = 16, 1, 64, 16
    assert launch.prefill_q_tile(H, KVH) == 2
    kc = torch.zeros(4, KVH, bs, D)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    q = torch.zeros(3, H, D)
    lens = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"65536 tiles of 2 .* at most 131070 tokens"):
        be.paged_prefill(q, kc, kc, tables, lens, qsl, 131071, 0.125)
    assert be.paged_prefill(q, kc, kc, tables, lens, qsl, 3, 0.125).shape == q.shape
