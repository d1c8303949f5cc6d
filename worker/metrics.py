"""`--metrics-port` on a worker: its own Prometheus text (steps served, compute time per step, the
cache it holds), read from the servicer at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from minipaged import metrics_http
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _WorkerCollector:
    def __init__(self, servicer):
        self.s = servicer

    def collect(self):
        s = self.s
        labels = {"model_name": s.model_name, "layers": f"{s.runner.layer_start}:{s.runner.layer_end}",
                  "address": s.address}

        def fam(kind, name, doc, value):
            f = kind(name, doc, labels=list(labels))
            f.add_metric(list(labels.values()), float(value))
            return f
        yield fam(CounterMetricFamily, "minipaged:worker_steps", "Steps this stage ran", s.steps_served)
        yield fam(CounterMetricFamily, "minipaged:worker_compute_seconds", "Compute seconds of this stage's steps",
                  s.compute_s)
        yield fam(GaugeMetricFamily, "minipaged:worker_num_blocks", "K/V blocks allocated", s.num_blocks)
        yield fam(GaugeMetricFamily, "minipaged:worker_block_size", "Tokens per block", s.block_size)
        yield fam(GaugeMetricFamily, "minipaged:worker_cache_epoch", "Cache epoch (0: no cache)", s.epoch)
        yield fam(GaugeMetricFamily, "minipaged:worker_remembered_sequences",
                  "Sequences whose tables and last token this stage remembers", len(s.store))


def serve(servicer, port: int, host: str) -> int:
    """Start the endpoint; returns the bound port (port 0 picks one)."""
    registry = CollectorRegistry()
    registry.register(_WorkerCollector(servicer))
    return metrics_http.serve(registry, port, host)
