"""`--metrics-port`: the metadata service's Prometheus text, via prometheus-client.

vLLM's names where the meaning is the same (so its dashboards work): requests running / waiting,
KV-cache usage, prefix-cache queries and hits (in tokens, as vLLM counts them), prompt and generation
tokens, preemptions, and per-request time to first token, inter-token latency, end-to-end latency and
successes by finish reason. Ours under `minipaged:`: the pool by state, fragmentation, metadata time
per step, cache epochs, and per chain and per stage figures (busy fraction, step time).

Everything but the latency histograms is read from `Engine.stats()` at scrape time, so a scrape and
the Stats RPC can never disagree; the histograms are observed when each request ends."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from minipaged import metrics_http
from minipaged.metrics_http import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def _gauge(name, doc, value, label, **labels):
    labels = {**label, **labels}
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), float(value))
    return g


def _counter(name, doc, value, label):
    c = CounterMetricFamily(name, doc, labels=list(label))
    c.add_metric(list(label.values()), float(value))
    return c


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        st = e.stats()
        model = e.model_name or "unknown"
        yield from _service_families(st, {"model_name": model})
        yield from _chain_families(st, model)


def _service_families(st: dict, label: dict):
    """The whole service's figures: vLLM's names first, then ours."""
    bs = st["block_size"]
    yield _gauge("vllm:num_requests_running", "Requests in a running batch", st["running"], label)
    yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", st["waiting"], label)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage (used blocks / all blocks), 0..1",
                 st["used_blocks"] / st["num_blocks"] if st["num_blocks"] else 0.0, label)
    yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                   st["prefix_cache_queries"] * bs, label)
    yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                   st["prefix_cache_hits"] * bs, label)
    # the second KV tier: vLLM names hits from outside the device cache "external" (KV connectors)
    yield _counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the KV tier",
                   st["tier_queries"] * bs, label)
    yield _counter("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the KV tier",
                   st["tier_hits"] * bs, label)
    yield _counter("minipaged:kv_tier_saved_bytes", "Bytes saved into the KV tier",
                   st["tier_saved_blocks"] * st["tier_block_bytes"], label)
    yield _counter("minipaged:kv_tier_loaded_bytes", "Bytes loaded from the KV tier",
                   st["tier_loaded_blocks"] * st["tier_block_bytes"], label)
    # disaggregated prefill/decode (worker --role): requests moved prefill -> decode chain
    yield _counter("minipaged:kv_moves", "Requests whose K/V moved from a prefill to a decode chain",
                   st["kv_moves"], label)
    yield _counter("minipaged:kv_moved_bytes", "Bytes moved from prefill to decode chains",
                   st["kv_moved_blocks"] * st["tier_block_bytes"], label)
    yield _counter("minipaged:kv_move_failures", "Moves that failed (the prompt was recomputed)",
                   st["kv_move_failures"], label)
    yield _counter("vllm:prompt_tokens", "Prompt tokens admitted", st["prompt_tokens"], label)
    yield _counter("vllm:generation_tokens", "Tokens generated", st["generated_tokens"], label)
    yield _counter("vllm:num_preemptions", "Sequences preempted (recomputed)", st["preemptions"], label)
    yield _counter("minipaged:steps", "Engine steps applied, every chain", st["steps"], label)
    for key, doc in (("num_blocks", "Physical KV blocks, every chain"), ("free_blocks", "Unreferenced blocks"),
                     ("used_blocks", "Referenced blocks"), ("cached_blocks", "Free blocks holding a reusable prefix"),
                     ("shared_blocks", "Blocks referenced by more than one sequence"),
                     ("internal_fragmentation_tokens", "Reserved but unused slots"),
                     ("metadata_ms_per_step", "Metadata-plane ms per step (schedule + pack + apply)"),
                     ("num_chains", "Ready chains"), ("tier_blocks", "KV tier slots, every chain"),
                     ("tier_used_blocks", "KV tier slots holding a block"), ("standby_workers", "Registered workers in no chain"),
                     ("num_workers", "Registered workers")):
        yield _gauge(f"minipaged:{key}", doc, st[key], label)
    yield _gauge("minipaged:ready", "1 while a chain is ready", st["ready"], label)
    yield _gauge("minipaged:invariants_ok", "1 while every pool's invariants hold", st["invariants_ok"], label)
    yield _gauge("minipaged:metadata_cpu_seconds", "CPU seconds of this process", time.process_time(), label)


def _chain_families(st: dict, model: str):
    """Per chain and per stage figures, labelled by chain (and stage and its layers)."""
    per_chain = {k: GaugeMetricFamily(f"minipaged:chain_{k}", doc, labels=["model_name", "chain", "group"])
                 for k, doc in (("free_blocks", "Free blocks of the chain's pool"),
                                ("running", "Running sequences on the chain"),
                                ("waiting", "Waiting sequences on the chain"),
                                ("steps_per_second", "Steps per second since the chain formed"),
                                ("tokens_per_second", "Generated tokens per second since the chain formed"),
                                ("cache_epoch", "The chain's cache epoch"),
                                ("prefix_cache_hits", "Prompt blocks found in the chain's prefix cache"))}
    busy = GaugeMetricFamily("minipaged:stage_busy_fraction", "Compute time / wall time of a stage",
                             labels=["model_name", "chain", "stage", "layers"])
    step = GaugeMetricFamily("minipaged:stage_step_seconds", "Mean compute seconds per step of a stage",
                             labels=["model_name", "chain", "stage", "layers"])
    for c in st["chains"]:
        ids = [model, str(c["chain_id"]), c["group"]]
        for k, fam in per_chain.items():
            fam.add_metric(ids, float(c[k]))
        for i, s in enumerate(c["stages"]):
            sid = [model, str(c["chain_id"]), str(i), f"{s['layer_start']}:{s['layer_end']}"]
            busy.add_metric(sid, s["busy_fraction"])
            step.add_metric(sid, s["step_ms"] / 1e3)
    yield from per_chain.values()
    yield busy
    yield step


# vLLM's finished_reason for ours: a sequence cancelled (the client left, a deadline, CancelJob) is
# "abort" there, as the gateway counts it too
VLLM_REASONS = {"cancelled": "abort"}


class ServiceMetrics:
    def __init__(self, engine):
        disable_created_metrics()     # no *_created series (as vLLM, and the gateway): they double the payload
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.engine = engine
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens", ["model_name"],
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Admission to the end of a request", ["model_name"],
                             buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Requests that ended, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        engine.on_sequence_finished.append(self.observe)

    def observe(self, seq) -> None:
        model = self.engine.model_name or "unknown"
        now = time.monotonic()
        if seq.admitted_at:
            self.e2e.labels(model).observe(now - seq.admitted_at)
            if seq.first_token_at:
                self.ttft.labels(model).observe(seq.first_token_at - seq.admitted_at)
                n = len(seq.output_token_ids)
                if n > 1:
                    self.itl.labels(model).observe((now - seq.first_token_at) / (n - 1))
        reason = seq.finish_reason
        if reason != "dropped":            # (a beam hypothesis pruned by the search: not a request)
            self.success.labels(model, VLLM_REASONS.get(reason, reason)).inc()

    def serve(self, port: int, host: str) -> int:
        """Start the endpoint; returns the bound port (port 0 picks one)."""
        return metrics_http.serve(self.registry, port, host)
