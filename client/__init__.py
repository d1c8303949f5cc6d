"""MiniPaged-Qwen client SDK: `Client`, `AsyncClient`, `LocalCluster` and typed errors.

    from client import Client, LocalCluster
    with LocalCluster(model="tiny", workers=2) as cluster:
        print(cluster.client.generate(prompt="Hello", max_new_tokens=16).text)
"""
from .aio import AsyncClient
from .cluster import ClusterError, LocalCluster, split_layers
from .errors import (AlreadyExists, Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument,
                     MiniPagedError, NotFound, PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable,
                     Unimplemented, from_rpc_error)
from .messages import (ChainSnapshot, GenerateResult, JobStatus, PoolSnapshot, SequenceSnapshot, Stats, StreamChunk,
                       Usage)
from .sdk import Client

__all__ = ["Client", "AsyncClient", "LocalCluster", "ClusterError", "split_layers", "GenerateResult",
           "StreamChunk", "Usage", "Stats", "JobStatus", "PoolSnapshot", "ChainSnapshot", "SequenceSnapshot",
           "MiniPagedError", "InvalidArgument", "ResourceExhausted", "NotFound", "Unavailable",
           "FailedPrecondition", "Unauthenticated", "PermissionDenied", "AlreadyExists", "DeadlineExceeded",
           "Cancelled", "Unimplemented", "from_rpc_error"]
