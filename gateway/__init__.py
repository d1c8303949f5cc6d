"""The HTTP gateway: an OpenAI-compatible API, Prometheus metrics and a live block-pool dashboard
in front of the metadata service. A stateless gRPC client of the service (through the SDK), like
any other: it imports neither metadata_service nor worker, and can be restarted or scaled out on
its own (docs/architecture.md sections 1 and 8)."""
