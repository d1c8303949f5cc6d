"""MiniPaged-Qwen client SDK: `Client`, `AsyncClient`, `LocalCluster` and typed errors.

    from client import Client, LocalCluster
    with LocalCluster(model="tiny", workers=2) as cluster:
        print(cluster.client.generate(prompt="Hello", max_new_tokens=16).text)
"""
from .aio import AsyncClient
from .cluster import ClusterError, LocalCluster, split_layers
from .errors import (Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, MiniPagedError,
                     NotFound, ResourceExhausted, Unauthenticated, Unavailable, from_rpc_error)
from .sdk import Client, GenerateResult, JobStatus, Stats, StreamChunk, Usage

__all__ = ["Client", "AsyncClient", "LocalCluster", "ClusterError", "split_layers", "GenerateResult",
           "StreamChunk", "Usage", "Stats", "JobStatus", "MiniPagedError", "InvalidArgument",
           "ResourceExhausted", "NotFound", "Unavailable", "FailedPrecondition", "Unauthenticated",
           "DeadlineExceeded", "Cancelled", "from_rpc_error"]
