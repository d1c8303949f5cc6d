"""Keeps this worker registered with the metadata service, whatever order things start in.

A background thread: RegisterWorker (retried with capped exponential backoff until the service
answers), then Heartbeat at the interval the reply names. If the service says it does not know this
worker (it restarted, or dropped us) or heartbeats fail several times in a row, go back to
registering: a restarted metadata service gets its workers back without anyone touching them. On a
clean stop it deregisters, so the service re-forms its chains at once instead of waiting out the
lease and logging a hung worker."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from minipaged.v1 import metadata_pb2 as mpb
from minipaged.v1 import metadata_pb2_grpc as mpb_grpc
from minipaged.v1 import worker_pb2 as pb

log = logging.getLogger("worker.registration")

MAX_HEARTBEAT_FAILURES = 3  # then assume the service lost us and register again


class Registration:
    def __init__(self, metadata_address: str, info_fn: Callable[[], pb.WorkerInfo],
                 epoch_fn: Callable[[], int], *, default_interval_ms: int = 1000, rpc_timeout_s: float = 5.0,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, token: str = "",
                 channel_factory=None, on_rejected: Callable[[str], None] | None = None,
                 steps_fn: Callable[[], int] | None = None, on_ready: Callable[[bool], None] | None = None):
        self.address, self.info_fn, self.epoch_fn = metadata_address, info_fn, epoch_fn
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None  # --worker-token
        self.channel_factory = channel_factory  # (address, options) -> channel; None = plain text
        self.on_rejected = on_rejected          # the service refused us for good (another model)
        self.on_ready = on_ready or (lambda ok: None)  # readiness follows registration
        self.steps_fn = steps_fn or (lambda: 0)
        self.default_interval_ms = default_interval_ms  # when the reply names no interval
        self.rpc_timeout_s, self.backoff_s, self.max_backoff_s = rpc_timeout_s, backoff_s, max_backoff_s
        self.worker_id = ""
        self.registered = threading.Event()  # tests and logs: set while the service knows us
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-registration", daemon=True)

    def start(self) -> "Registration":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        factory = self.channel_factory or (lambda a, o: grpc.insecure_channel(a, options=o))
        with factory(self.address, ()) as channel:
            stub = mpb_grpc.MetadataServiceStub(channel)
            while not self._stop.is_set():
                interval_s = self._register(stub)
                if interval_s is None:
                    return  # stopped while retrying
                self.on_ready(True)
                self._heartbeat_until_lost(stub, interval_s)
                if self._stop.is_set():
                    self._deregister(stub)
                self.registered.clear()
                self.on_ready(False)

    def _deregister(self, stub) -> None:
        try:
            stub.DeregisterWorker(mpb.DeregisterWorkerRequest(worker_id=self.worker_id),
                                  timeout=min(self.rpc_timeout_s, 2.0), metadata=self.metadata)
            log.info("deregistered %s from %s", self.worker_id, self.address)
        except grpc.RpcError as e:  # an older service, or it is gone: its lease does the rest
            log.info("DeregisterWorker to %s failed (%s); the service will notice the lease run out",
                     self.address, e.code().name)

    def _register(self, stub) -> float | None:
        """Retry RegisterWorker until it answers; returns the heartbeat interval in seconds."""
        delay = self.backoff_s
        while not self._stop.is_set():
            try:
                reply = stub.RegisterWorker(mpb.RegisterWorkerRequest(info=self.info_fn()),
                                            timeout=self.rpc_timeout_s, metadata=self.metadata)
                self.worker_id = reply.worker_id
                self.registered.set()
                log.info("registered with %s as %s", self.address, reply.worker_id)
                return max(reply.heartbeat_interval_ms or self.default_interval_ms, 50) / 1000.0
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) \
                        and self.on_rejected is not None:
                    log.error("the metadata service %s refused this worker: %s", self.address, e.details())
                    self.on_rejected(e.details() or "")
                    return None
                log.warning("RegisterWorker to %s failed (%s: %s); retrying in %.1fs",
                            self.address, e.code().name, e.details(), delay)
            self._stop.wait(delay)
            delay = min(delay * 2, self.max_backoff_s)
        return None

    def _heartbeat_until_lost(self, stub, interval_s: float) -> None:
        failures = 0
        while not self._stop.wait(interval_s):
            try:
                reply = stub.Heartbeat(mpb.HeartbeatRequest(worker_id=self.worker_id, cache_epoch=self.epoch_fn(),
                                                            steps_served=self.steps_fn()),
                                       timeout=self.rpc_timeout_s, metadata=self.metadata)
            except grpc.RpcError as e:
                failures += 1
                log.warning("Heartbeat to %s failed (%d/%d): %s", self.address, failures,
                            MAX_HEARTBEAT_FAILURES, e.code().name)
                if failures >= MAX_HEARTBEAT_FAILURES:
                    return
                continue
            if not reply.known:
                log.warning("metadata service %s no longer knows worker %s%s; registering again",
                            self.address, self.worker_id, f" (it dropped it: {reply.reason})" if reply.reason else "")
                return
            failures = 0
