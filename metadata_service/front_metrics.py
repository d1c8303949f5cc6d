"""`--metrics-port` of a sharded front (`--shards N`): each shard serves its own Prometheus text on
a loopback port the front reads from the shard's LISTENING line; a scrape of the front reads every
shard's and serves them as one target, each sample labelled `shard="k"`.

Labelled, not summed: most figures add up across shards (requests, tokens, blocks, histogram
buckets), but some do not (KV-cache usage, readiness, ms per step), and chain ids repeat between
shards. `sum without (shard) (...)` gives the whole service's figure where it is a sum, as for
several vLLM instances. A shard that does not answer is left out of that scrape, and
`minipaged:shard_up{shard="k"}` says so."""
from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from minipaged import metrics_http

SCRAPE_TIMEOUT_S = 2.0


def merge_families(texts: dict[int, str | None]) -> list[Metric]:
    """Shard k's exposition text (None: it did not answer) -> one family per name, every sample
    with a `shard` label, and minipaged:shard_up per shard."""
    up = GaugeMetricFamily("minipaged:shard_up", "1 when the shard answered this scrape", labels=["shard"])
    families: dict[str, Metric] = {}
    for k, text in sorted(texts.items()):
        up.add_metric([str(k)], 0.0 if text is None else 1.0)
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.samples.append(type(s)(s.name, {**s.labels, "shard": str(k)}, s.value, s.timestamp, s.exemplar))
    return list(families.values()) + [up]


class _ShardsCollector:
    def __init__(self, urls):
        self.urls = urls          # a callable: the shards' metrics URLs now (a restarted shard moves)

    def collect(self):
        return merge_families({k: _fetch(url) for k, url in enumerate(self.urls())})


def _fetch(url: str | None) -> str | None:
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            return r.read().decode()
    except OSError:
        return None


def serve_front_metrics(urls, port: int, host: str) -> int:
    """Serve the shards' metrics on host:port; returns the bound port. Raises OSError."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ShardsCollector(urls))
    return metrics_http.serve(registry, port, host)
