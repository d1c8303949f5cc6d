"""The ordered step pipe behind StepStream (and the TCP data link): a stage runs the steps of one
stream one after another and hands each forward without waiting for it. The last stage's replies go
to its StepResults subscriber (the metadata service); `out` holds what goes back up this stream,
which is errors only (this stage's, or relayed from further down), as (reply, ready_at) pairs.

Stage 0 of a pipeline that sends first_gets_tokens steps waits for their tokens, which the last
stage sends it (worker/first_stage.py); an error for such a step coming back up through stage 0
says no token is coming, so a later -1 input fails at once instead of waiting."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from minipaged.v1 import worker_pb2 as pb

log = logging.getLogger("worker.step_stream")


class StepError(Exception):
    """A step this stage refuses or fails: the gRPC status and what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class PendingHidden:
    """A split step's hidden states before their data frame came (worker/link_frames.py): `len()` is
    their announced size (all validation needs); `get()` reads the link's frames on until they are here."""

    def __init__(self, length: int, reader):
        self.length, self.reader = length, reader
        self.data = self.release = None
        self.filled = False

    def __len__(self) -> int:
        return self.length

    def get(self):
        while not self.filled:
            if not self.reader.advance():
                raise StepError(grpc.StatusCode.UNAVAILABLE, "the previous stage's link ended before this step's "
                                                             f"hidden states came ({self.reader.why})")
        return self.data

    def settle(self) -> None:
        """A step refused before its data came still takes its data frame (the next step's is after)."""
        try:
            self.get()
        except StepError:
            pass


def wait_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def upstream_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """A next stage that is down or too slow is UNAVAILABLE to whoever called us."""
    return grpc.StatusCode.UNAVAILABLE if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                   grpc.StatusCode.CANCELLED) else code


def relayed(down: pb.StepReply, step_id: int, epoch: int) -> pb.StepReply:
    """The next stage's reply as this stage's (unary Step): every field travels up as it came."""
    out = pb.StepReply()
    out.CopyFrom(down)
    out.step_id, out.cache_epoch = step_id, epoch
    return out


def error_reply(step_id: int, code: grpc.StatusCode, message: str, epoch: int) -> pb.StepReply:
    return pb.StepReply(step_id=step_id, error_code=code.value[0], error=message, cache_epoch=epoch)


class StepPipe:
    """One stream of steps into this stage."""

    def __init__(self, servicer):
        self.s = servicer
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.link = None
        self.cancelled = threading.Event()

    def pump(self, requests) -> None:
        """`requests` yields StepRequests, or (StepRequest, hidden bytes, release) when the hidden
        states came outside the message (the TCP data link; `release` frees a shared-memory frame,
        None for bytes of its own)."""
        try:
            for item in requests:
                if self.cancelled.is_set():
                    break
                request, hidden, release = item if isinstance(item, tuple) else (item, None, None)
                forwarded = self._one(request, hidden, release)
                if isinstance(hidden, PendingHidden):
                    hidden.settle()           # a refused split step's data frame is still taken
                    release = hidden.release
                if not forwarded and release is not None:
                    release()
        except grpc.RpcError:
            pass  # the caller went away
        except Exception:  # never leave the caller waiting on a dead pump
            log.exception("step stream failed")
        finally:
            if self.link is not None:
                self.link.close(wait_s=self.s.rpc_timeout_s)  # relay the errors still down the chain
            self.out.put(None)

    def _one(self, request, hidden=None, release=None) -> bool:
        """Run one step and send on what it makes. True when `release` went with the forward (the
        link calls it once the bytes, which may be the input's own, have left)."""
        s = self.s
        if request.kv_pull_dst_blocks or request.kv_sources:
            self._move(request)
            return False
        try:
            o = s._process(request, hidden)
        except StepError as e:
            self._error(request.step_id, e)
            return False
        if o.reply is not None:          # the last stage: straight to the metadata service
            if request.first_gets_tokens and o.sampled_ids.size:
                s.first_stage.send(request.step_id, s.epoch, o.sampled_ids.tobytes(), o.reply.sampled_token_ids,
                                   o.ready_at)
            self._reply(request.step_id, o)
            return False
        try:
            self._open_link()
        except StepError as e:
            self._error(request.step_id, e)
            return False
        if request.first_gets_tokens and s.runner.is_first and o.sampled_ids.size:
            s.await_tokens(request.step_id, o.sampled_ids)
        if isinstance(hidden, PendingHidden):
            release = hidden.release          # known now: the step ran, so its data came
        self.link.send(o.forward, o.ready_at, hidden=o.hidden, done=release)
        return True

    def _move(self, request) -> None:
        """A K/V move (worker/kv_move.py): taken here, in stream order; its bytes come on the
        stage's PullQueue while the next steps run, and then it goes on like any step."""
        s = self.s
        try:
            pending = s._start_move(request)
            if not s.runner.is_last:
                self._open_link()
        except StepError as e:
            self._error(request.step_id, e)
            return
        s.pulls.put(lambda: s._finish_move(pending), self._moved, lambda e: self._error(request.step_id, e))

    def _moved(self, o) -> None:
        if o.reply is not None:
            self._reply(o.reply.step_id, o)
        else:
            self.link.send(o.forward, o.ready_at, hidden=o.hidden)

    def _open_link(self) -> None:
        if self.link is None:
            self.link = self.s.next_stage.open_link(self._relay, self._failed)

    def _reply(self, step_id: int, o) -> None:
        results = self.s.results
        if results is not None:
            results.put((o.reply, o.ready_at))
        else:
            self.out.put((error_reply(step_id, grpc.StatusCode.FAILED_PRECONDITION,
                                      "the last stage has no StepResults subscriber for this epoch",
                                      self.s.epoch), 0.0))

    def _error(self, step_id: int, e: StepError) -> None:
        self.out.put((error_reply(step_id, e.code, e.message, self.s.epoch), 0.0))

    def _relay(self, down: pb.StepReply) -> None:
        """An error from further down the chain: no token of that step is coming; up it goes."""
        self.s.tokens_arrived(down.step_id, None)
        self.out.put((relayed(down, down.step_id, self.s.epoch), 0.0))

    def _failed(self, step_id: int, code: grpc.StatusCode, message: str) -> None:
        self.s.tokens_arrived(step_id, None)      # 0: the chain broke, none is coming
        self.out.put((error_reply(step_id, code, message, self.s.epoch), 0.0))

    def cancel(self) -> None:
        self.cancelled.set()
        if self.link is not None:
            self.link.cancel()
