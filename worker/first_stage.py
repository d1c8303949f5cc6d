"""The last stage's line back to stage 0 of its chain: the sampled tokens of first_gets_tokens steps.

With async scheduling across a pipeline, the metadata service sends a micro-batch's next step before
its tokens are known (input -1), and stage 0, which embeds them, waits for them. The last stage
samples them, so it sends them to stage 0 itself (InitCache's first_stage_address), one small message
per step, as soon as they exist; the reply goes to the metadata service on StepResults.

The messages go as frames on stage 0's data link (InitCache's first_stage_data_address, hello
TOKENS_MAGIC at the chain's epoch) when it offers one, else on one SampledTokenStream. They are on
the pipeline's critical path (stage 0 waits for them), and a gRPC streamed message costs ~0.3 ms of
interpreter time on each side. A link that does not answer falls back to gRPC. If the line breaks,
the next send opens a new one; a token that never arrives makes stage 0's step fail
FAILED_PRECONDITION after its wait, and the chain is re-formed.

A host device's tokens go on the data link from the step's own thread once nothing queued is
ahead of them (worker/frame_line.py, as the last stage's replies do): stage 0 waits for them."""
from __future__ import annotations

import logging
import threading

import grpc

from minipaged.step_frames import TOKENS_MAGIC, connect
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.frame_line import FrameLine
from worker.step_stream import wait_until

log = logging.getLogger("worker.first_stage")


class FirstStageLink:
    def __init__(self):
        self.address, self.data_address, self.token, self.epoch, self.meta = "", "", "", 0, ()
        self._channel: grpc.Channel | None = None
        self._line: FrameLine | None = None
        self._lock = threading.Lock()

    def connect(self, address: str, token: str, channel_factory, options, data_address: str = "",
                epoch: int = 0) -> None:
        """Point at stage 0 ("" = this stage is not the last of a multi-stage chain)."""
        self.close()
        self.address, self.data_address, self.token, self.epoch = address, data_address, token, epoch
        self.meta = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = channel_factory(address, options) if address else None

    def send(self, step_id: int, epoch: int, sequence_ids: bytes, token_ids: bytes, ready_at: float) -> None:
        """One step's tokens for stage 0: sent now, or queued for the line's thread."""
        if self._channel is None:
            return
        with self._lock:
            if self._line is None:
                self._line = self._open()
            line = self._line
        line.put((pb.SampledTokens(step_id=step_id, cache_epoch=epoch, sequence_ids=sequence_ids,
                                   token_ids=token_ids), ready_at))

    def _open(self) -> FrameLine:
        line = FrameLine("sampled tokens to stage 0")
        threading.Thread(target=self._run, args=(line,), name="tokens-to-first", daemon=True).start()
        return line

    def _run(self, line: FrameLine) -> None:
        sock = None
        if self.data_address:
            try:
                sock, _ = connect(self.data_address, TOKENS_MAGIC, self.token, self.epoch, 10.0)
                log.info("sampled tokens to stage 0 on the data link %s", self.data_address)
            except (OSError, ConnectionError) as e:
                log.info("sampled tokens to stage 0: data link %s: %s; on gRPC", self.data_address, e)
        try:
            if sock is None:
                self._stream(line)
            else:
                try:
                    line.write(sock)
                finally:
                    sock.close()
        finally:
            with self._lock:
                if self._line is line:
                    self._line = None    # the next send opens a new line

    @staticmethod
    def _messages(line: FrameLine):
        """The queued messages, each once its tokens exist (an asynchronous device: at ready_at)."""
        while (item := line.get()) is not None:
            msg, ready_at = item
            wait_until(ready_at)
            yield msg

    def _stream(self, line: FrameLine) -> None:
        try:
            pb_grpc.WorkerServiceStub(self._channel).SampledTokenStream(self._messages(line),
                                                                        metadata=self.meta or None)
        except grpc.RpcError as e:
            log.warning("sampled tokens to stage 0 (%s): %s %s", self.address, e.code().name, e.details())

    def close(self) -> None:
        with self._lock:
            if self._line is not None:
                self._line.put(None)
                self._line = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
