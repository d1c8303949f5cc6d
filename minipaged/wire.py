"""Packed little-endian arrays on the wire (docs/architecture.md section 5): one memcpy per array, no varints."""
from __future__ import annotations

import numpy as np

INT32 = np.dtype("<i4")
INT64 = np.dtype("<i8")
UINT8 = np.dtype("u1")
FLOAT32 = np.dtype("<f4")
FLOAT64 = np.dtype("<f8")


class WireError(ValueError):
    """A byte field that does not decode to what the message says it holds."""


def pack(values, dtype=INT32) -> bytes:
    """Array-like -> packed bytes. Already-contiguous arrays of the right dtype are not copied."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype=INT32, *, name: str = "field", count: int | None = None) -> np.ndarray:
    """Packed bytes -> read-only 1-D array. Raises WireError if the length is wrong."""
    dtype = np.dtype(dtype)
    if len(data) % dtype.itemsize:
        raise WireError(f"{name}: {len(data)} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")
    arr = np.frombuffer(data, dtype=dtype)
    if count is not None and arr.size != count:
        raise WireError(f"{name}: expected {count} {dtype.name} values, got {arr.size}")
    return arr


def unpack_2d(data: bytes, rows: int, cols: int, dtype=INT32, *, name: str = "field") -> np.ndarray:
    """Packed row-major bytes -> [rows, cols] array."""
    return unpack(data, dtype, name=name, count=rows * cols).reshape(rows, cols)
