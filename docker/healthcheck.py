"""Container healthcheck: exit 0 when the target is ready, 1 when it is not (or does not answer).

    python docker/healthcheck.py 127.0.0.1:50051 minipaged.v1.MetadataService   # grpc.health.v1 Check
    python docker/healthcheck.py http://127.0.0.1:8000/health                   # HTTP 200

gRPC: the named service is readiness (metadata service: a worker chain covers all layers; worker:
weights loaded and registered); "" is liveness. Health and reflection need no token."""
from __future__ import annotations

import sys

TIMEOUT_S = 3.0


def check_grpc(address: str, service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            print(f"{address} {service!r}: {e.code().name}", file=sys.stderr)
            return False
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not ok:
        print(f"{address} {service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return ok


def check_http(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError) as e:
        print(f"{url}: {e}", file=sys.stderr)
        return False


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = argv[0]
    if target.startswith(("http://", "https://")):
        return 0 if check_http(target) else 1
    return 0 if check_grpc(target, argv[1] if len(argv) > 1 else "") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
