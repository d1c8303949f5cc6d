"""A `/metrics` endpoint for both planes: Prometheus text format 0.0.4, whatever the scraper asks for.

prometheus-client negotiates OpenMetrics when a scraper (Prometheus itself) asks for it, and its
OpenMetrics writer escapes the colons of vLLM's names (`vllm:num_requests_running` would be stored as
`vllm_num_requests_running`, and vLLM's dashboards would find nothing). The classic text format keeps
them, so this endpoint always serves that."""
from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer


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
