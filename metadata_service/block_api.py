"""The block API: gRPC handlers over a shared KVBlockManager + lock.

BlockApi holds the handler logic (the lead's full servicer delegates to it); BlockApiServicer is a
thin MetadataServiceServicer that exposes only these five methods (tests, bench).
Every request is decoded and validated before the lock is taken; every manager call is all-or-
nothing, so an error reply means the state did not change.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import grpc
import numpy as np

from minipaged import wire
from minipaged.v1 import metadata_pb2 as pb
from minipaged.v1 import metadata_pb2_grpc as pb_grpc

from .block_manager import (BlockManagerError, DuplicateSequenceError, InvalidArgumentError, KVBlockManager,
                            OutOfBlocksError, UnknownSequenceError)

MAX_BLOCK_API_ID = 2 ** 62      # ids >= this belong to the scheduler's own sequences

_STATUS = [  # most specific first
    (UnknownSequenceError, grpc.StatusCode.NOT_FOUND),
    (DuplicateSequenceError, grpc.StatusCode.ALREADY_EXISTS),
    (OutOfBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (wire.WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (BlockManagerError, grpc.StatusCode.INTERNAL),
]


class _Abort(Exception):
    def __init__(self, code, message):
        self.code, self.message = code, message


@contextmanager
def _grpc_errors(context):
    """Typed errors -> gRPC status. abort() is called outside the except block so the reply
    carries only our message, and outside the manager lock."""
    failure = None
    try:
        yield
    except _Abort as e:
        failure = (e.code, e.message)
    except (BlockManagerError, wire.WireError) as e:
        failure = next((code, str(e)) for cls, code in _STATUS if isinstance(e, cls))
    if failure is not None:
        context.abort(*failure)


def _check_ids(ids, what: str = "sequence_id") -> None:
    ids = np.asarray(ids, dtype=np.int64)
    bad = (ids < 0) | (ids >= MAX_BLOCK_API_ID)
    if bad.any():
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"{what} {int(ids[bad][0])} out of range: block-API ids must be in [0, 2**62)")


def _check_tokens(tokens: np.ndarray, what: str) -> None:
    """Token ids are >= 0: -1 means "sampled, not known yet" only inside the scheduler, which fills it
    in; here nothing would, and the prefix cache would hash a block under a stale slot."""
    if tokens.size and int(tokens.min()) < 0:
        i = int(np.argmax(tokens < 0))
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"{what}[{i}] = {int(tokens[i])}: token ids must be >= 0 (num_tokens without token_ids "
                     f"appends tokens the cache does not know)")


class BlockApi:
    def __init__(self, manager: KVBlockManager, lock: threading.Lock | None = None):
        self.manager = manager
        self.lock = lock if lock is not None else threading.Lock()
        self._ok, self._dirty = True, True

    def invariants_ok(self) -> bool:
        """The pool's invariants as of its last change (the O(pool) check runs once per change,
        not on every Stats call)."""
        with self.lock:
            if self._dirty:
                self._ok, self._dirty = bool(self.manager.invariants_ok()), False
            return self._ok

    def CreateSequence(self, request, context):
        with _grpc_errors(context):
            sid = request.sequence_id
            _check_ids([sid])
            prompt = wire.unpack(request.prompt_token_ids, wire.INT32, name="prompt_token_ids")
            _check_tokens(prompt, "prompt_token_ids")
            if request.num_tokens < 0:
                raise InvalidArgumentError(f"num_tokens must be >= 0, got {request.num_tokens}")
            with self.lock:
                self._dirty = True   # Stats re-checks the invariants once after a change
                m = self.manager
                cached, slots = m.create_and_append(sid, prompt if prompt.size else None, request.num_tokens)
                st = m.sequences[sid]
                return pb.SequenceReply(sequence_id=sid, sequence_length=st.sequence_length,
                                        block_table=wire.pack(st.block_table),
                                        slot_mapping=wire.pack(slots), num_cached_tokens=cached)

    def AppendTokens(self, request, context):
        with _grpc_errors(context):
            ids = wire.unpack(request.sequence_ids, wire.INT64, name="sequence_ids")
            if ids.size == 0:
                raise InvalidArgumentError("sequence_ids is empty")
            _check_ids(ids)
            counts = None
            if request.num_tokens:
                counts = wire.unpack(request.num_tokens, wire.INT32, name="num_tokens", count=ids.size)
                if (counts < 0).any():
                    raise InvalidArgumentError("num_tokens must be >= 0")
            toks = None
            if request.token_ids:
                n = ids.size if counts is None else int(counts.sum(dtype=np.int64))
                toks = wire.unpack(request.token_ids, wire.INT32, name="token_ids", count=n)
                _check_tokens(toks, "token_ids")
            with self.lock:
                self._dirty = True   # Stats re-checks the invariants once after a change
                if counts is None:
                    slots = self.manager.slot_mapping_for_append(ids, toks)
                else:
                    slots = self.manager.append_tokens_batch(ids, counts, toks)
            return pb.AppendTokensReply(slot_mapping=wire.pack(slots))

    def ForkSequence(self, request, context):
        with _grpc_errors(context):
            _check_ids([request.parent_id], "parent_id")
            _check_ids([request.child_id], "child_id")
            with self.lock:
                self._dirty = True   # Stats re-checks the invariants once after a change
                pairs = self.manager.fork(request.parent_id, request.child_id)
            src = [s for s, _ in pairs]
            dst = [d for _, d in pairs]
            return pb.ForkSequenceReply(copy_src=wire.pack(src), copy_dst=wire.pack(dst))

    def ReleaseSequence(self, request, context):
        with _grpc_errors(context):
            _check_ids([request.sequence_id])
            with self.lock:
                self._dirty = True   # Stats re-checks the invariants once after a change
                freed = self.manager.release_sequence(request.sequence_id)
            return pb.ReleaseSequenceReply(freed_blocks=freed)

    def GetBlockTables(self, request, context):
        with _grpc_errors(context):
            ids = wire.unpack(request.sequence_ids, wire.INT64, name="sequence_ids")
            if ids.size == 0:
                raise InvalidArgumentError("sequence_ids is empty")
            _check_ids(ids)
            with self.lock:
                tables = self.manager.get_block_table_tensor(ids)
                lens = self.manager.get_seq_lens_tensor(ids)
            return pb.GetBlockTablesReply(block_tables=wire.pack(tables), max_blocks=tables.shape[1],
                                          seq_lens=wire.pack(lens))


class BlockApiServicer(pb_grpc.MetadataServiceServicer):
    """Only the block API; every other RPC stays UNIMPLEMENTED (the generated default)."""

    def __init__(self, api: BlockApi):
        self.api = api

    def CreateSequence(self, request, context):
        return self.api.CreateSequence(request, context)

    def AppendTokens(self, request, context):
        return self.api.AppendTokens(request, context)

    def ForkSequence(self, request, context):
        return self.api.ForkSequence(request, context)

    def ReleaseSequence(self, request, context):
        return self.api.ReleaseSequence(request, context)

    def GetBlockTables(self, request, context):
        return self.api.GetBlockTables(request, context)
