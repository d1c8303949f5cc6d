"""What travels between the SDK and the service, on the client's side, in one import: `Client`,
`AsyncClient`, the CLI and the gateway take it from here. Each part lives in a module of its own:

- channel.py        addresses ("HOST" means HOST:50051) and channel options
- results.py        GenerateResult, StreamChunk, Usage, JobStatus
- service_stats.py  Stats and the pool snapshot (dashboard)
- request.py        keyword arguments -> GenerateRequest / SubmitJobRequest
- decode.py         replies and job progress -> the result types
- collect.py        chunks -> one result, job progress -> ordered results, one deadline per call

Only grpc, the generated code and minipaged helpers (wire, constants) are imported by these."""
from __future__ import annotations

from minipaged.constants import MAX_MESSAGE_BYTES

from .channel import CHANNEL_OPTIONS, DEFAULT_PORT, normalize_address
from .collect import Deadline, JobCollector, ResultAssembler
from .decode import chunk_from_proto, job_from_proto, result_from_proto
from .request import (REQUEST_KEYS, batch_items, build_generate_request, build_submit_request, final_only,
                      refuse_unstreamable)
from .results import TERMINAL_STATES, GenerateResult, JobStatus, StreamChunk, Usage
from .service_stats import ChainSnapshot, PoolSnapshot, SequenceSnapshot, Stats, pool_snapshot_from_proto

__all__ = ["MAX_MESSAGE_BYTES", "CHANNEL_OPTIONS", "DEFAULT_PORT", "normalize_address", "Deadline", "JobCollector",
           "ResultAssembler", "chunk_from_proto", "job_from_proto", "result_from_proto", "REQUEST_KEYS",
           "batch_items", "build_generate_request", "build_submit_request", "final_only", "refuse_unstreamable",
           "TERMINAL_STATES", "GenerateResult", "JobStatus", "StreamChunk", "Usage", "ChainSnapshot",
           "PoolSnapshot", "SequenceSnapshot", "Stats", "pool_snapshot_from_proto"]
