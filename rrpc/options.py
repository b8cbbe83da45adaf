"""Backend options: one place for every knob, each with its environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RPC_TIMEOUT = 60.0  # seconds, as torch.distributed.rpc
UNSET_RPC_TIMEOUT = -1.0  # "use the default"; 0 means "no timeout"
MAX_BULK_SOCKETS = 16  # bulk sockets of one stream, at most (TensorPipe's mpt_uv has 16 lanes)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return (
        default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")
    )


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value is None or not value.strip() else float(value)


@dataclass
class RpcBackendOptions:
    """Options of ``init_rpc``; mirrors ``torch.distributed.rpc.TensorPipeRpcBackendOptions``.

    Args:
        num_worker_threads: threads running incoming calls (user functions).
        rpc_timeout: default timeout in seconds of every call (0: none).
        init_method: ``"env://"`` (MASTER_ADDR / MASTER_PORT) or ``"tcp://host:port"``.
        init_timeout: seconds to wait for all workers at ``init_rpc``; it raises
            within 0.5 s of it, a frozen rendezvous store included.
        auth_token: shared secret every worker must prove it knows, once per stream,
            without sending it (env ``RRPC_AUTH_TOKEN``; see ``rrpc/auth.py``).
        advertise_host: address this worker listens on and publishes to its peers
            (env ``RRPC_ADVERTISE_HOST``; default: the local address that routes to
            MASTER_ADDR, which is 127.0.0.1 on one machine).
        max_message_size: largest message in bytes accepted or sent (0: no limit).
        chunk_size: largest gRPC message; bigger frames flow in chunks of this size.
        shared_memory: same-host tensors through shared memory (env ``RRPC_SHM``).
        shm_threshold: smallest tensor in bytes that takes the shared-memory path
            (256 KiB: below it a lane's socket is as fast, above it slower).
        batch_delay: seconds a callee's sender lingers to gather more replies
            into one gRPC message, when at least ``batch_min_open`` calls are open
            on the stream (env ``RRPC_BATCH_DELAY``; 0 turns lingering off). A
            caller's requests gather while the send before them is in flight.
        batch_min_open: the open calls on one stream from which it lingers.
        rref_delete_delay: seconds a worker gathers the deletes of dropped user
            RRefs, and the accepts of user RRefs passed to it as their owner,
            before it sends them, as one message per peer (env
            ``RRPC_DELETE_DELAY``; 0: each goes at once).
        peer_timeout: seconds within which a peer that stopped answering (frozen,
            partitioned, its socket still open) fails every call pending on it
            (env ``RRPC_PEER_TIMEOUT``): a keepalive ping every half of it, and a
            ping unanswered for the other half ends the stream.
        run_inline: let the thread that read a lone request run it instead of
            handing it to a pool thread (env ``RRPC_INLINE``).
        same_host_lane: carry calls between two workers of one host (same boot,
            pid and network namespace, and user) over a Unix socket on which the
            calling thread does its own I/O, instead of gRPC (env ``RRPC_LANE``;
            see ``rrpc/lane.py``). gRPC stays the control plane and the fallback.
        lane_spin: seconds a lane's reader keeps looking for bytes before it
            sleeps, while its recent waits were that short (env ``RRPC_LANE_SPIN``;
            0: always sleep at once). A reply or request caught this way costs no
            wake-up (see ``rrpc/spin.py``); past its first 50 µs a look yields
            the CPU to any thread that wants it, so the spin takes idle CPU only.
        grpc_spin: seconds a gRPC stream's callee keeps looking for the caller's
            next request before it sleeps, while its recent waits were that
            short (env ``RRPC_GRPC_SPIN``; 0: always sleep at once). As
            ``lane_spin``, for calls that go over gRPC (between hosts); a
            gRPC caller waiting for its reply always sleeps (grpcio's calls
            have no wait with a time limit).
        bulk_channel: carry the large tensor buffers of a gRPC stream (1 MiB or
            more in one message) on a TCP socket beside it, sent from and received
            into the tensors' memory (env ``RRPC_BULK``; see ``rrpc/bulk.py``).
            Off with TLS: the socket is not encrypted.
        bulk_sockets: how many TCP sockets a stream's caller opens for its bulk
            bytes, each carrying an equal share of every large message (env
            ``RRPC_BULK_SOCKETS``, 1 to 16; TensorPipe's ``mpt_uv`` has 16 lanes).
            One TCP stream is slower than the link: between two network
            namespaces here, two halved a 16 MiB echo.
        _transports / _channels: TensorPipe's names, for code written for it.
            ``_transports`` without ``"shm"`` turns the same-host lane off;
            ``_channels`` without ``"cma"`` turns the shared-memory path for large
            tensors off (TensorPipe's same-host channel), without ``"mpt_uv"``
            the bulk socket (TensorPipe's channel of several TCP connections).
            ``None``: rrpc's own switches decide.
        restricted: run only functions and classes exposed with
            ``rrpc.functions.expose`` and unpickle only safe types, for networks
            whose authenticated peers are not trusted to run code (env
            ``RRPC_RESTRICTED``; see ``rrpc/functions.py``).
        metrics_port: serve Prometheus metrics (``rrpc.stats()``) over HTTP on this
            port of the worker's host (env ``RRPC_METRICS_PORT``; 0: off, the
            default; needs ``prometheus-client``, the ``metrics`` extra).
        tls_cert_file / tls_key_file / tls_ca_file: PEM files; when all are set,
            every stream is TLS with client certificates checked against the CA.
        devices / device_maps: accepted for compatibility; rrpc moves tensors
            through CPU memory.
    """

    num_worker_threads: int = 16
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    init_method: str = "env://"
    init_timeout: float = 120.0
    auth_token: str | None = field(default_factory=lambda: os.environ.get("RRPC_AUTH_TOKEN"))
    advertise_host: str | None = field(
        default_factory=lambda: os.environ.get("RRPC_ADVERTISE_HOST")
    )
    max_message_size: int = 1 << 36
    chunk_size: int = 2 << 20
    shared_memory: bool = field(default_factory=lambda: _env_flag("RRPC_SHM", True))
    shm_threshold: int = 256 << 10
    batch_delay: float = field(default_factory=lambda: _env_float("RRPC_BATCH_DELAY", 300e-6))
    batch_min_open: int = 16
    run_inline: bool = field(default_factory=lambda: _env_flag("RRPC_INLINE", True))
    same_host_lane: bool = field(default_factory=lambda: _env_flag("RRPC_LANE", True))
    lane_spin: float = field(default_factory=lambda: _env_float("RRPC_LANE_SPIN", 1e-3))
    grpc_spin: float = field(default_factory=lambda: _env_float("RRPC_GRPC_SPIN", 1e-3))
    bulk_channel: bool = field(default_factory=lambda: _env_flag("RRPC_BULK", True))
    bulk_sockets: int = field(default_factory=lambda: int(os.environ.get("RRPC_BULK_SOCKETS") or 2))
    peer_timeout: float = field(default_factory=lambda: _env_float("RRPC_PEER_TIMEOUT", 8.0))
    rref_delete_delay: float = field(default_factory=lambda: _env_float("RRPC_DELETE_DELAY", 5e-3))
    restricted: bool = field(default_factory=lambda: _env_flag("RRPC_RESTRICTED", False))
    tls_cert_file: str | None = field(default_factory=lambda: os.environ.get("RRPC_TLS_CERT"))
    tls_key_file: str | None = field(default_factory=lambda: os.environ.get("RRPC_TLS_KEY"))
    tls_ca_file: str | None = field(default_factory=lambda: os.environ.get("RRPC_TLS_CA"))
    metrics_port: int = field(default_factory=lambda: int(os.environ.get("RRPC_METRICS_PORT") or 0))
    devices: list[Any] | None = None
    device_maps: dict[str, dict[Any, Any]] | None = None
    _transports: list[str] | None = None
    _channels: list[str] | None = None

    def __post_init__(self) -> None:
        # TensorPipe's transports and channels map onto rrpc's lanes: "uv" is
        # TCP (gRPC here, always on), "shm" its same-host transport (the lane),
        # "cma" its same-host channel for large tensors (shared memory here).
        if self._transports is not None:
            self._transports = list(self._transports)
            unknown = set(self._transports) - {"uv", "shm", "ibv"}
            if unknown:
                raise ValueError(
                    f"unknown transports {sorted(unknown)} (TensorPipe's: uv, shm, ibv)"
                )
            self.same_host_lane = self.same_host_lane and "shm" in self._transports
        if self._channels is not None:
            self._channels = list(self._channels)
            self.shared_memory = self.shared_memory and "cma" in self._channels
            self.bulk_channel = self.bulk_channel and "mpt_uv" in self._channels
        for name in (
            "rpc_timeout",
            "init_timeout",
            "batch_delay",
            "rref_delete_delay",
            "peer_timeout",
            "lane_spin",
            "grpc_spin",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(  # torch's wording
                    f"incompatible constructor arguments: {name} must be a number of seconds, "
                    f"not {type(value).__name__}"
                )
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 (0: none), got {self.rpc_timeout}")
        if not 0 <= self.batch_delay <= 0.1:
            raise ValueError(f"batch_delay must be in [0, 0.1] seconds, got {self.batch_delay}")
        for name in ("lane_spin", "grpc_spin"):
            if not 0 <= getattr(self, name) <= 0.01:
                raise ValueError(f"{name} must be in [0, 0.01] seconds, got {getattr(self, name)}")
        if not 0 <= self.rref_delete_delay <= 1.0:
            raise ValueError(
                f"rref_delete_delay must be in [0, 1] seconds, got {self.rref_delete_delay}"
            )
        if self.peer_timeout < 1.0:
            raise ValueError(f"peer_timeout must be >= 1 second, got {self.peer_timeout}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port (0: off), got {self.metrics_port}")
        if not 1 <= self.bulk_sockets <= MAX_BULK_SOCKETS:
            raise ValueError(
                f"bulk_sockets must be in [1, {MAX_BULK_SOCKETS}], got {self.bulk_sockets}"
            )
        if self.chunk_size < 4096:
            raise ValueError(f"chunk_size must be >= 4096 bytes, got {self.chunk_size}")

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        self.device_maps = {**(self.device_maps or {}), to: dict(device_map)}

    def set_devices(self, devices: list[Any]) -> None:
        self.devices = list(devices)


# Code written for torch.distributed.rpc constructs this name.
TensorPipeRpcBackendOptions = RpcBackendOptions
