"""rrpc: remote procedure calls for PyTorch over gRPC.

The API mirrors ``torch.distributed.rpc``: code written for it runs on rrpc
by changing its imports. See README.md and ARCHITECTURE.md.
"""

from rrpc import autograd, functions, nn, optim
from rrpc.api import (
    BackendType,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    rpc_async,
    rpc_sync,
    shutdown,
    stats,
)
from rrpc.faults import FaultyRpcBackendOptions
from rrpc.membership import MembershipEvent, get_worker_infos, on_membership_change
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
from rrpc.rref import RRef, remote, rref_debug_info
from rrpc.torch_profiler import (  # torch's private name, for code that uses it
    _server_process_global_profile as _server_process_global_profile,
)

__all__ = [
    "AuthenticationError",
    "BackendType",
    "FaultyRpcBackendOptions",
    "MembershipEvent",
    "MessageTooLargeError",
    "PeerUnavailableError",
    "RRef",
    "RemoteError",
    "RpcBackendOptions",
    "RpcError",
    "RpcTimeoutError",
    "SerializationError",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "autograd",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_available",
    "nn",
    "on_membership_change",
    "optim",
    "remote",
    "rpc_async",
    "rpc_sync",
    "rref_debug_info",
    "shutdown",
    "stats",
]
