"""Names ⇄ addresses, through the ``torch.distributed`` TCPStore.

Every worker publishes ``rank -> (name, address)`` under a prefix unique to
this init and waits until all ``world_size`` ranks have. Rank 0 hosts the store
at MASTER_ADDR:MASTER_PORT, except under torchrun, whose elastic agent already
hosts one there (``TORCHELASTIC_USE_AGENT_STORE``): then every rank is a client,
exactly as ``init_process_group`` behaves.

The same store carries the shutdown barriers.

Dynamic membership (``world_size=None``, as PyTorch's dynamic RPC): a worker
may join at any time. It publishes itself the same way and learns who is
there; workers already running learn of it lazily, when a name or rank they
do not know is asked for or calls them (``lookup``). There is no barrier at
shutdown in this mode, and the store's host (rank 0) must leave last.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from rrpc import logs
from rrpc.messages import RpcError, WorkerInfo

_generations = itertools.count()  # one prefix per init in this process


def resolve_world(
    rank: int | None, world_size: int | None, init_method: str
) -> tuple[int, int | None, str, int]:
    """Rank, world size (None: dynamic membership) and store address, from the
    arguments or the environment torchrun sets."""
    if rank is None:
        if init_method != "env://":  # torch's wording for each init method
            raise ValueError(f"rank parameter missing: pass rank= to init_rpc ({init_method})")
        rank = _env_int("RANK", "rank")
    if world_size is None and os.environ.get("WORLD_SIZE") is not None:
        world_size = _env_int("WORLD_SIZE", "world_size")
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank < 0 or (world_size is not None and rank >= world_size):
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if init_method.startswith("file://"):
        if not urlparse(init_method).path:
            raise ValueError(f"init_method {init_method!r} must be file:///path/to/file")
        return rank, world_size, init_method, 0
    if init_method.startswith("tcp://"):
        parsed = urlparse(init_method)
        if not parsed.hostname or not parsed.port:
            raise ValueError(f"init_method {init_method!r} must be tcp://host:port")
        return rank, world_size, parsed.hostname, parsed.port
    if init_method != "env://":
        raise ValueError(
            f"init_method must be 'env://', 'tcp://host:port' or 'file:///path', "
            f"not {init_method!r}"
        )
    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ValueError(
            "MASTER_ADDR and MASTER_PORT must be set (or pass init_method='tcp://...')"
        )
    return rank, world_size, host, int(port)


def _env_int(variable: str, argument: str) -> int:
    value = os.environ.get(variable)
    if value is None:
        raise ValueError(
            f"environment variable {variable} expected: pass {argument}= to init_rpc or set "
            f"{variable} (torchrun sets it)"
        )
    return int(value)


# The stores this process hosts, kept across shutdown() and init_rpc() as in
# torch: a worker that re-inits at once must find the store still served.
_hosted_stores: dict[tuple[str, int], dist.Store] = {}


def _open_store(
    host: str, port: int, world_size: int | None, hosting: bool, timeout: float
) -> dist.Store:
    """The rendezvous store: a FileStore for ``file://``, else a TCPStore at
    host:port, hosted here when ``hosting``. TCPStores are multi-tenant, as
    ``torch.distributed``'s own: ``init_process_group`` and ``init_rpc`` of
    one process share one server on MASTER_PORT."""
    if host.startswith("file://"):
        return dist.FileStore(urlparse(host).path, world_size or -1)
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=hosting,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
        multi_tenant=True,
    )
    if hosting:
        _hosted_stores[(host, port)] = store
    return store


def advertise_host(master_host: str, configured: str | None) -> str:
    """The address peers reach this worker at: configured, or the local
    address that routes to the store (127.0.0.1 when the store is local)."""
    if configured:
        return configured
    if master_host.startswith("file://"):
        return "127.0.0.1"  # a file store names no host to route to: set advertise_host
    if master_host in ("localhost", "127.0.0.1", "::1") or master_host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))  # UDP connect sends nothing; it picks a route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class Rendezvous:
    def __init__(self, rank: int, world_size: int | None, host: str, port: int, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.where = host if host.startswith("file://") else f"{host}:{port}"
        self.timeout = timeout
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"rrpc/{restart}/{next(_generations)}/"
        self._gone: set[int] = set()  # ranks found dead at a barrier: nobody waits for them
        self.hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        try:
            self.store = _open_store(host, port, world_size, self.hosting, timeout)
        except Exception as exc:
            raise RpcError(
                f"rank {rank} cannot reach the rendezvous store at {self.where}: {exc}"
            ) from exc

    def _keys(self, tag: str) -> list[str]:
        assert self.world_size is not None
        return [f"{self.prefix}{tag}/{rank}" for rank in range(self.world_size)]

    def _wait(self, tag: str, timeout: float, doing: str) -> None:
        keys = self._keys(tag)
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except Exception as exc:
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            raise RpcError(
                f"{doing} at {self.where} timed out after {timeout:g} s: rank(s) {missing} "
                f"of world_size {self.world_size} never arrived"
            ) from exc

    def exchange(
        self, name: str, address: str, advertised: dict
    ) -> list[tuple[WorkerInfo, str, dict]]:
        """Publish this worker, wait for all, and return every worker's
        (WorkerInfo, address, what it advertised)."""
        if self.store.add(f"{self.prefix}claim/{self.rank}", 1) > 1:
            raise RpcError(f"rank {self.rank} is claimed by more than one worker")
        mode, other = ("dynamic", "static") if self.world_size is None else ("static", "dynamic")
        self.store.set(f"{self.prefix}{mode}", "1")
        if self.store.check([f"{self.prefix}{other}"]):
            raise RpcError(  # torch's wording
                "RPC group mixes statically and dynamically initialized members which is not "
                f"supported: rank {self.rank} joins as {mode}, others as {other}"
            )
        if self.world_size is None and self.store.add(f"{self.prefix}name/{name}", 1) > 1:
            raise RpcError(f"worker name {name!r} is not unique: another worker joined with it")
        self.store.set(f"{self.prefix}worker/{self.rank}", json.dumps([name, address, advertised]))
        self.store.set(f"{self.prefix}rank-of/{name}", str(self.rank))
        if self.world_size is None:
            joined = self.store.add(f"{self.prefix}joined", 1)
            self.store.set(f"{self.prefix}joined/{joined}", str(self.rank))
            ranks = [int(self.store.get(f"{self.prefix}joined/{i}")) for i in range(1, joined + 1)]
            found = (self.lookup(rank) for rank in ranks)
            return [entry for entry in found if entry is not None]
        self._wait("worker", self.timeout, "rendezvous")
        table = [json.loads(self.store.get(key)) for key in self._keys("worker")]
        names = Counter(entry[0] for entry in table)
        for duplicate, count in names.items():
            if count > 1:
                ranks = [rank for rank, entry in enumerate(table) if entry[0] == duplicate]
                raise RpcError(f"worker name {duplicate!r} is not unique: ranks {ranks} all use it")
        return [
            (WorkerInfo(entry[0], rank), entry[1], entry[2]) for rank, entry in enumerate(table)
        ]

    def lookup(self, worker: str | int) -> tuple[WorkerInfo, str, dict] | None:
        """A worker that joined, by name or rank; None if there is none."""
        if isinstance(worker, str):
            key = f"{self.prefix}rank-of/{worker}"
            if not self.store.check([key]):
                return None
            worker = int(self.store.get(key))
        key = f"{self.prefix}worker/{worker}"
        if not self.store.check([key]):
            return None
        name, address, advertised = json.loads(self.store.get(key))
        return WorkerInfo(name, worker), address, advertised

    def barrier(
        self,
        tag: str,
        timeout: float,
        gone: Callable[[list[int]], bool] | None = None,
        suspects: set[int] | frozenset[int] = frozenset(),
        deadline: float = math.inf,
    ) -> None:
        """Wait until every rank arrives (``timeout`` 0: no limit); or, with
        ``gone``, until every rank that has not arrived is one that ``gone``
        confirms dead. (No-op with dynamic membership: there is no fixed set
        of ranks to wait for.)

        It polls an arrival counter (one cheap store request per poll) rather
        than blocking in ``store.wait``: it must notice dead ranks while it
        waits, and c10d logs a warning for every ``wait`` that expires. Ranks
        suspected dead (``suspects``, whose streams broke) are probed at once,
        others every few seconds.

        If the store itself is gone (its host, rank 0's process, died), the
        barrier passes when ``gone`` confirms every other rank dead, and
        raises saying so otherwise."""
        if self.world_size is None:
            return
        if deadline != math.inf:  # no store request may outlast the caller's deadline
            self.store.set_timeout(timedelta(seconds=max(0.5, deadline - time.monotonic())))
        try:
            self._barrier(tag, timeout, gone, suspects, deadline)
        except (dist.DistError, ConnectionError) as exc:
            others = [rank for rank in range(self.world_size) if rank != self.rank]
            if gone is not None and gone(others):
                self._gone = set(others)
                logs.event(
                    "declared-dead",
                    self.where,
                    "rank %d: the store at %s is gone and ranks %s no longer answer: "
                    "declared dead at barrier %r",
                    self.rank,
                    self.where,
                    sorted(others),
                    tag,
                )
                return
            raise RpcError(
                f"barrier {tag!r}: the rendezvous store at {self.where} is unreachable "
                f"({exc}), and some ranks of world_size {self.world_size} still answer"
            ) from exc

    def _barrier(
        self,
        tag: str,
        timeout: float,
        gone: Callable[[list[int]], bool] | None,
        suspects: set[int] | frozenset[int],
        deadline: float = math.inf,
    ) -> None:
        assert self.world_size is not None
        self.store.set(f"{self.prefix}{tag}/{self.rank}", "1")
        counter = f"{self.prefix}{tag}/arrived"
        arrived = self.store.add(counter, 1)
        start = time.monotonic()
        if timeout > 0:
            deadline = min(deadline, start + timeout)
        next_probe = start + (0.0 if suspects else 5.0)
        poll = threading.Event()  # never set: a timed wait between polls
        while arrived < self.world_size:
            now = time.monotonic()
            if gone is not None and now >= next_probe:
                keys = self._keys(tag)
                missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                if not missing:
                    return
                if gone(missing):
                    self._gone = set(missing)
                    logs.event(
                        "declared-dead",
                        self.where,
                        "rank %d: ranks %s no longer answer: declared dead at barrier %r",
                        self.rank,
                        missing,
                        tag,
                    )
                    return
                next_probe = now + (0.5 if suspects else 5.0)
            if now >= deadline:
                keys = self._keys(tag)
                missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                raise RpcError(
                    f"barrier {tag!r} at {self.where} timed out after {timeout:g} s: "
                    f"rank(s) {missing} of world_size {self.world_size} never arrived"
                )
            poll.wait(0.05 if now - start < 1.0 else 0.2)
            arrived = self.store.add(counter, 0)

    def close(self, timeout: float = 10.0) -> None:
        """Leave; the host keeps the store until every rank has left it."""
        try:
            self.store.set(f"{self.prefix}left/{self.rank}", "1")
            if self.hosting and self.world_size is not None:
                keys = [
                    key for rank, key in enumerate(self._keys("left")) if rank not in self._gone
                ]
                self.store.wait(keys, timedelta(seconds=timeout))
        except Exception:
            pass  # a peer that died cannot leave; the store goes anyway
        del self.store
