"""The gateway's /metrics: Prometheus text via prometheus-client.

Two kinds of series:
- what the gateway itself observes per HTTP request, with vLLM's names so existing dashboards
  work: time to first token, inter-token latency, end-to-end latency, prompt and generation
  tokens, successes by finish reason (`vllm:...`), and HTTP requests by endpoint and status;
- gauges read from the Stats RPC at scrape time: running and waiting requests and KV usage
  (`vllm:...`), and ours (`minipaged:...`): pool blocks by state, fragmentation, metadata time per
  step, cache epoch, readiness, and per chain and per stage figures once the service reports them.

The service-wide counters (all clients' tokens, prefix-cache queries, preemptions) belong to the
metadata service's own --metrics-port; the gateway does not repeat them, so a sum over targets
does not count anything twice."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from client.messages import Stats
from minipaged.metrics_http import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS



class StatsCollector:
    """Gauges from the last Stats reply; `update()` is called by the /metrics handler just before
    the registry is rendered (a scrape asks the service once)."""

    def __init__(self, model_name):
        self._model_name = model_name  # callable: the name may be learnt after start
        self.stats: Stats | None = None
        self.error: str | None = None

    def update(self, stats: Stats | None, error: str | None = None) -> None:
        self.stats, self.error = stats, error

    def collect(self):
        model = self._model_name()
        up = GaugeMetricFamily("minipaged:metadata_up", "1 when the gateway's last Stats call succeeded")
        up.add_metric([], 0.0 if self.stats is None else 1.0)
        yield up
        s = self.stats
        if s is None:
            return

        def gauge(name, doc, value, labels=None):
            labels = {"model_name": model, **(labels or {})}
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), float(value))
            return g

        usage = s.used_blocks / s.num_blocks if s.num_blocks else 0.0
        yield gauge("vllm:num_requests_running", "Requests in the running batch (Stats.running)", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (Stats.waiting)", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / all blocks, 0..1", usage)
        for name, doc, value in (
                ("num_blocks", "Physical KV blocks in the pool", s.num_blocks),
                ("block_size", "Tokens per KV block", s.block_size),
                ("used_blocks", "Blocks referenced by a sequence", s.used_blocks),
                ("free_blocks", "Blocks on the free list (cached ones included)", s.free_blocks),
                ("cached_blocks", "Free blocks that still hold a reusable prefix (evictable)", s.cached_blocks),
                ("shared_blocks", "Blocks referenced by more than one sequence", s.shared_blocks),
                ("internal_fragmentation_tokens", "Allocated but unused slots in last blocks",
                 s.internal_fragmentation_tokens),
                ("kv_utilization", "Used slots / allocated slots", s.kv_utilization),
                ("live_sequences", "Sequences holding blocks (block API included)", s.live_sequences),
                ("metadata_ms_per_step", "Metadata-plane time per engine step (mean, ms)", s.metadata_ms_per_step),
                ("tokens_per_second", "Generated tokens per busy engine second", s.tokens_per_second),
                ("cache_epoch", "Cache epoch of the chain (changes when a worker restarts)", s.cache_epoch),
                ("ready", "1 when a worker chain is ready", s.ready),
                ("invariants_ok", "1 when the block manager's invariants hold", s.invariants_ok),
                ("num_workers", "Registered workers", s.num_workers),
                ("num_chains", "Ready worker chains", s.num_chains),
                ("standby_workers", "Registered workers in no chain", s.standby_workers)):
            yield gauge(f"minipaged:{name}", doc, value)
        yield from self._chains(s, model)

    @staticmethod
    def _chains(s: Stats, model: str):
        if not s.chains:
            return
        per_chain = {
            "chain_ready": ("1 when this chain is ready", "ready"),
            "chain_num_blocks": ("Blocks in this chain's pool", "num_blocks"),
            "chain_free_blocks": ("Free blocks of this chain", "free_blocks"),
            "chain_used_blocks": ("Used blocks of this chain", "used_blocks"),
            "chain_cached_blocks": ("Cached free blocks of this chain", "cached_blocks"),
            "chain_shared_blocks": ("Shared blocks of this chain", "shared_blocks"),
            "chain_running": ("Running requests on this chain", "running"),
            "chain_waiting": ("Waiting requests routed to this chain", "waiting"),
            "chain_steps_per_second": ("Engine steps per second on this chain", "steps_per_second"),
            "chain_tokens_per_second": ("Generated tokens per second on this chain", "tokens_per_second"),
            "chain_cache_epoch": ("Cache epoch of this chain", "cache_epoch"),
            "chain_micro_batches": ("Micro-batches kept in flight on this chain", "micro_batches"),
        }
        families = {k: GaugeMetricFamily(f"minipaged:{k}", doc, labels=["model_name", "chain", "group"])
                    for k, (doc, _) in per_chain.items()}
        usage = GaugeMetricFamily("minipaged:chain_kv_cache_usage_perc", "Used / all blocks of this chain, 0..1",
                                  labels=["model_name", "chain", "group"])
        step = GaugeMetricFamily("minipaged:stage_step_seconds", "Mean compute time per step of a stage",
                                 labels=["model_name", "chain", "stage", "layers"])
        busy = GaugeMetricFamily("minipaged:stage_busy_fraction", "Compute time / wall time of a stage",
                                 labels=["model_name", "chain", "stage", "layers"])
        for c in s.chains:  # dicts with the ChainStats field names
            chain, group = str(c.get("chain_id", 0)), str(c.get("group", ""))
            for k, (_, field) in per_chain.items():
                families[k].add_metric([model, chain, group], float(c.get(field, 0) or 0))
            n = float(c.get("num_blocks", 0) or 0)
            usage.add_metric([model, chain, group], float(c.get("used_blocks", 0) or 0) / n if n else 0.0)
            for i, st in enumerate(c.get("stages", [])):
                layers = f"{st.get('layer_start', 0)}:{st.get('layer_end', 0)}"
                step.add_metric([model, chain, str(i), layers], float(st.get("step_ms", 0) or 0) / 1000.0)
                busy.add_metric([model, chain, str(i), layers], float(st.get("busy_fraction", 0) or 0))
        yield from families.values()
        yield from (usage, step, busy)


class GatewayMetrics:
    """Every series of the gateway, in its own registry (no process-global state)."""

    def __init__(self, model_name):
        disable_created_metrics()  # no *_created series (as vLLM): they only double the payload
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (seen by the gateway)",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a choice",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
                             m, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests through the gateway",
                                     m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Generated tokens of requests through the gateway", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason",
                                       m + ["finished_reason"], registry=r)
        self.http_requests = Counter("minipaged:gateway_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.stats = StatsCollector(model_name)
        r.register(self.stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
