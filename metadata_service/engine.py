"""The Engine: the front door for sequences, the router, and the upkeep of replica chains.

Requests come in on RPC threads (`add`, `abort`); `add` routes each new sequence to a ready chain
(metadata_service/router.py) and hands it to that chain's thread (metadata_service/chain.py), which
runs it to the end. With no chain ready, sequences are parked until one forms.

The upkeep thread keeps the chains: workers whose lease ran out are dropped and their chains
stopped; free workers (new, standby, or the survivors of a lost chain) are formed into chains
(metadata_service/workers.py), each initialised with a fresh cache epoch (last stage first) and
started. A chain that is lost hands its sequences back here: they are routed again and recompute
from their tokens on the other chains, exactly (sampling is a pure function of seed and position).

Sinks (Generate streams, jobs) hear about tokens and endings from whichever thread applies them.

The Engine is this file's state and figures plus three mixins, one job each:
`sequence_routing.py` (admission, routing, parking, finish), `chain_upkeep.py` (the upkeep thread:
chains formed, started, lost, quarantined) and `served_model.py` (tokenizer and model limits)."""
from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import Counter, deque

from minipaged.tokenizer import ByteTokenizer

from .backlog import CANCEL_COMMAND, refusal_hint
from .block_manager import KVBlockManager
from .chain import ChainConfig, ChainRunner
from .chain_stats import COUNTERS
from .chain_upkeep import ChainUpkeep
from .router import OVERLAP_WEIGHT, Router
from .sequence import Sequence
from .sequence_routing import SequenceRouting
from .served_model import ServedModel
from .workers import WorkerRegistry


class Engine(SequenceRouting, ChainUpkeep, ServedModel):
    def __init__(self, *, block_size=16, num_blocks=0, max_num_batched_tokens=2048, max_num_seqs=256,
                 max_model_len=0, enable_prefix_caching=True, worker_token=None, step_timeout_s=120.0,
                 worker_wait_s=60.0, registry: WorkerRegistry | None = None, micro_batches=0,
                 async_scheduling=True, router="exact", router_overlap_weight=OVERLAP_WEIGHT,
                 full_block_tables=False, init_timeout_s=30.0, default_num_blocks=1024, kv_tier_policy="write-back",
                 kv_move_part_bytes=0):
        self.block_size = block_size
        self.num_blocks_cap = num_blocks            # --num-blocks: an upper bound on each chain's pool
        self.max_model_len_flag = max_model_len
        self.max_model_len = max_model_len or 0
        self.worker_token = worker_token
        self.step_timeout_s, self.worker_wait_s, self.init_timeout_s = step_timeout_s, worker_wait_s, init_timeout_s
        self.cfg = ChainConfig(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs, micro_batches=micro_batches,
                               async_scheduling=async_scheduling, enable_prefix_caching=enable_prefix_caching,
                               full_block_tables=full_block_tables, worker_token=worker_token or "",
                               step_timeout_s=step_timeout_s, kv_tier_policy=kv_tier_policy,
                               kv_move_part_bytes=kv_move_part_bytes)
        self.registry = registry if registry is not None else WorkerRegistry()  # (an empty one is falsy)
        self.registry.pinned = self._pinned_model
        self.router = Router(router, block_size, router_overlap_weight)
        self.chains: dict[int, ChainRunner] = {}
        self._chain_ids = itertools.count(1)
        self.route_lock = threading.RLock()        # chains, router and parked change under it
        self.parked: deque[Sequence] = deque()     # admitted, waiting for a chain
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.model_known = threading.Event()       # a chain registered once: tokenizer and limits known
        self.ready_event = threading.Event()       # some chain is ready now
        self.unready_since = time.monotonic()
        self.not_ready_reason = "no worker is registered"
        self.tokenizer = ByteTokenizer()
        self.model_name = ""
        self.model_fingerprint = ""                # of the last chain; kept while it is down
        self.model_shape = ""                      # shape_signature of the served model (Stats, the gateway)
        self.text_prompt_problem = None            # why text prompts cannot be tokenized (tiny vocab, no files)
        self.simulated = False                     # the served workers are simulated (--simulate)
        self.model_label = ""                      # its name, for messages (also known after a restart)
        self.on_model_changed = []                 # callbacks(fingerprint, name): the job store records it
        self.on_model_known = []                   # callbacks(): the first chain named the model (jobs.py)
        self.on_ready_changed = []                 # callbacks(bool): health readiness follows
        self.on_sequence_finished = []             # callbacks(seq): metrics
        self.finish_batch = contextlib.nullcontext  # () -> context: finishes inside it share one store write
        self.on_chain_started = []                 # callbacks(chain): the block API sizes its pool
        self.backlog = lambda: []                  # () -> [Backlog]: unfinished job work (JobManager's)
        self.cancel_command = CANCEL_COMMAND       # how a user drops it (main() adds --address)
        self._backlog_note = (0.0, "")             # (when, text): recomputed at most once a second
        self._init_failures: dict = {}             # chain's worker ids -> (retry after, delay, why): backs off
        # address -> (retry after, delay, why) of a worker dropped because this service cannot reach it:
        # it re-registers at once (with a new id), so its backoff and reason are kept by address
        self._unreachable: dict = {}
        self.registry.refusal_hint = lambda: refusal_hint(next(iter(self.backlog()), None), self.cancel_command)
        self.eos_ids: set[int] = set()
        self.retired: Counter = Counter()          # lost chains' counts (COUNTERS), kept in Stats' totals
        self.vocab_size = 0
        self._grammars = None                      # (model key, Grammars): structured outputs
        self._grammars_lock = threading.Lock()
        self.prompt_tokens = 0
        self.max_pool_blocks = 0                   # the largest chain pool seen (admission bound)
        self._quarantine_polled = 0.0
        # the pool the block API serves (and Stats reports) before any chain exists
        self.default_manager = KVBlockManager(num_blocks or default_num_blocks, block_size,
                                              enable_prefix_caching=enable_prefix_caching)

    # ------------------------------------------------------------------ public (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=5)
        for c in list(self.chains.values()):
            c.stop("shutting down")

    @property
    def ready(self) -> bool:
        return self.ready_event.is_set()

    def notify_workers_changed(self) -> None:
        self._wakeup.set()

    def wait_ready(self, timeout: float | None) -> bool:
        return self.ready_event.wait(timeout)

    # ------------------------------------------------------------------ figures
    def pools(self) -> list:
        with self.route_lock:
            return [c for c in self.chains.values() if c.alive]

    def stats(self) -> dict:
        chains = [c.stats() for c in self.pools()]
        keys = ("num_blocks", "used_blocks", "free_blocks", "cached_blocks", "shared_blocks",
                "internal_fragmentation_tokens", "prefix_cache_queries", "prefix_cache_hits", "live_sequences",
                "running", "waiting", "preemptions", "steps", "generated_tokens", "tier_blocks", "tier_used_blocks",
                "tier_queries", "tier_hits", "tier_saved_blocks", "tier_loaded_blocks", "kv_moves",
                "kv_moved_blocks", "kv_move_failures")
        api = self.default_manager.stats()         # the block API's pool (the seed's API)
        st = {k: sum(c.get(k, 0) for c in chains) for k in keys}
        st.update(block_api_blocks=api["num_blocks"], block_api_used_blocks=api["used_blocks"])
        if not chains:                             # the pool Stats shows until a chain forms
            st.update({k: v for k, v in api.items() if k in keys and k not in COUNTERS})
        else:
            st["live_sequences"] += api["live_sequences"]
        live_tokens = st["generated_tokens"]
        for k in COUNTERS:                         # counters count the service's life: lost chains, the block API
            st[k] += self.retired[k] + api.get(k, 0)
        used = sum(c["kv_used_tokens"] for c in chains)
        alloc = sum(c["kv_allocated_tokens"] for c in chains)
        meta_s = sum(c["metadata_s"] for c in chains)
        busy = max((time.monotonic() - min(c_.started for c_ in self.pools())) if chains else 0.0, 1e-9)
        st.update(block_size=self.block_size, kv_utilization=used / alloc if alloc else 0.0,
                  invariants_ok=all(c["invariants_ok"] for c in chains), waiting=st["waiting"] + len(self.parked),
                  tokens_per_second=live_tokens / busy if chains else 0.0,
                  metadata_ms_per_step=1e3 * meta_s / st["steps"] if st["steps"] else 0.0,
                  num_workers=len(self.registry), ready=self.ready, num_chains=len(chains),
                  cache_epoch=chains[0]["cache_epoch"] if chains else 0, chains=chains,
                  standby_workers=len(self.registry) - sum(len(c["stages"]) for c in chains),
                  not_ready_reason="" if chains else self.not_ready_reason, prompt_tokens=self.prompt_tokens,
                  tier_block_bytes=max((c["tier_block_bytes"] for c in chains), default=0))
        return st
