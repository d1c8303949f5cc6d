"""Optional TLS for every link: server certificates, and mutual TLS where a CA for clients is given.

No flags, no TLS: plain loopback/compose networking stays the default."""
from __future__ import annotations

import grpc


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def add_port(server: grpc.Server, address: str, cert: str | None = None, key: str | None = None,
             client_ca: str | None = None) -> int:
    """Bind with TLS when cert+key are given; `client_ca` also requires clients to present a
    certificate it signed (mutual TLS). Returns the bound port (0 on failure)."""
    try:
        if not cert:
            return server.add_insecure_port(address)
        creds = grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                            require_client_auth=bool(client_ca))
        return server.add_secure_port(address, creds)
    except RuntimeError:  # grpcio raises when the port is taken (so_reuseport off) or not ours
        return 0


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None, *,
                        ca_required: bool = False):
    """None (plain text) when no TLS file is given; else credentials that verify the server against
    `ca` (the system's roots without one) and present cert/key when given (mutual TLS). A client
    certificate without a CA is TLS, never a silent fall back to plain text. `ca_required`: a
    worker's --tls-cert is its own server's certificate, so only --tls-ca makes its calls TLS."""
    if not ca and (ca_required or not (cert or key)):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs its key: give both tls_cert and tls_key, or neither")
    return grpc.ssl_channel_credentials(_read(ca), _read(key), _read(cert))


def make_channel(address: str, options=(), ca: str | None = None, cert: str | None = None,
                 key: str | None = None, *, ca_required: bool = False) -> grpc.Channel:
    creds = channel_credentials(ca, cert, key, ca_required=ca_required)
    if creds is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, creds, options=list(options))
