"""The ordered step pipe behind StepStream (and the TCP data link): a stage runs the steps of one
stream one after another, hands each forward without waiting for it, and keeps the replies in
order. A pump thread runs the steps; `out` holds (reply, ready_at) pairs for whoever answers the
caller; a link to the next stage (gRPC stream, or the TCP data link when both stages offer it)
carries the steps on and relays what comes back."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb

log = logging.getLogger("worker.step_stream")


class StepError(Exception):
    """A step this stage refuses or fails: the gRPC status and what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def wait_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def upstream_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """A next stage that is down or too slow is UNAVAILABLE to whoever called us."""
    return grpc.StatusCode.UNAVAILABLE if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                   grpc.StatusCode.CANCELLED) else code


def relayed(down: pb.StepReply, timing: pb.StageTiming, step_id: int, epoch: int) -> pb.StepReply:
    # every field of the reply (sampled tokens, logprobs, prompt logprobs, ...) travels up as it came
    out = pb.StepReply()
    out.CopyFrom(down)
    out.step_id, out.cache_epoch = step_id, epoch
    del out.timings[:]
    out.timings.extend([timing, *down.timings])
    return out


def error_reply(step_id: int, code: grpc.StatusCode, message: str, epoch: int) -> pb.StepReply:
    return pb.StepReply(step_id=step_id, error_code=code.value[0], error=message, cache_epoch=epoch)


class StepPipe:
    """One stream of steps into this stage."""

    def __init__(self, servicer):
        self.s = servicer
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.link = None
        self.sent: dict[int, tuple[pb.StageTiming, list[int]]] = {}   # forwarded step -> (timing, sampled)
        self.cancelled = threading.Event()

    def pump(self, requests) -> None:
        """`requests` yields StepRequests, or (StepRequest, hidden bytes) when the hidden states came
        outside the message (the TCP data link)."""
        try:
            for item in requests:
                if self.cancelled.is_set():
                    break
                request, hidden = item if isinstance(item, tuple) else (item, None)
                self._one(request, hidden)
        except grpc.RpcError:
            pass  # the caller went away
        except Exception:  # never leave the caller waiting on a dead pump
            log.exception("step stream failed")
        finally:
            if self.link is not None:
                self.link.close(wait_s=self.s.rpc_timeout_s)  # relay what is still down the chain
            self.out.put(None)

    def _one(self, request, hidden=None) -> None:
        s = self.s
        try:
            o = s._process(request, hidden)
        except StepError as e:
            self.out.put((error_reply(request.step_id, e.code, e.message, s.epoch), 0.0))
            return
        if o.reply is not None:
            if request.reply_direct and not s.runner.is_first:
                results = s.results
                if results is not None:
                    results.put((o.reply, o.ready_at))
                else:
                    self.out.put((error_reply(request.step_id, grpc.StatusCode.FAILED_PRECONDITION,
                                              "the last stage has no StepResults subscriber for this epoch",
                                              s.epoch), 0.0))
                return
            self.out.put((o.reply, o.ready_at))
            return
        if self.link is None:
            try:
                self.link = s.next_stage.open_link(self._relay, self._failed)
            except StepError as e:
                self.out.put((error_reply(request.step_id, e.code, e.message, s.epoch), 0.0))
                return
        first = s.runner.is_first and o.sampled_ids.size > 0
        self.sent[request.step_id] = (o.timing, o.sampled_ids if first else None)
        if first:
            s.store.note_forwarded(o.sampled_ids)
        self.link.send(o.forward, o.ready_at, track=not request.reply_direct, hidden=o.hidden)

    def _relay(self, down: pb.StepReply) -> None:
        timing, sampled = self.sent.pop(down.step_id, (pb.StageTiming(), None))
        if sampled is not None:
            toks = wire.unpack(down.sampled_token_ids) if not down.error_code else None
            self.s.store.record_sampled(sampled, toks, forwarded=True)
        self.out.put((relayed(down, timing, down.step_id, self.s.epoch), 0.0))

    def _failed(self, step_id: int, code: grpc.StatusCode, message: str) -> None:
        _, sampled = self.sent.pop(step_id, (None, []))
        if sampled:
            self.s.store.record_sampled(sampled, None, forwarded=True)
        self.out.put((error_reply(step_id, code, message, self.s.epoch), 0.0))

    def cancel(self) -> None:
        self.cancelled.set()
        if self.link is not None:
            self.link.cancel()


