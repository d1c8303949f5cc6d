"""How a stage reaches the stage after it: the gRPC channel, the auth token, the next stage's cache
epoch, and the link a StepStream forwards on (the next stage's StepStream, or the TCP data link
when the next stage offers one). A last stage has no next stage: `stub` is None."""
from __future__ import annotations

import grpc

from minipaged.constants import grpc_options
from minipaged.v1 import worker_pb2 as pb
from minipaged.v1 import worker_pb2_grpc as pb_grpc
from worker.data_link import TcpStageLink
from worker.stage_link import StageLink
from worker.step_stream import StepError

GRPC_OPTIONS = grpc_options(so_reuseport=0)  # a second process on a taken port must fail, not share it


def insecure_channel(address: str, options) -> grpc.Channel:
    return grpc.insecure_channel(address, options=options)


class NextStage:
    def __init__(self, rpc_timeout_s: float):
        self.rpc_timeout_s = rpc_timeout_s
        self.address, self.token, self.meta, self.data_address = "", "", (), ""
        self.channel: grpc.Channel | None = None
        self.stub: pb_grpc.WorkerServiceStub | None = None
        self.epoch: int | None = None

    def connect(self, address: str, token: str, chain_epoch: int, data_address: str, channel_factory) -> None:
        """Point at the next stage named by InitCache ("" = this is the last stage). `data_address`:
        its TCP data link ("" = forward on its StepStream)."""
        self.close()
        # A chain epoch (the caller initialised the chain last stage first) is the next stage's too;
        # without one, the next stage's own epoch is pinned at the first forward.
        self.address, self.epoch = address, (chain_epoch or None)
        self.meta = (("authorization", f"Bearer {token}"),) if token else ()
        self.token, self.data_address = token, data_address
        self.channel = channel_factory(address, GRPC_OPTIONS) if address else None
        self.stub = pb_grpc.WorkerServiceStub(self.channel) if address else None

    def pin_epoch(self) -> int:
        """The next stage's cache epoch, asked once per InitCache when the caller chose none."""
        if self.epoch is None:
            try:
                h = self.stub.Health(pb.WorkerHealthRequest(), metadata=self.meta, timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                raise StepError(grpc.StatusCode.UNAVAILABLE, f"next stage {self.address}: {e.details()}") from None
            if not h.ready:
                raise StepError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"next stage {self.address} has no cache: call InitCache on it")
            self.epoch = h.cache_epoch
        return self.epoch

    def step(self, forward: pb.StepRequest) -> pb.StepReply:
        """One unary Step on the next stage (raises grpc.RpcError)."""
        return self.stub.Step(forward, metadata=self.meta, timeout=self.rpc_timeout_s)

    def open_link(self, on_reply, on_failed):
        """The link a StepPipe forwards on: the TCP data link when the next stage offers one, else
        its StepStream."""
        if self.data_address:
            try:
                return TcpStageLink(self.data_address, self.token, self.pin_epoch(), on_reply, on_failed)
            except (OSError, ConnectionError) as e:
                raise StepError(grpc.StatusCode.UNAVAILABLE, f"data link to {self.data_address}: {e}") from None
        return StageLink(self.stub, self.address, self.meta, on_reply, on_failed)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
