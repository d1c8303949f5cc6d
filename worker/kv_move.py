"""Prefill -> decode K/V moves between workers (docs/architecture.md section 9), both ends.

The metadata plane decides everything: which prefill blocks go into which decode blocks, and when.
A decode chain's move is a Step with no rows; each of its stages reads the blocks from the prefill
stage with the same layer range, over that stage's TCP data link (KV_MAGIC, minipaged/step_frames.py),
and writes them into its own cache. The source side reads without the step lock: the metadata plane
holds those blocks until the move is done, so no step writes them meanwhile.

The destination pulls beside its steps, not between them (as NIXL / Mooncake transfers do): the move
Step is taken in stream order (its tier saves run there, after every step sent before it), then its
read runs on this stage's PullQueue while the next steps compute; the metadata plane references
the destination blocks in no step until the move's reply is back, so nothing else touches them. The
reply (last stage) or the forward to the next stage leaves when the bytes are in.

A read that fails (the source died, restarted into another epoch, or refuses) fails the move with
UNAVAILABLE before this stage's cache is touched; the metadata plane then recomputes instead."""
from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from dataclasses import dataclass

import grpc
import numpy as np

from minipaged import wire
from minipaged.constants import KV_MOVE_TIMEOUT_S as MOVE_TIMEOUT_S
from minipaged.step_frames import KV_ANSWER, KV_MAGIC, connect, recv_exact
from worker.step_stream import StepError, wait_until
from worker.validate_common import StepValidationError, check_range, fail

log = logging.getLogger("worker.kv_move")


@dataclass
class KvMove:
    src: np.ndarray        # int32 [P] the source stage's blocks
    dst: np.ndarray        # int32 [P] this stage's blocks
    address: str           # the source stage's data link
    epoch: int             # its cache epoch


def parse_move(req, num_blocks: int, layer_start: int, layer_end: int) -> KvMove:
    """The move a no-row Step asks of this stage; raises StepValidationError (changes nothing)."""
    if req.query_start_loc or req.positions or req.input_ids:
        fail("a step that moves K/V (kv_pull_dst_blocks) carries no rows")
    src = wire.unpack(req.kv_pull_src_blocks, wire.INT32, name="kv_pull_src_blocks")
    dst = wire.unpack(req.kv_pull_dst_blocks, wire.INT32, name="kv_pull_dst_blocks", count=src.size)
    if not dst.size:
        fail("kv_pull_dst_blocks: a move needs at least one block")
    check_range("kv_pull_dst_blocks", dst, 0, num_blocks)
    if np.unique(dst).size != dst.size:
        fail("kv_pull_dst_blocks: a block appears twice")
    if (src < 0).any():
        fail("kv_pull_src_blocks: block ids must be >= 0")
    mine = [s for s in req.kv_sources if (s.layer_start, s.layer_end) == (layer_start, layer_end)]
    if len(mine) != 1:
        fail(f"kv_sources: needs exactly one source for layers [{layer_start}, {layer_end}), got {len(mine)} "
             f"(a move pairs stages of equal layer ranges)")
    if not mine[0].data_address or not mine[0].cache_epoch:
        fail("kv_sources: the source needs a data_address and its cache_epoch")
    return KvMove(src, dst, mine[0].data_address, mine[0].cache_epoch)


def read_remote_blocks(address: str, token: str, epoch: int, ids: np.ndarray,
                       timeout_s: float = MOVE_TIMEOUT_S) -> bytearray:
    """Blocks `ids` of the stage whose data link is `address`, at cache epoch `epoch`. Raises OSError /
    ConnectionError when it is gone, restarted (another epoch) or refuses."""
    sock, _ = connect(address, KV_MAGIC, token, epoch, timeout_s)
    try:
        sock.settimeout(timeout_s)
        ids = np.ascontiguousarray(ids, dtype="<i4")
        sock.sendall(struct.pack("<I", ids.size) + ids.tobytes())
        kind, n = KV_ANSWER.unpack(recv_exact(sock, KV_ANSWER.size))
        data = recv_exact(sock, n)
        if kind != b"K":
            raise ConnectionError(f"{address} refused the K/V read: {bytes(data).decode(errors='replace')}")
        return data
    finally:
        sock.close()


def serve_kv_read(servicer, conn: socket.socket) -> None:
    """The source end (the data link's KV_MAGIC connection, already greeted at this epoch)."""
    try:
        conn.sendall(b"OK")
        (count,) = struct.unpack("<I", recv_exact(conn, 4))
        nb = servicer.num_blocks
        try:
            if count > nb:
                raise StepValidationError(f"{count} blocks asked for, this cache has {nb}")
            ids = np.frombuffer(bytes(recv_exact(conn, 4 * count)), dtype="<i4")
            check_range("blocks", ids, 0, nb)
            data = servicer.runner.kv_cache.read_blocks(ids)
        except StepValidationError as e:
            msg = str(e).encode()
            conn.sendall(KV_ANSWER.pack(b"E", len(msg)) + msg)
            return
        conn.sendall(KV_ANSWER.pack(b"K", len(data)))
        conn.sendall(data)
    except (OSError, ConnectionError, struct.error):
        pass
    finally:
        conn.close()


class PullQueue:
    """This stage's moves, one after another on a thread of their own (one link, one buffer at a
    time), beside its steps."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def put(self, work, done, failed) -> None:
        """Run `work()` (-> an outcome with `ready_at`), then `done(outcome)` once it is ready, or
        `failed(StepError)`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-pull", daemon=True)
            self._thread.start()
        self._q.put((work, done, failed))

    def _run(self) -> None:
        while True:
            work, done, failed = self._q.get()
            try:
                outcome = work()
            except StepError as e:
                failed(e)
                continue
            except Exception as e:  # a bug: say so, never leave the move unanswered
                log.exception("K/V move failed")
                failed(StepError(grpc.StatusCode.INTERNAL, f"K/V move: {type(e).__name__}: {e}"))
                continue
            wait_until(outcome.ready_at)
            try:
                done(outcome)
            except Exception:
                log.exception("K/V move's answer could not be sent")
