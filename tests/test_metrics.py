"""`--metrics-port` on the metadata service and on workers: Prometheus text with vLLM's names,
scraped during a job and checked against Stats; and scraped by a real Prometheus server (Debian's
`prometheus`, which .ci/run installs)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import LocalCluster
from client.cluster import free_port
from metadata_service.front_jobs import parse_job_id

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))
            out[key] = s.value
    return out


def one(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def prometheus_sees(tmp_path, target_port: int, query: str, want) -> None:
    """Start Debian's prometheus scraping 127.0.0.1:target_port every second and wait until `query`
    (PromQL) returns `want` (a number, or a callable run once Prometheus is up that makes some
    traffic and returns it)."""
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: minipaged\n"
                   f"    static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n")
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        want = want() if callable(want) else want
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        end = time.monotonic() + 60
        while True:
            try:
                res = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
                if res and float(res[0]["value"][1]) == want:
                    return
            except OSError:
                pass
            assert time.monotonic() < end, f"Prometheus never saw {query} = {want}"
            time.sleep(0.5)
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.fixture(scope="module")
def cluster():
    mport = free_port()
    with LocalCluster(model="tiny", workers=2, dtype="float32", extra_service_args=["--metrics-port", mport],
                      extra_worker_args=["--metrics-port", 0]) as c:
        c.metrics_port = mport
        yield c


def test_service_metrics_agree_with_stats(cluster):
    c = cluster.client
    job = c.submit([{"prompt": "x" * (10 + i), "max_new_tokens": 24, "ignore_eos": True} for i in range(12)])
    seen_running = False
    while not c.get_job(job).done:                       # during the job: the gauges move with Stats
        m = scrape(cluster.metrics_port)
        seen_running |= one(m, "vllm:num_requests_running") > 0
        time.sleep(0.05)
    c.wait(job)
    time.sleep(0.3)                                      # idle: a scrape and Stats must agree exactly
    st, m = c.stats(), scrape(cluster.metrics_port)
    assert seen_running
    assert one(m, "vllm:generation_tokens_total") == st.generated_tokens >= 12 * 24
    assert one(m, "vllm:prompt_tokens_total") == st.prompt_tokens
    assert one(m, "vllm:prefix_cache_queries_total") == st.prefix_cache_queries * st.block_size
    assert one(m, "vllm:prefix_cache_hits_total") == st.prefix_cache_hits * st.block_size
    assert one(m, "vllm:num_preemptions_total") == st.preemptions
    assert one(m, "minipaged:free_blocks") == st.free_blocks and one(m, "minipaged:num_chains") == st.num_chains
    assert one(m, "vllm:request_success_total", finished_reason="length") >= 12
    assert one(m, "vllm:time_to_first_token_seconds_count") >= 12
    assert one(m, "vllm:e2e_request_latency_seconds_count") >= 12
    assert not [name for name, _ in m if name.endswith("_created")]     # vLLM has none either
    chain = st.chains[0]
    busy = [v for (name, labels), v in m.items() if name == "minipaged:stage_busy_fraction"]
    assert len(busy) == 2 and all(0 < b <= 1 for b in busy) and len(chain["stages"]) == 2


def test_a_cancelled_request_is_vllms_abort(cluster):
    """vLLM's finished_reason for a request the client left is "abort" (the gateway's too); the
    service said "cancelled", which a vLLM dashboard does not read."""
    def aborts():
        return scrape(cluster.metrics_port).get(("vllm:request_success_total", (("finished_reason", "abort"),)), 0)
    before = aborts()
    it = cluster.client.stream(prompt_token_ids=[1, 2, 3], max_new_tokens=500, ignore_eos=True)
    next(it)
    it.close()                                   # the client leaves: the service cancels it
    end = time.monotonic() + 30
    while aborts() < before + 1:
        assert time.monotonic() < end, "the cancelled request was never counted as abort"
        time.sleep(0.1)
    assert ("vllm:request_success_total", (("finished_reason", "cancelled"),)) not in scrape(cluster.metrics_port)


def test_worker_metrics(cluster):
    found = []
    for p in cluster._procs[1:]:             # --metrics-port 0: each worker says which port it took
        with open(p.log_path) as f:
            url = next(line.split()[-1] for line in f if line.startswith("metrics on "))
        found.append(scrape(int(url.rsplit(":", 1)[1].split("/")[0])))
    steps = cluster.client.stats().steps
    for m in found:
        assert sum(v for (n, _), v in m.items() if n == "minipaged:worker_steps_total") >= steps
        assert sum(v for (n, _), v in m.items() if n == "minipaged:worker_cache_epoch") != 0


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed (.ci/run installs it)")
def test_a_real_prometheus_scrapes_the_service(cluster, tmp_path):
    def traffic():
        cluster.client.generate(prompt="hello", max_new_tokens=8)
        return cluster.client.stats().generated_tokens
    prometheus_sees(tmp_path, cluster.metrics_port, "vllm:generation_tokens_total", traffic)


def test_a_sharded_front_serves_every_shards_metrics_labelled_by_shard(tmp_path):
    """`--shards 2 --metrics-port P`: one target, each sample labelled shard="k"; summed over the
    shards the counters equal the front's merged Stats. A real Prometheus scrapes it when installed."""
    mport = free_port()
    with LocalCluster(model="tiny", replicas=2, dtype="float32",
                      extra_service_args=["--shards", 2, "--metrics-port", mport]) as c:
        end = time.monotonic() + 60
        while c.client.stats().num_chains < 2:           # both shards' chains up: the job splits over both
            assert time.monotonic() < end
            time.sleep(0.2)
        job = c.client.submit([{"prompt": "x" * (10 + i), "max_new_tokens": 8, "ignore_eos": True} for i in range(8)])
        assert all(parse_job_id(job, 2)), job
        c.client.wait(job)
        time.sleep(0.3)
        st, m = c.client.stats(), scrape(mport)
        assert one(m, "minipaged:shard_up", shard="0") == one(m, "minipaged:shard_up", shard="1") == 1
        gen = {labels: v for (name, labels), v in m.items() if name == "vllm:generation_tokens_total"}
        assert sorted(dict(k)["shard"] for k in gen) == ["0", "1"]
        assert sum(gen.values()) == st.generated_tokens == 8 * 8
        assert all(v > 0 for v in gen.values())          # the job was split over both shards
        if shutil.which("prometheus") is not None:
            prometheus_sees(tmp_path, mport, "sum without (shard) (vllm:generation_tokens_total)", st.generated_tokens)
