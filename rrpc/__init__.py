"""rrpc: remote procedure calls for PyTorch over gRPC.

The API mirrors ``torch.distributed.rpc``: code written for it runs on rrpc
by changing its imports. See README.md and DESIGN.md.
"""

from rrpc import functions
from rrpc.api import (
    BackendType,
    get_worker_info,
    init_rpc,
    rpc_async,
    rpc_sync,
    shutdown,
    stats,
)
from rrpc.messages import (
    AuthenticationError,
    MessageTooLargeError,
    PeerUnavailableError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
    SerializationError,
    WorkerInfo,
)
from rrpc.options import RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = [
    "AuthenticationError",
    "BackendType",
    "MessageTooLargeError",
    "PeerUnavailableError",
    "RemoteError",
    "RpcBackendOptions",
    "RpcError",
    "RpcTimeoutError",
    "SerializationError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "functions",
    "get_worker_info",
    "init_rpc",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "stats",
]
