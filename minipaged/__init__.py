"""Shared by both planes: the generated gRPC code (minipaged.v1) and the few helpers both sides
need (packing arrays into bytes, the tokenizer, model-config loading). Nothing here imports
metadata_service, worker or client."""
