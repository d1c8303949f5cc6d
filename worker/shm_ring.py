"""Hidden states between two stages on one host: a byte ring in shared memory beside the data link.

A loopback socket costs ~2.4 ms of CPU on each side per 16 MB (the kernel copies through its socket
buffers); one memcpy into a shared mapping costs ~0.4 ms. vLLM's shm_broadcast MessageQueue does
the same for the workers of one node. The socket stays the control channel and keeps the order:
a frame names (offset, length, end) in the ring, the ring only holds the bytes.

One writer (the sending stage), one reader (the next stage). The file's first 64 bytes hold u64
`consumed`: how far the reader has freed the writer's byte stream. The writer puts a payload at
head % capacity (skipping to 0 rather than wrapping it), sleeps until the reader has freed room,
copies, and advances head. The reader computes on a frame where it lies (`hold`: a writable view,
no copy out) and frees it once the step is done with it, forwards included; frames free in ring
order whatever order their steps finish in. The file is unlinked as soon as the reader has opened
it (or refused to), so nothing is left in /dev/shm when either process dies. A reader
that cannot open it (another host, another container's /dev/shm) says so and the link carries the
bytes inline, as before. Space is reserved up front (posix_fallocate): a full /dev/shm refuses the
ring at once instead of killing a stage with SIGBUS mid-step."""
from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
import time
from collections import deque

import numpy as np

HEADER = 64
DEFAULT_CAPACITY = 64 << 20     # four 16 MB prefill payloads (2048 tokens x 4096 x bf16) in flight
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^minipaged-[0-9]+-[0-9a-f]{16}$")


def capacity_from_env() -> int:
    """MINIPAGED_DATA_SHM_MB: the ring's size in MiB; 0 turns shared memory off (payloads inline)."""
    mb = os.environ.get("MINIPAGED_DATA_SHM_MB", "")
    return DEFAULT_CAPACITY if not mb else max(0, int(mb)) << 20


class ShmRingWriter:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.name = f"minipaged-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER + capacity)
            self._mm = mmap.mmap(fd, HEADER + capacity)
        except OSError:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.capacity = capacity
        self._consumed = np.frombuffer(self._mm, dtype=np.uint64, count=1)   # the reader's position
        self._data = np.frombuffer(self._mm, dtype=np.uint8, offset=HEADER)
        self.head = 0

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def put(self, parts, stopped=lambda: False) -> tuple[int, int]:
        """Copy the parts (bytes-like) into the ring, one after the other; (offset, end). Sleeps
        while the reader has not freed enough room; ConnectionError once `stopped()` says so."""
        length = sum(len(p) for p in parts)
        if length > self.capacity:
            raise ValueError(f"{length} bytes do not fit a ring of {self.capacity}")
        pos = self.head % self.capacity
        start = self.head if pos + length <= self.capacity else self.head + self.capacity - pos
        end = start + length
        while end - int(self._consumed[0]) > self.capacity:
            if stopped():
                raise ConnectionError("the data link closed while waiting for ring space")
            time.sleep(0.0002)
        pos = start % self.capacity
        for p in parts:
            n = len(p)
            self._data[pos:pos + n] = np.frombuffer(p, dtype=np.uint8)
            pos += n
        self.head = end
        return start % self.capacity, end


class ShmRingReader:
    def __init__(self, name: str):
        if not _NAME.match(name):
            raise ValueError(f"not a ring name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size <= HEADER:
                raise ValueError("ring file too small")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.capacity = size - HEADER
        self._consumed = np.frombuffer(self._mm, dtype=np.uint64, count=1)
        self._view = memoryview(self._mm)[HEADER:]
        self._held: deque[list] = deque()      # [end, done] of frames handed out, in ring order
        self._lock = threading.Lock()

    def hold(self, offset: int, length: int, end: int) -> tuple[memoryview, object]:
        """One payload where it lies, writable (the stage may compute in it), and the callable that
        frees its room. Until then the writer cannot reuse it: a step holds its frame while it
        computes and forwards, which costs no copy (a fresh 2 MB copy out is ~0.4 ms here)."""
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ConnectionError(f"ring frame out of bounds: offset {offset} + {length} > {self.capacity}")
        frame = [end, False]
        with self._lock:
            self._held.append(frame)
        return self._view[offset:offset + length], lambda: self._free(frame)

    def _free(self, frame: list) -> None:
        """Frame done; `consumed` moves past every leading done frame (frees keep ring order)."""
        with self._lock:
            frame[1] = True
            while self._held and self._held[0][1]:
                self._consumed[0] = self._held.popleft()[0]
