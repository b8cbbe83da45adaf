"""Names ⇄ addresses, through the ``torch.distributed`` store (TCPStore, FileStore).

Static groups (a world size): every worker publishes ``rank -> (name, address)``
under a prefix unique to this init and waits until all ``world_size`` ranks
have. Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT, except under
torchrun, whose elastic agent already hosts one there
(``TORCHELASTIC_USE_AGENT_STORE``): then every rank is a client, exactly as
``init_process_group`` behaves. The same store carries the shutdown barriers.

Dynamic groups (no world size): ``rrpc/membership.py`` keeps the group in the
store; this module opens the store and runs its requests. Rank 0 hosts the
store unless one already serves that address (a standalone ``TCPStore``
server, torchrun's c10d rendezvous endpoint): then it is a client like every
other member, and no member is special.

Every store request this module makes on the way out (barrier, leaving) and
every membership request runs under a time limit (``request``): TCPStore's own
timeout does not cover a store that accepts connections but never answers (a
frozen or partitioned host), and such a request would block for minutes.
The requests of ``init_rpc`` share one deadline (``init_timeout`` from its
start, plus a last look): connecting, a static group's exchange, and every
step of a dynamic join (``request_in_time``), so that a slow store cannot
stretch an init to several times its timeout, one request at a time.
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
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch.distributed as dist

from rrpc import logs
from rrpc.messages import RpcError, WorkerInfo

T = TypeVar("T")

_generations = itertools.count()  # one prefix per init in this process

# Seconds one store request may take before the store counts as unreachable,
# where the caller gives no deadline of its own (a shutdown without timeout, a
# membership look-up). A request is one round trip: a healthy store answers in
# milliseconds, even under load.
REQUEST_LIMIT = 10.0
# Seconds a barrier's store request may run past its deadline: its last look
# at who is missing (a store that answers does so in milliseconds).
DEADLINE_LOOK = 0.5
PROBE_LIMIT = 2.0  # seconds a barrier's probe of the missing ranks (``gone``) may take
LEAVE_GRACE = 0.25  # seconds leaving the store may take past its timeout (a round trip or two)
# Seconds the store's host keeps the store, at least, for ranks that have not
# left it: ranks that began shutdown a moment after the host reach their
# barrier's deadline, and its last look, that moment later.
HOST_STAYS = 0.25


class StoreUnreachableError(RpcError, ConnectionError):
    """The rendezvous store did not answer a request in time, or refused it."""


def _confirmed_gone(
    gone: Callable[[list[int], float], bool] | None, ranks: list[int], by: float
) -> bool:
    """Whether ``gone`` confirms ``ranks`` dead, probing them until ``by`` at
    the latest (no time left: not confirmed)."""
    left = min(PROBE_LIMIT, by - time.monotonic())
    return gone is not None and left > 0 and gone(ranks, left)


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


def _address_in_use(error: BaseException) -> bool:
    return "EADDRINUSE" in str(error) or "address already in use" in str(error).lower()


class Rendezvous:
    def __init__(self, rank: int, world_size: int | None, host: str, port: int, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.where = host if host.startswith("file://") else f"{host}:{port}"
        self.timeout = timeout
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"rrpc/{restart}/{next(_generations)}/"
        self._gone: set[int] = set()  # ranks found dead at a barrier: nobody waits for them
        self._store_lost = False  # a barrier found the store gone: leaving it would wait in vain
        # Who a barrier's last look that the store answered found missing (None: no look yet).
        self._absent: list[int] | None = None
        self.hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        # init_rpc's rendezvous ends by this, or by a store request's last look past it.
        self.deadline = time.monotonic() + timeout

        def open_store() -> dist.Store:
            try:
                return _open_store(host, port, world_size, self.hosting, timeout)
            except Exception as exc:
                if not (self.hosting and world_size is None and _address_in_use(exc)):
                    raise
                # A dynamic group's store already serves there (a standalone
                # server, torchrun's c10d endpoint): rank 0 is a member like any other.
                self.hosting = False
                return _open_store(host, port, world_size, False, timeout)

        try:
            # Under a time limit too: TCPStore's own timeout does not cover a
            # store that accepts the connection and never answers (frozen).
            self.store = self.request("connecting", open_store, timeout + DEADLINE_LOOK)
        except StoreUnreachableError:
            raise
        except Exception as exc:
            raise RpcError(
                f"rank {rank} cannot reach the rendezvous store at {self.where}: {exc}"
            ) from exc

    def request(
        self,
        what: str,
        operation: Callable[[], T],
        limit: float = REQUEST_LIMIT,
        late: str | None = None,
    ) -> T:
        """``operation()`` (one or a few store requests), or ``StoreUnreachableError``
        if it fails to reach the store or takes more than ``limit`` seconds
        (``late``: what the error says then; by default, the limit).

        It runs on a thread of its own (``rrpc-store``) so that the caller can
        stop waiting: a request to a frozen store never returns. That thread
        is a daemon and ends when the request does, if it ever does."""
        outcome: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, operation()))
            except BaseException as exc:
                outcome.append((False, exc))
            done.set()

        threading.Thread(target=run, name="rrpc-store", daemon=True).start()
        if not done.wait(max(0.0, limit)):
            raise self._unreachable(what, late or f"no answer within {limit:.3g} s")
        ok, value = outcome[0]
        if ok:
            return value
        if isinstance(value, (dist.DistError, ConnectionError, OSError)):
            raise self._unreachable(what, str(value).splitlines()[0] if str(value) else "") from (
                value
            )
        raise value

    def time_left(self) -> float:
        """Seconds left of ``init_rpc``'s rendezvous: to its deadline, plus a last look."""
        return max(0.0, self.deadline + DEADLINE_LOOK - time.monotonic())

    def request_in_time(self, what: str, operation: Callable[[], T]) -> T:
        """``request`` within what is left of ``init_rpc``'s deadline (``time_left``).

        A step of an init, of which there are several (a dynamic join makes
        some ten requests): each gets what the earlier ones left, not a limit
        of its own. Past the deadline ``operation`` does not start (a claim
        made after ``init_rpc`` gave up would be nobody's to free): the error
        says the init timed out before this step, not that the store is gone."""
        left = self.time_left()
        if left <= 0:
            raise self.timed_out(f"before {what}")
        late = f"no answer by the end of init_timeout ({self.timeout:g} s)"
        return self.request(what, operation, left, late)

    def timed_out(self, when: str) -> RpcError:
        """The error of an init whose deadline passed ``when`` (words: "before
        joining, ...", "while ...") other than waiting for the store."""
        return RpcError(
            f"rank {self.rank}: init_rpc timed out after {self.timeout:g} s (init_timeout) "
            f"{when}, with the rendezvous store at {self.where}"
        )

    def _unreachable(self, what: str, why: str) -> StoreUnreachableError:
        logs.event(
            "store-unreachable",
            self.where,
            "rank %d cannot reach the rendezvous store at %s (%s): %s",
            self.rank,
            self.where,
            what,
            why,
        )
        return StoreUnreachableError(
            f"rank {self.rank} cannot reach the rendezvous store at {self.where} ({what}): {why}"
        )

    def _keys(self, tag: str) -> list[str]:
        assert self.world_size is not None
        return [f"{self.prefix}{tag}/{rank}" for rank in range(self.world_size)]

    def _wait(self, tag: str, timeout: float, doing: str) -> None:
        keys = self._keys(tag)
        try:
            left = max(0.001, self.deadline - time.monotonic())
            self.store.wait(keys, timedelta(seconds=left))
        except Exception as exc:
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            raise RpcError(
                f"{doing} at {self.where} timed out after {timeout:g} s: rank(s) {missing} "
                f"of world_size {self.world_size} never arrived"
            ) from exc

    def mark_mode(self) -> None:
        """Say whether this init is static or dynamic; refuse a group that mixes both."""
        mode, other = ("dynamic", "static") if self.world_size is None else ("static", "dynamic")
        self.store.set(f"{self.prefix}{mode}", "1")
        if self.store.check([f"{self.prefix}{other}"]):
            raise RpcError(  # torch's wording
                "RPC group mixes statically and dynamically initialized members which is not "
                f"supported: rank {self.rank} joins as {mode}, others as {other}"
            )

    def exchange(
        self, name: str, address: str, advertised: dict
    ) -> list[tuple[WorkerInfo, str, dict]]:
        """A static group: publish this worker, wait for all, and return every
        worker's (WorkerInfo, address, what it advertised), by the deadline
        ``timeout`` set (plus a last look), whatever the store does."""
        assert self.world_size is not None, "a dynamic group joins through rrpc.membership"
        limit = max(0.0, self.deadline - time.monotonic()) + DEADLINE_LOOK
        return self.request("rendezvous", lambda: self._exchange(name, address, advertised), limit)

    def _exchange(
        self, name: str, address: str, advertised: dict
    ) -> list[tuple[WorkerInfo, str, dict]]:
        assert self.world_size is not None
        if self.store.add(f"{self.prefix}claim/{self.rank}", 1) > 1:
            raise RpcError(f"rank {self.rank} is claimed by more than one worker")
        self.mark_mode()
        self.store.set(f"{self.prefix}worker/{self.rank}", json.dumps([name, address, advertised]))
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

    def barrier(
        self,
        tag: str,
        timeout: float,
        gone: Callable[[list[int], float], bool] | None = None,
        suspects: set[int] | frozenset[int] = frozenset(),
        deadline: float = math.inf,
    ) -> None:
        """Wait until every rank arrives (``timeout`` 0: no limit); or, with
        ``gone``, until every rank that has not arrived is one that ``gone``
        confirms dead (``gone(ranks, limit)`` probes them within ``limit``
        seconds). (No-op with dynamic membership: there is no fixed set of
        ranks to wait for.)

        It polls an arrival counter (one cheap store request per poll) rather
        than blocking in ``store.wait``: it must notice dead ranks while it
        waits, and c10d logs a warning for every ``wait`` that expires. Ranks
        suspected dead (``suspects``: whose streams broke, or that have not
        answered a probe yet) are probed at once and then often, others every
        few seconds.

        It ends by its deadline (``timeout`` from now or ``deadline``, the
        earlier): probes fit in what is left, and the store requests (the last
        look at who is missing, at the deadline) run ``DEADLINE_LOOK`` past it
        at most, all of them together.

        If the store itself is gone (its host, rank 0's process, died) or does
        not answer (frozen, partitioned), the barrier passes when ``gone``
        confirms every other rank dead, and raises saying so otherwise."""
        if self.world_size is None:
            return
        if timeout > 0:
            deadline = min(deadline, time.monotonic() + timeout)
        self._absent = None
        try:
            self._barrier(tag, timeout, gone, suspects, deadline)
        except (dist.DistError, ConnectionError) as exc:
            self._store_lost = True
            others = [rank for rank in range(self.world_size) if rank != self.rank]
            if _confirmed_gone(gone, others, deadline):
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
            if self._absent:
                # The store went while ranks were missing: most often its host
                # gave up on them at its own deadline, a moment before this
                # rank's. Who never arrived is the news; the store's end, why
                # this barrier cannot wait for them any longer.
                raise RpcError(
                    f"barrier {tag!r}: rank(s) {self._absent} of world_size {self.world_size} "
                    f"never arrived (at the last look), and then the rendezvous store at "
                    f"{self.where} became unreachable ({exc})"
                ) from exc
            raise RpcError(
                f"barrier {tag!r}: the rendezvous store at {self.where} is unreachable "
                f"({exc}), and some ranks of world_size {self.world_size} still answer"
            ) from exc

    def _barrier(
        self,
        tag: str,
        timeout: float,
        gone: Callable[[list[int], float], bool] | None,
        suspects: set[int] | frozenset[int],
        deadline: float,
    ) -> None:
        assert self.world_size is not None
        store = self.store
        start = time.monotonic()

        def limit() -> float:  # the barrier's store requests all end by deadline + a look
            return max(0.0, min(REQUEST_LIMIT, deadline + DEADLINE_LOOK - time.monotonic()))

        def arrive() -> int:
            store.set(f"{self.prefix}{tag}/{self.rank}", "1")
            return store.add(counter, 1)

        def missing() -> list[int]:
            keys = self._keys(tag)
            self._absent = self.request(
                f"barrier {tag!r}",
                lambda: [rank for rank, key in enumerate(keys) if not store.check([key])],
                limit(),
            )
            return self._absent

        counter = f"{self.prefix}{tag}/arrived"
        arrived = self.request(f"barrier {tag!r}", arrive, limit())
        next_probe = start + (0.0 if suspects else 5.0)
        poll = threading.Event()  # never set: a timed wait between polls
        while arrived < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                # One last look: who is missing (or nobody, after all).
                absent = missing()
                if not absent:
                    return
                raise RpcError(
                    f"barrier {tag!r} at {self.where} timed out after {timeout:g} s: "
                    f"rank(s) {absent} of world_size {self.world_size} never arrived"
                )
            if gone is not None and now >= next_probe:
                absent = missing()
                if not absent:
                    return
                if _confirmed_gone(gone, absent, deadline):
                    # A rank that arrived while it was probed may have passed
                    # the barrier and stopped already (unreachable, not dead):
                    # who is still missing now is who died.
                    absent = [rank for rank in missing() if rank in absent]
                    if not absent:
                        return
                    self._gone = set(absent)
                    logs.event(
                        "declared-dead",
                        self.where,
                        "rank %d: ranks %s no longer answer: declared dead at barrier %r",
                        self.rank,
                        absent,
                        tag,
                    )
                    return
                next_probe = time.monotonic() + (0.5 if suspects else 5.0)
            poll.wait(min(0.05 if now - start < 1.0 else 0.2, max(0.0, deadline - now)))
            if time.monotonic() < deadline:  # past it, the last look says who is missing
                arrived = self.request(f"barrier {tag!r}", lambda: store.add(counter, 0), limit())

    def close(self, timeout: float = 10.0) -> None:
        """Leave; the host keeps the store until every rank has left it, for
        ``timeout`` seconds but at least ``HOST_STAYS``. Takes at most that
        plus ``LEAVE_GRACE`` (a store that does not answer is given up then;
        that is logged)."""
        store = self.store
        del self.store
        if self.world_size is None:
            return  # a dynamic member left through rrpc.membership
        if self._store_lost:
            return  # the barrier logged it; nobody waits for this rank's word
        keys = [key for rank, key in enumerate(self._keys("left")) if rank not in self._gone]
        stays = max(timeout, HOST_STAYS)

        def leave() -> None:
            store.set(f"{self.prefix}left/{self.rank}", "1")
            if self.hosting:
                try:
                    store.wait(keys, timedelta(seconds=stays))
                except Exception:
                    pass  # a peer that died cannot leave; the store goes anyway

        limit = stays + LEAVE_GRACE if self.hosting else min(REQUEST_LIMIT, timeout + LEAVE_GRACE)
        try:
            self.request("leaving", leave, limit)
        except StoreUnreachableError:
            pass  # logged; the barrier passed, so nobody waits for this rank's word
