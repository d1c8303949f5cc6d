"""vLLM's histogram buckets, and a `/metrics` endpoint for both planes: Prometheus text format 0.0.4, whatever the scraper asks for.

prometheus-client negotiates OpenMetrics when a scraper (Prometheus itself) asks for it, and its
OpenMetrics writer escapes the colons of vLLM's names (`vllm:num_requests_running` would be stored as
`vllm_num_requests_running`, and vLLM's dashboards would find nothing). The classic text format keeps
them, so this endpoint always serves that."""
from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer


# vLLM's buckets, so the histograms line up with its dashboards
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape is noise
        pass


def serve(registry, port: int, host: str) -> int:
    """Serve `registry` on host:port in a daemon thread; returns the bound port (0 picks one)."""
    def app(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"try /metrics\n"]
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        return [generate_latest(registry)]
    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server.server_port
