"""What every Step check shares: the limits it checks against (StepLimits), the error it raises
(StepValidationError: INVALID_ARGUMENT, the cache untouched) and a vectorised range check whose
message names the first offender."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepLimits:
    """What this worker can accept: the model's shapes and the allocated cache."""
    vocab_size: int
    hidden_size: int
    max_position: int
    num_blocks: int
    block_size: int
    is_first: bool
    tier_blocks: int = 0      # slots of the second KV tier (0 = none)
    is_last: bool = True      # samples: completes penalty histories from its own tokens


class StepValidationError(ValueError):
    """A Step request that must be rejected with INVALID_ARGUMENT."""


def fail(msg: str):
    raise StepValidationError(msg)


def check_range(name: str, arr: np.ndarray, lo, hi_excl) -> None:
    """All values in [lo, hi_excl); the message names the first offender (1-D or 2-D index)."""
    bad = (arr < lo) | (arr >= hi_excl)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        fail(f"{name}[{', '.join(map(str, idx))}] = {arr[idx]} is out of range [{lo}, {hi_excl})")
