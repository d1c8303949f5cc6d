"""The three RPCs that carry Steps; each runs the one step function (`_process`,
worker/step_execution.py):
- `StepStream` (the metadata service's path): Steps arrive in order on one stream, several in
  flight. A StepPipe (worker/step_stream.py) runs them one after another (so micro-batches keep their
  order on every stage, which is what makes freeing and reusing blocks between micro-batches safe)
  and hands each to the next stage without waiting for it; replies come back in order. Errors are
  in-band (StepReply.error_code) so one bad step does not end the stream.
- `StepResults`: the last stage's replies to reply_direct steps, straight to the caller.
- `Step` (unary, for tools and tests): one step, forwarded with a unary call.

A mixin of WorkerServicer (worker/server.py): it reads `runner`, `epoch`, `store`, `next_stage`,
`streams` and `results`."""
from __future__ import annotations

import queue
import threading

import grpc

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
        if first:
            self.store.note_forwarded(o.sampled_ids)
        if o.hidden is not None:  # unary steps always carry the bytes inside the message
            o.forward.hidden_states = payload_bytes(o.hidden)
        try:
            down = self.next_stage.step(o.forward)
        except grpc.RpcError as e:
            if first:
                self.store.record_sampled(o.sampled_ids, None, forwarded=True)
            context.abort(upstream_code(e.code()), f"next stage {self.next_stage.address}: {e.details()}")
        if first:
            self.store.record_sampled(o.sampled_ids, wire.unpack(down.sampled_token_ids), forwarded=True)
        return relayed(down, o.timing, request.step_id, self.epoch)

    def StepResults(self, request, context):
        """The last stage's replies to reply_direct steps of this epoch, in order."""
        if not self.runner.is_last or self.epoch == 0 or request.cache_epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"StepResults needs the last stage at the chain's epoch (this stage serves "
                          f"[{self.runner.layer_start}, {self.runner.layer_end}), epoch {self.epoch})")
        q: queue.SimpleQueue = queue.SimpleQueue()
        if self.results is not None:
            self.results.put(None)               # one subscriber per epoch: the newest wins
        self.results = q
        context.add_callback(lambda: q.put(None))
        yield pb.StepReply(step_id=0, cache_epoch=self.epoch)   # subscribed: steps may flow now
        while True:
            item = q.get()
            if item is None:
                return
            reply, ready_at = item
            wait_until(ready_at)
            yield reply

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
