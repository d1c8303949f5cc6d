"""Values both planes (and the SDK and gateway) must agree on, defined once.

metadata_service/ and worker/ never import each other; both import these from here."""
from __future__ import annotations

# Element size of each dtype a worker may hold K/V or send hidden states in (bfloat16 has no numpy dtype).
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}

# gRPC's 4 MiB default is too small: a long prefill's hidden states and a big batch reply fit in 256 MiB.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# OpenAI's (and vLLM's default --max-logprobs) limit on alternatives per token a request may ask for.
OPENAI_MAX_TOP_LOGPROBS = 20

# n and best_of: at most OpenAI's limit for n (vLLM sets none)
MAX_CHOICES = 128

# The metadata service's client port: `python -m metadata_service`'s default, and the port the SDK,
# the CLI and the gateway add to an address given as HOST alone.
DEFAULT_METADATA_PORT = 50051
# ... and the address the worker, the client and the gateway assume when given none (each lets env
# MINIPAGED_ADDRESS override it).
DEFAULT_METADATA_ADDRESS = f"127.0.0.1:{DEFAULT_METADATA_PORT}"

# Initial-metadata key of a call parked until the service's first worker registers (the SDK prints
# its value; a sharded front passes it on).
WAITING_KEY = "minipaged-waiting"

# How long a decode stage waits on a prefill stage's data link for a K/V move's bytes (each socket
# operation); the metadata plane gives a move --step-timeout plus this before it fails the chain.
KV_MOVE_TIMEOUT_S = 60.0

# Alternatives per row a Step may ask a worker for: beam search needs (1 + #EOS) x K, K <= 16.
STEP_MAX_TOP_LOGPROBS = 64


def grpc_options(**extra) -> list[tuple[str, int]]:
    """Channel/server options with the message limits raised to MAX_MESSAGE_BYTES, plus any
    `grpc.<name>` options given as keywords (so_reuseport=0 -> ("grpc.so_reuseport", 0))."""
    return ([("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
             ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            + [(f"grpc.{name}", value) for name, value in extra.items()])


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype_bytes: int) -> int:
    """K and V of one block over num_layers layers: what the worker allocates and the metadata
    service divides a worker's K/V budget by (block_size=1 gives the bytes per token)."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes
