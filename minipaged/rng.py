"""splitmix64, the counter-based hash behind seeded sampling and the simulator's token hash.

One definition so that the sampler and the simulator stay bit-identical to each other and to
earlier releases (seeded outputs must not change between versions)."""
from __future__ import annotations

import numpy as np

GOLDEN_GAMMA = 0x9E3779B97F4A7C15   # 2^64 / golden ratio: splitmix64's increment, also a seed mixer
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 over a uint64 array (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(GOLDEN_GAMMA)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))
