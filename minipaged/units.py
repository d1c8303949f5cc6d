"""Sizes in words a person reads at a glance: "112 MiB", "16,384 tokens" (logs, not wire)."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """Binary units, three significant digits at most: 117440512 -> '112 MiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.3g} {unit}"


def kv_capacity(num_blocks: int, block_size: int, total_bytes: int | None = None) -> str:
    """'1024 blocks x 16 tokens = 16,384 tokens, 112 MiB'."""
    words = f"{num_blocks} blocks x {block_size} tokens = {num_blocks * block_size:,} tokens"
    return words + (f", {human_bytes(total_bytes)}" if total_bytes else "")
