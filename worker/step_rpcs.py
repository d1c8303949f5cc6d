"""The RPCs that carry Steps and what they produce; each step runs the one step function (`_process`,
worker/step_execution.py):
- `StepStream` (the metadata service's path): Steps arrive in order on one stream, several in
  flight. A StepPipe (worker/step_stream.py) runs them one after another (so micro-batches keep their
  order on every stage, which is what makes freeing and reusing blocks between micro-batches safe)
  and hands each to the next stage without waiting for it. What comes back on it is errors, in-band
  (StepReply.error_code), so one bad step does not end the stream.
- `StepResults`: the last stage's replies to the StepStream's steps, straight to the metadata
  service (the one way back, whatever the chain's length).
- `SampledTokenStream`: stage 0's end of the last stage's tokens (worker/first_stage.py), for the
  -1 inputs of the steps sent after first_gets_tokens steps.
- `Step` (unary, for tools and tests): one step, forwarded with a unary call.
Without TLS the metadata service sends its Steps and reads the results on the TCP data link
(worker/data_link.py) instead of StepStream / StepResults: the same messages, order and errors in
socket frames, each one cheaper than a streamed gRPC message.

A mixin of WorkerServicer (worker/server.py): it reads `runner`, `epoch`, `store`, `next_stage`, `awaiting`,
`streams` and `results`."""
from __future__ import annotations

import queue
import threading

import grpc
import numpy as np

from minipaged import wire
from minipaged.v1 import worker_pb2 as pb
from worker.data_link import payload_bytes
from worker.step_stream import StepError, StepPipe, relayed, upstream_code, wait_until


class StepRpcs:
    def Step(self, request, context):
        """Unary: one step, forwarded to the next stage with a unary call."""
        try:
            o = self._process(request)
        except StepError as e:
            context.abort(e.code, e.message)
        wait_until(o.ready_at)
        if o.reply is not None:
            return o.reply
        first = self.runner.is_first and o.sampled_ids.size > 0
        if first:   # a unary chain relays the tokens back through us
            ticket = self.store.note_forwarded(o.sampled_ids)
        if o.hidden is not None:  # unary steps always carry the bytes inside the message
            o.forward.hidden_states = payload_bytes(o.hidden)
        try:
            down = self.next_stage.step(o.forward)
        except grpc.RpcError as e:
            if first:
                self.store.record_forwarded(ticket, None)
            context.abort(upstream_code(e.code()), f"next stage {self.next_stage.address}: {e.details()}")
        if first:
            self.store.record_forwarded(ticket, wire.unpack(down.sampled_token_ids))
        return relayed(down, request.step_id, self.epoch)

    def StepResults(self, request, context):
        """The last stage's replies to the steps of this epoch, in order."""
        if not self.runner.is_last or self.epoch == 0 or request.cache_epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"StepResults needs the last stage at the chain's epoch (this stage serves "
                          f"[{self.runner.layer_start}, {self.runner.layer_end}), epoch {self.epoch})")
        q = self.subscribe_results()
        context.add_callback(lambda: q.put(None))
        try:
            yield pb.StepReply(step_id=0, cache_epoch=self.epoch)   # subscribed: steps may flow now
            yield from self.published(q)
        finally:
            self.unsubscribe_results(q)

    def subscribe_results(self, q=None):
        """The queue the last stage's replies go to from now on (StepResults, on gRPC or on the
        data link, whose FrameLine stands for it): one subscriber per epoch, the newest wins."""
        q = q if q is not None else queue.SimpleQueue()
        old, self.results = self.results, q
        if old is not None:
            old.put(None)
        return q

    def published(self, q: queue.SimpleQueue):
        """The replies put on subscriber queue `q`, each once its device has it, until `q` ends
        (None: a newer subscriber, a new epoch, or the subscriber left)."""
        while True:
            item = q.get()
            if item is None:
                return
            reply, ready_at = item
            wait_until(ready_at)
            yield reply

    def unsubscribe_results(self, q: queue.SimpleQueue) -> None:
        if self.results is q:
            self.results = None

    def SampledTokenStream(self, request_iterator, context):
        for t in request_iterator:
            self.sampled_tokens(t)
        return pb.SampledTokensReply()

    def sampled_tokens(self, t: pb.SampledTokens) -> None:
        """One step's tokens from the last stage (SampledTokenStream or the data link)."""
        if t.cache_epoch == self.epoch:
            try:
                tokens = wire.unpack(t.token_ids, name="token_ids")
            except wire.WireError:
                tokens = None                 # unreadable: the -1 waiting on them fails now
            self.tokens_arrived(t.step_id, tokens)

    def await_tokens(self, step_id: int, sampled_ids: np.ndarray) -> None:
        """Stage 0 forwarded a first_gets_tokens step: a later -1 input of these sequences waits."""
        self.awaiting[step_id] = self.store.note_forwarded(sampled_ids)

    def tokens_arrived(self, step_id: int, tokens: np.ndarray | None) -> None:
        """A step's tokens (from the last stage), or None: it failed, none is coming (step id 0:
        the chain broke, for every step awaited)."""
        if step_id == 0 and tokens is None:
            steps = list(self.awaiting)
        else:
            steps = [step_id] if step_id in self.awaiting else []
        for sid in steps:
            ticket = self.awaiting.pop(sid, None)
            if ticket is not None:   # a count that does not match is no token either: fail, not wait
                ok = tokens is not None and tokens.size == ticket.size
                self.store.record_forwarded(ticket, tokens if ok else None)

    def StepStream(self, request_iterator, context):
        stream = StepPipe(self)
        context.add_callback(stream.cancel)
        self.streams.add(stream)
        threading.Thread(target=stream.pump, args=(request_iterator,), name="step-stream", daemon=True).start()
        try:
            while True:
                item = stream.out.get()
                if item is None:
                    return
                reply, ready_at = item
                wait_until(ready_at)  # an asynchronous device: not before its results exist
                yield reply
        finally:
            self.streams.discard(stream)
            stream.cancel()
