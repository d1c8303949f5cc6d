"""`python -m gateway --metadata HOST:PORT --port 8000 [--host 127.0.0.1] [--token T]` (also
`minipaged-gateway`): the OpenAI-compatible HTTP API, /metrics, /health and the dashboard at /."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import uvicorn

from minipaged import cli
from minipaged.cli import port, prog_name
from minipaged.constants import DEFAULT_METADATA_PORT

from .reasoning import DEFAULT_PARSER, PARSERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog_name("gateway"), description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--metadata", default=os.environ.get("MINIPAGED_ADDRESS") or f"127.0.0.1:{DEFAULT_METADATA_PORT}",
                   help=f"the metadata service, HOST:PORT (HOST alone: port {DEFAULT_METADATA_PORT}; "
                        f"env MINIPAGED_ADDRESS)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port")
    p.add_argument("--token", default=None,
                   help="API key: HTTP clients must send 'Authorization: Bearer T' to /v1/*; also presented "
                        "to the metadata service unless --metadata-token is given (env MINIPAGED_TOKEN)")
    p.add_argument("--metadata-token", default=None,
                   help="token for the metadata service when it differs from --token (env MINIPAGED_METADATA_TOKEN)")
    p.add_argument("--model", default=os.environ.get("MINIPAGED_MODEL"),
                   help="the --model the workers load (tiny or a checkpoint directory readable here): names "
                        "the model in /v1/models and supplies its chat template and tokenizer (env MINIPAGED_MODEL)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API instead of --model, as vLLM: responses carry the first, "
                        "requests may name any, /v1/models lists each")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of chat requests that give none (capped by the model's context; default: the "
                        "checkpoint's generation_config.json max_new_tokens with --generation-config auto, else 256)")
    p.add_argument("--generation-config", default="auto",
                   help="what unset sampling fields of a request take: auto (the --model checkpoint's "
                        "generation_config.json, as vLLM: Qwen3's temperature 0.6, top_p 0.95, top_k 20), vllm "
                        "(OpenAI's: temperature 1, nothing filtered) or a directory holding generation_config.json")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults merged over --generation-config's, e.g. '{\"temperature\": 0.7}'")
    p.add_argument("--reasoning-parser", default=DEFAULT_PARSER, choices=PARSERS,
                   help="qwen3: a Qwen3 template's <think>...</think> goes to message.reasoning (and "
                        "reasoning_content), the rest to content; none: all text in content")
    p.add_argument("--tls-ca", default="", help="CA of the metadata service's certificate: talk TLS to it")
    p.add_argument("--tls-cert", default="", help="client certificate for the metadata service (mTLS)")
    p.add_argument("--tls-key", default="", help="key of --tls-cert")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds requests in flight may take to finish after SIGTERM / SIGINT; those still "
                        "running then end with an error (a stream: an error event and [DONE]; else a 503)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    # secrets from the environment are read here, not as defaults, so --help never prints one
    args.token = cli.token(parser, args.token, "MINIPAGED_TOKEN", "--token")
    args.metadata_token = cli.token(parser, args.metadata_token, "MINIPAGED_METADATA_TOKEN", "--metadata-token")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from client.messages import normalize_address

    from minipaged import generation_defaults as gd
    from minipaged.tls import channel_credentials
    from .app import GatewayConfig, create_app
    from .model_identity import check_model_arg
    try:  # a wrong path or a broken config.json is a start error, not a silently wrong /v1/models
        metadata = normalize_address(args.metadata)
        check_model_arg(args.model)
        override = gd.parse_override(args.override_generation_config)
        gd.load(args.generation_config, args.model, override)   # a bad file or value: one line, exit 2
        channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)  # a missing file, a cert without its key
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    config = GatewayConfig(metadata=metadata, token=args.token,
                           metadata_token=args.metadata_token, model=args.model,
                           served_model_name=args.served_model_name, tls_ca=args.tls_ca or None,
                           tls_cert=args.tls_cert or None, tls_key=args.tls_key or None,
                           default_max_tokens=args.default_max_tokens,
                           reasoning_parser=args.reasoning_parser, generation_config=args.generation_config,
                           override_generation_config=override)
    app = create_app(config)
    # uvicorn handles SIGTERM/SIGINT: it stops accepting and finishes in-flight requests, for --grace
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.grace + END_MARGIN_S, lifespan="on"))
    server.run()
    return 0 if server.started else 1


END_MARGIN_S = 1.0   # after --grace, the requests still open end themselves, then uvicorn's cancel


class _Server(uvicorn.Server):
    """uvicorn's graceful stop, without re-raising the signal once drained: a drained stop is a clean
    exit (0), not the signal's 143. When the grace is spent, requests still open end with an OpenAI
    error before uvicorn cancels their tasks (which cut a stream mid-body: no [DONE], a traceback)."""

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if first:
            gw, grace = self.config.app.state.gateway, self.config.timeout_graceful_shutdown - END_MARGIN_S
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(loop.call_later, grace, gw.end_open_streams,
                                      f"the gateway is shutting down: this request was still running after "
                                      f"its --grace of {grace:g}s")


if __name__ == "__main__":
    sys.exit(main())
