"""The Engine's upkeep thread (a mixin): it keeps the replica chains.

Workers whose lease ran out are dropped and their chains stopped; a chain whose stage re-registered
(restarted) is stopped too. Free workers (new, standby, or the survivors of a lost chain) are formed
into chains (metadata_service/workers.py), each initialised with a fresh cache epoch (last stage
first) and started. The stages of a chain that missed its step deadline are quarantined until their
Health says they compute nothing. Parked sequences are routed once a chain is ready; readiness and
`not_ready_reason` follow the chains."""
from __future__ import annotations

import logging
import queue
import secrets
import time

import grpc

from minipaged.units import kv_capacity
from minipaged.v1 import worker_pb2

from .backlog import waiting_reason
from .chain import ChainRunner
from .step_channel import data_address

log = logging.getLogger("metadata_service.engine")


def load_beats_recompute(stages, block_size: int) -> bool:
    """Section 9's rule for the tier: a load instead of a recompute (and a swap-out instead of a
    recompute after preemption) only when bytes / link bandwidth < FLOPs / achievable FLOP/s. The
    stages load in parallel and recompute one after another. Unknown figures (CPU workers, whose
    tier is their own RAM: loads win by ~100x) count as a win for the load."""
    load = [w.load_seconds(block_size) for w in stages]
    compute = [w.recompute_seconds(block_size) for w in stages]
    if not all(load) or not all(compute):
        return True
    return max(load) < sum(compute)


class ChainUpkeep:
    """Mixed into Engine: uses its registry, chains, route_lock, events and readiness fields."""

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._maintain()
            except Exception:  # never let the upkeep thread die silently
                log.exception("engine upkeep failed")
                time.sleep(0.1)
            self._wakeup.wait(0.05)
            self._wakeup.clear()

    def _maintain(self) -> None:
        while True:
            try:
                kind, chain = self._events.get_nowait()
            except queue.Empty:
                break
            chain.join(1.0)
            self.registry.drop([w.worker_id for w in chain.stages if not self._alive(w)])
            if chain.missed_deadline:  # which stage hangs is not known yet: none joins a chain until idle
                self.registry.quarantine([w.worker_id for w in chain.stages], chain.lost_reason)
        self._release_idle_quarantined()
        expired = set(self.registry.expired())
        if expired:
            for c in list(self.chains.values()):
                silent = [w.address for w in c.stages if w.worker_id in expired]
                if silent:
                    c.stop(f"worker {', '.join(silent)} missed its heartbeat lease "
                           f"({self.registry.lease_s:.1f}s): hung or gone")
            self.registry.drop(expired)
        known = {w.worker_id for w in self.registry.workers.values()}
        self._init_failures = {k: v for k, v in self._init_failures.items() if set(k) <= known}
        for c in list(self.chains.values()):  # a stage that re-registered (restarted) voids its chain
            if c.alive and any(w.worker_id not in known for w in c.stages):
                c.stop("a worker of the chain stopped (deregistered) or restarted")
        busy = {w.worker_id for c in self.chains.values() for w in c.stages} | set(self.registry.quarantined)
        now = time.monotonic()
        for stages in self.registry.form_chains(busy):
            failed = self._init_failures.get(tuple(w.worker_id for w in stages))
            unreachable = any(now < self._unreachable.get(w.address, (0,))[0] for w in stages)
            if (failed is None or now >= failed[0]) and not unreachable:   # a failed chain waits, backing off
                self._start_chain(stages)
        reason = self._unready_reason()
        with self.route_lock:
            self.not_ready_reason = reason
            parked = list(self.parked) if self.chains else []
            self.parked.clear() if parked else None
        if parked:
            self._route(parked)
        self._refresh_ready()
        self._fail_streams_if_waited_too_long()

    def _rebalance(self, new) -> None:
        """A chain that joins takes its share of the others' backlog: requests are routed once, on
        admission, so without this the ones queued before it formed would wait on their chains while
        it idles. Each busier chain hands back its newest never-started requests beyond the share,
        and the router places them again (reads of queue lengths are hints, as load() is)."""
        if new.role == "decode":                  # decode chains take moved-in requests only
            return
        peers = [c for c in list(self.chains.values()) if c.alive and c is not new and c.role != "decode"]
        waiting = {c: len(c.scheduler.waiting) for c in peers}
        share = sum(waiting.values()) // (len(peers) + 1)
        for c, n in waiting.items():
            if n > share:
                c.release(n - share)

    def _unready_reason(self) -> str:
        """Why no chain serves ("" while one does); upkeep and a lost chain both set it from here."""
        chains = [c for c in list(self.chains.values()) if c.alive]
        if chains:
            return ""
        busy = set(self.registry.quarantined)
        live = {w.worker_id for w in self.registry.workers.values()}
        failures = [why for ids, (_, _, why) in self._init_failures.items() if set(ids) <= live]
        addresses, now = {w.address for w in self.registry.workers.values()}, time.monotonic()
        failures += [why for a, (retry, _, why) in self._unreachable.items() if a in addresses or now < retry + 5]
        why = "; ".join(failures) or self.registry.explain(busy) or "no chain is ready"
        return "; ".join(r for r in (why, self._waiting_note()) if r)

    def _waiting_note(self) -> str:
        """Which model's pending job requests wait, and how to drop them (for not_ready_reason)."""
        now = time.monotonic()
        if now - self._backlog_note[0] >= 1.0:
            self._backlog_note = (now, waiting_reason(self.backlog(), self.cancel_command))
        return self._backlog_note[1]

    def _start_chain(self, stages) -> None:
        cap = min(w.capacity_blocks(self.block_size) for w in stages)
        if self.num_blocks_cap:
            cap = min(cap, self.num_blocks_cap)
        label = " -> ".join(w.address for w in stages)
        if cap < 1:                   # said to clients too (not_ready_reason), not only to the log
            key = tuple(w.worker_id for w in stages)
            small = min(stages, key=lambda w: w.capacity_blocks(self.block_size))
            why = (f"chain {label} can hold no block of {self.block_size} tokens: worker {small.address} has "
                   f"{small.info.kv_cache_bytes} bytes for K/V and one block of its layers takes "
                   f"{small.block_bytes(self.block_size)}; lower the service's --block-size or give the worker "
                   f"more K/V memory (--kv-cache-bytes)")
            if key not in self._init_failures:
                log.error("%s", why)
            self._init_failures[key] = (time.monotonic() + 30.0, 30.0, why)   # its budget is fixed: no hurry
            return
        epoch = secrets.randbits(62) + 1
        # a tier only when every stage has one (a block's K/V live on every stage)
        tier = 0 if self.cfg.kv_tier_policy == "off" else min(w.tier_capacity_blocks(self.block_size) for w in stages)
        tier = min(tier, 2**31 - 1)          # InitCacheRequest.tier_blocks is an int32
        if tier and not load_beats_recompute(stages, self.block_size):
            log.info("chain %s: no KV tier: loading a block over the host link would take longer than "
                     "recomputing it", " -> ".join(w.address for w in stages))
            tier = 0
        try:
            for i in reversed(range(len(stages))):
                nxt = stages[i + 1] if i + 1 < len(stages) else None
                data = data_address(nxt) if nxt is not None else ""
                first = stages[0].address if i == len(stages) - 1 and i > 0 else ""   # tokens back to stage 0
                first_data = data_address(stages[0]) if first else ""
                reply = stages[i].connect(self.registry.channel_factory).InitCache(worker_pb2.InitCacheRequest(
                    num_blocks=cap, block_size=self.block_size, next_stage_address=nxt.address if nxt else "",
                    next_stage_token=self.worker_token or "", cache_epoch=epoch, next_stage_data_address=data,
                    first_stage_address=first, first_stage_data_address=first_data, tier_blocks=tier), timeout=self.init_timeout_s, metadata=self._auth())
            epoch = reply.cache_epoch  # stage 0's word is what Steps must carry
        except grpc.RpcError as e:
            log.warning("InitCache on chain %s failed: %s %s", label, e.code().name, e.details())
            self._drop_unreachable([w for w in stages if not self._alive(w)], f"{e.code().name}: {e.details()}")
            key = tuple(w.worker_id for w in stages)
            delay = min(30.0, 2 * self._init_failures.get(key, (0, 0.5, ""))[1])   # 1, 2, 4 .. 30 s
            self._init_failures[key] = (time.monotonic() + delay, delay,
                                        f"InitCache on chain {label} failed: {e.code().name}: {e.details()}")
            return
        self._init_failures.pop(tuple(w.worker_id for w in stages), None)
        for w in stages:
            self._unreachable.pop(w.address, None)
        self.max_pool_blocks = max(cap, self.max_pool_blocks if self.chains else 0)   # (before calls wake)
        self._adopt_model(stages)
        chain = ChainRunner(next(self._chain_ids), stages, cap, epoch, self.cfg, self, stages[0].info.replica_group)
        if tier:
            chain.manager.attach_tier(tier, self.cfg.kv_tier_policy)
        with self.route_lock:
            self.chains[chain.chain_id] = chain
            # the approximate index predicts what the chain holds, so its size is the pool's and the tier's
            self.router.add_chain(chain.chain_id, cap + tier, self.cfg.max_num_seqs * chain.micro_batches,
                                  chain.manager.cached_hashes())
        chain.start()
        self._rebalance(chain)
        for cb in self.on_chain_started:
            cb(chain)
        kv_bytes = cap * sum(w.block_bytes(self.block_size) for w in stages)
        log.info("chain %d ready: %s, KV cache %s (%d stage(s)), %d micro-batches, epoch %d%s", chain.chain_id,
                 label, kv_capacity(cap, self.block_size, kv_bytes), len(stages), chain.micro_batches, epoch,
                 f", KV tier {tier} blocks ({self.cfg.kv_tier_policy})" if tier else "")

    def _refresh_ready(self) -> None:
        ready = any(c.alive for c in list(self.chains.values()))
        if ready != self.ready_event.is_set():
            (self.ready_event.set if ready else self.ready_event.clear)()
            if not ready:
                self.unready_since = time.monotonic()
            for cb in self.on_ready_changed:
                cb(ready)

    def _auth(self):
        return (("authorization", f"Bearer {self.worker_token}"),) if self.worker_token else None

    def _release_idle_quarantined(self) -> None:
        """A stage of a chain that missed its step deadline rejoins once its Health says it computes
        nothing (busy_ms 0): the healthy stages of that chain at once, the hung one when (if ever) its
        step ends. Polled at most once a second."""
        now = time.monotonic()
        if not self.registry.quarantined or now - self._quarantine_polled < 1.0:
            return
        self._quarantine_polled = now
        for wid in list(self.registry.quarantined):
            w = self.registry.workers.get(wid)
            if w is None:
                self.registry.quarantined.pop(wid, None)
                continue
            try:
                busy_ms = w.connect(self.registry.channel_factory).Health(
                    worker_pb2.WorkerHealthRequest(), timeout=1.0, metadata=self._auth()).busy_ms
            except grpc.RpcError:
                continue  # the lease decides about a worker that does not answer
            if busy_ms == 0:
                log.info("worker %s is idle again: it may join a chain", w.address)
                self.registry.quarantined.pop(wid, None)

    def _drop_unreachable(self, workers, error: str) -> None:
        """Workers whose registration came through but whose own port this service cannot reach (a
        wrong --advertise-address, TLS on one side only): dropped, told why at their next heartbeat,
        and kept out of chains by address, backing off (1, 2, 4 .. 30 s), while they re-register."""
        now = time.monotonic()
        for w in workers:
            why = (f"worker {w.address} registers, but this service cannot reach it there ({error}): check its "
                   f"--advertise-address, and TLS on both sides (a worker's --tls-cert needs --worker-tls-ca "
                   f"on the service, and --worker-tls-ca needs --tls-cert on the worker)")
            delay = min(30.0, 2 * self._unreachable.get(w.address, (0, 0.5, ""))[1])
            self._unreachable[w.address] = (now + delay, delay, why)
            self.registry.drop([w.worker_id], why)

    def _alive(self, w) -> bool:
        try:
            w.connect(self.registry.channel_factory).Health(worker_pb2.WorkerHealthRequest(), timeout=2,
                                                            metadata=self._auth())
            return True
        except grpc.RpcError:
            return False

