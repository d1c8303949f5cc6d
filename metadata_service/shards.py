"""The shard services behind a sharded front (`--shards N` or `--shard-addresses`): how they start,
how the front reaches them, what it knows of them, and which shard a worker joins.

Each shard is a whole metadata service (its chains, schedulers, KVBlockManagers, job store) in a
process of its own, so chains in different shards never wait for one interpreter lock. The front
keeps only what it can learn again: each shard's latest Stats (polled) and which shard each worker
address and replica group went to (a worker that registers again returns to its shard)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import grpc

from minipaged.constants import grpc_options
from minipaged.signals import PARENT_ENV
from minipaged.v1 import metadata_pb2, metadata_pb2_grpc

from .front_routing import ShardRouter

log = logging.getLogger("metadata_service.shards")

# flags the front keeps for itself: its address, its store (each shard gets PATH.shardK), its TLS
# (shards serve plain gRPC on loopback), and the sharding flags themselves
FRONT_ONLY = {"--shards": 1, "--shard-addresses": 1, "--host": 1, "--port": 1, "--db": 1, "--tls-cert": 1,
              "--tls-key": 1, "--tls-client-ca": 1, "--grace": 1, "--metrics-port": 1}
STATS_PERIOD_S = 0.5


def shard_argv(argv: list[str]) -> list[str]:
    """The front's command line minus what only the front uses."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in FRONT_ONLY:
            skip = 0 if "=" in a else FRONT_ONLY[name]
            continue
        out.append(a)
    return out


class ShardProcesses:
    """The shard services a front started (`--shards N`), on loopback ports of their own; one that
    dies is started again on its store (ShardSet's poller asks), so its jobs resume."""

    def __init__(self, n: int, argv: list[str], db: str, timeout_s: float = 60.0, metrics: bool = False):
        self.argv, self.db, self.timeout_s = shard_argv(argv), db, timeout_s
        if metrics:                            # each shard on a port of its own; the front reads them
            self.argv += ["--metrics-port", "0"]
        self.procs = [self._launch(k) for k in range(n)]
        self.addresses, self.metrics_urls = [], [None] * n
        for k in range(n):
            self.addresses.append(self._listening(k))

    def _launch(self, k: int):
        cmd = [sys.executable, "-m", "metadata_service", "--host", "127.0.0.1", "--port", "0"]
        cmd += (["--db", f"{self.db}.shard{k}"] if self.db else []) + self.argv
        # a shard ends with its front, even when the front is killed -9 (minipaged/signals.py)
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def _listening(self, k: int) -> str:
        """Shard k's address once it says LISTENING (started again while it exits at once: the
        shard of a front killed a moment ago may still hold this store while it stops)."""
        deadline, line = time.monotonic() + self.timeout_s, ""
        while time.monotonic() < deadline and not line.startswith("LISTENING"):
            line = self.procs[k].stdout.readline()
            if not line and self.procs[k].poll() is not None:
                time.sleep(0.5)
                self.procs[k] = self._launch(k)
        if not line.startswith("LISTENING"):
            self.stop()
            raise RuntimeError(f"shard {k} did not start (exit code {self.procs[k].poll()}); its log is above")
        threading.Thread(target=_drain, args=(self.procs[k],), daemon=True).start()
        words = line.split()
        if "metrics" in words:
            self.metrics_urls[k] = f"http://{words[words.index('metrics') + 1]}/metrics"
        return words[1]

    def dead(self) -> list[int]:
        return [k for k, p in enumerate(self.procs) if p.poll() is not None]

    def restart(self, k: int) -> str:
        log.warning("shard %d exited (code %s): starting it again", k, self.procs[k].poll())
        self.procs[k] = self._launch(k)
        self.addresses[k] = self._listening(k)
        return self.addresses[k]

    def stop(self, grace_s: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()


def _drain(p) -> None:
    for _ in p.stdout:  # a shard prints nothing more; keep its pipe from filling anyway
        pass


class ShardSet:
    """Stubs to the shards, their latest Stats, and where workers go."""

    def __init__(self, addresses: list[str], processes: ShardProcesses | None = None, token: str | None = None):
        self.addresses = list(addresses)
        self._md = (("authorization", f"Bearer {token}"),) if token else ()   # the front's own Stats calls
        self.processes = processes
        self.channels = [grpc.insecure_channel(a, options=grpc_options()) for a in addresses]
        self.stubs = [metadata_pb2_grpc.MetadataServiceStub(c) for c in self.channels]
        self.stats: list[metadata_pb2.StatsReply | None] = [None] * len(addresses)
        self.router = ShardRouter(len(addresses))   # Generate streams: prefix overlap against load
        self.lock = threading.Lock()
        self.by_address: dict[str, int] = {}   # worker address -> shard
        self.by_group: dict[str, int] = {}     # replica group (or pipeline stages of the default group) -> shard
        self._placed = [0] * len(addresses)    # workers sent to each shard since the last Stats poll
        self.on_ready_changed: list = []
        self._ready = False
        self._stop = threading.Event()
        self.polled_at = 0.0
        self._restarting = threading.Lock()

    def __len__(self) -> int:
        return len(self.stubs)

    # ------------------------------------------------------------------ Stats
    def start(self) -> "ShardSet":
        self.poll()
        threading.Thread(target=self._poll_loop, daemon=True, name="shard-stats").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _poll_loop(self) -> None:
        while not self._stop.wait(STATS_PERIOD_S):
            self.poll(restart=True)

    def _restart_dead(self) -> None:
        if self.processes is None or not self._restarting.acquire(blocking=False):
            return  # another thread restarts them
        try:
            self._restart_each()
        finally:
            self._restarting.release()

    def _restart_each(self) -> None:
        for k in self.processes.dead():
            try:
                address = self.processes.restart(k)
            except RuntimeError as e:
                log.error("%s", e)
                continue
            channel = grpc.insecure_channel(address, options=grpc_options())
            self.addresses[k], self.stubs[k] = address, metadata_pb2_grpc.MetadataServiceStub(channel)
            self.channels[k], old = channel, self.channels[k]
            old.close()

    def fresh_weights(self, max_age_s: float = 0.1) -> list[int]:
        """weights() from Stats at most max_age_s old (a job split on a stale view could leave a
        shard whose chain just came up without work). A shard about to get nothing is asked again
        first: the last poll may have begun just before its chain came up."""
        if time.monotonic() - self.polled_at > max_age_s:
            self.poll(restart=False)
        elif 0 in self.weights():
            self.poll(restart=False)
        return self.weights()

    def poll(self, restart: bool = False) -> None:
        """Every shard's Stats; with `restart` (the poller thread only: a shard's death signal is tied to
        the thread that started it) dead shards are started again first."""
        self.polled_at = time.monotonic()
        if restart:
            self._restart_dead()
        for k, stub in enumerate(self.stubs):
            try:
                self.stats[k] = stub.Stats(metadata_pb2.StatsRequest(), timeout=2.0, metadata=self._md)
            except grpc.RpcError:
                self.stats[k] = None
            self._placed[k] = 0      # (a worker placed during the call may be counted twice: harmless)
            self.router.polled(k)
        ready = any(s is not None and s.ready for s in self.stats)
        if ready != self._ready:
            self._ready = ready
            for cb in self.on_ready_changed:
                cb(ready)

    def weights(self) -> list[int]:
        """How many requests of a job each shard should take: its ready chains (all alike while none)."""
        chains = [s.num_chains if s is not None and s.ready else 0 for s in self.stats]
        if any(chains):
            return chains
        up = [0 if s is None else 1 for s in self.stats]
        return up if any(up) else [1] * len(self.stubs)

    # ------------------------------------------------------------------ workers
    def _workers(self, k: int) -> float:
        """Shard k's workers as its last Stats counted them (those that left are gone from it),
        plus those sent there since; a shard that does not answer comes last."""
        st = self.stats[k]
        if st is None:
            return float("inf") if any(self.stats) else self._placed[k]
        return st.num_workers + self._placed[k]

    def shard_for_worker(self, info) -> int:
        """A worker's shard. Stages of one chain must meet in one shard: a named replica group stays in
        one, and so do the default group's pipeline stages and prefill/decode workers (their K/V moves
        stay inside a service). Whole-model workers of the default group spread over the shards."""
        whole = info.layer_start == 0 and info.layer_end == info.num_layers and info.role in ("", "both")
        key = info.replica_group or (None if whole else "\0")
        with self.lock:
            if info.address in self.by_address:
                return self.by_address[info.address]
            if key is not None and key in self.by_group:
                k = self.by_group[key]
            else:
                k = min(range(len(self.stubs)), key=lambda i: (self._workers(i), i))
                self._placed[k] += 1
                if key is not None:
                    self.by_group[key] = k
            self.by_address[info.address] = k
            return k
