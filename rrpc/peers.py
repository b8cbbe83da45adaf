"""The peer directory: who the other workers are, where they listen, what each may share.

One entry per worker this one knows: its ``WorkerInfo``, its address, and
what it advertised at rendezvous — whether it runs the same ``__main__``
script (its functions then go by name) and whether it is on this host with a
shared-memory pool this worker can open (see ``shm.py``'s rules: a worker maps
only segments of the pool the peer on that stream advertised). Workers that
join later are looked up on first use (``lookup``, set by ``init_rpc`` under
dynamic membership); workers that left are remembered with why, so a call to
one fails with that reason rather than "unknown worker", and the segments
this worker mapped of theirs are let go (``Directory._unmap``).

No I/O of its own and no threads: the agent owns the streams and calls
``add``/``remove`` when membership changes. Reads take no lock (dict reads
are atomic); a change replaces entries whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rrpc import codec, shm
from rrpc.messages import PeerUnavailableError, RpcError, WorkerInfo

# Finds a worker this one does not know yet: (info, address, advertisement) or None.
Lookup = Callable[[str | int], tuple[WorkerInfo, str, dict] | None]


@dataclass
class Peer:
    info: WorkerInfo
    address: str
    same_main: bool = False  # runs our __main__ script: its functions go by name
    placer: shm.Placer | None = None  # our shared-memory pool, bound to its pid
    source: Callable[[Any], torch.Tensor] | None = None  # maps its segments, only its
    pid: int = 0  # its process, when this worker opened its probe: its segments are "<pid>/<fd>"
    lane_path: str = ""  # its same-host lane's socket, when one may open to it (lane.py)
    bulk_port: int = 0  # its bulk port (bulk.py), 0: none


class UnreadReplies:
    """Replies sent to each peer in shared-memory slots that it has not read
    yet (``shm.Unseen``), by rank: what its streams' readers wait on before
    reading another of its requests (``streams.admit_with``)."""

    def __init__(self, directory: Directory, limit: int):
        self._directory = directory
        self._limit = limit

    def wait(self, rank: int, ended: Callable[[], Any]) -> bool:
        """Wait while more than the limit is unread; False if ``ended()`` meanwhile."""
        entry = self._directory.known(rank)
        if entry is None or entry.placer is None or entry.placer.unseen.bytes <= self._limit:
            return True  # the common case, at the cost of a look
        return entry.placer.unseen.wait_for_room(self._limit, ended)

    def forget(self, rank: int) -> None:
        """A stream of ``rank`` ended: what it did not read will never be read
        there, so it is no longer a backlog to wait on."""
        entry = self._directory.known(rank)
        if entry is not None and entry.placer is not None:
            entry.placer.unseen.forget()


class Directory:
    def __init__(self, shm_pool: shm.SenderPool | None, lane_key: str = ""):
        self._shm_pool = shm_pool
        self._lane_key = lane_key  # ours; "" when this worker opens no lanes
        self._attachments = shm.Attachments()
        self._by_name: dict[str, Peer] = {}
        self._by_rank: dict[int, Peer] = {}
        self.lookup: Lookup | None = None
        # Why each worker that left is gone, by name and by rank.
        self.departed: dict[str | int, str] = {}

    def add(self, info: WorkerInfo, address: str, advertised: dict[str, Any]) -> None:
        if self.departed:
            self.departed.pop(info.name, None)
            self.departed.pop(info.id, None)
        main = advertised.get("main")
        peer = Peer(info, address, same_main=bool(main) and main == codec.main_fingerprint())
        probe, key = advertised.get("probe", ""), advertised.get("shm_key", "")
        if probe and key and advertised.get("host") == shm.host_key():
            pid, key_bytes = int(probe.split("/")[0]), bytes.fromhex(key)
            peer.pid = pid
            self._unmap(peer)  # maps under its pid are an earlier process's (or entry's)
            if self._attachments.can_open(probe, key_bytes):
                peer.source = self._attachments.bind(pid, key_bytes, self._shm_pool)
                if self._shm_pool is not None:
                    peer.placer = self._shm_pool.towards(pid, self._attachments)
        lane_key = advertised.get("lane_key", "")
        if self._lane_key and lane_key == self._lane_key:
            peer.lane_path = advertised.get("lane", "")
        peer.bulk_port = int(advertised.get("bulk", 0) or 0)
        self._by_name[info.name] = peer
        self._by_rank[info.id] = peer

    def remove(self, info: WorkerInfo, reason: str) -> None:
        """Forget ``info`` (not a newer incarnation under the same name or
        rank); calls to it then fail with ``PeerUnavailableError(reason)``."""
        peer = self._by_name.get(info.name)
        if peer is not None and peer.info == info:
            del self._by_name[info.name]
            self._unmap(peer)
        peer = self._by_rank.get(info.id)
        if peer is not None and peer.info == info:
            del self._by_rank[info.id]
            self._unmap(peer)
        self.departed[info.name] = self.departed[info.id] = reason

    def _unmap(self, peer: Peer) -> None:
        """Drop this worker's maps of the segments named under ``peer``'s pid.
        When it leaves: kept, they would hold up to its whole pool for the rest
        of the run. When it is added: any there are of an earlier process
        given that pid (a worker killed, never removed), which would answer
        for the new one's segments. A map dropped while still needed costs a
        map again (``Attachments._map``), and a tensor still alive over a slot
        keeps that slot's map (numpy's base chain) until it is freed."""
        if peer.pid:
            self._attachments.forget(f"{peer.pid}/")

    def known(self, rank: int) -> Peer | None:
        """The peer of ``rank`` if this worker knows it (no lookup)."""
        return self._by_rank.get(rank)

    def get(self, rank: int) -> Peer | None:
        """The peer of ``rank``, looked up if it joined after this worker."""
        peer = self._by_rank.get(rank)
        if peer is None and self.lookup is not None and self._learn(rank) is not None:
            peer = self._by_rank.get(rank)
        return peer

    def resolve(self, to: Any) -> WorkerInfo:
        """A name, a rank or a WorkerInfo as a known worker.

        As torch: an unknown worker is a RuntimeError (``RpcError``), a value
        that names no worker at all (a float, None) a ValueError."""
        if isinstance(to, WorkerInfo):
            key: str | int = to.id
            peer = self._by_rank.get(to.id)
        elif isinstance(to, str):
            key, peer = to, self._by_name.get(to)
        elif isinstance(to, int) and not isinstance(to, bool):
            key, peer = to, self._by_rank.get(to)
        else:
            raise ValueError(
                f"cannot get a WorkerInfo from {to!r}: pass a name, rank or WorkerInfo"
            )
        if peer is not None:
            return peer.info
        found = self._learn(key) if self.lookup is not None else None
        if found is not None:
            return found
        gone = self.departed.get(to.name if isinstance(to, WorkerInfo) else to)
        if gone is not None:
            raise PeerUnavailableError(gone)
        known = ", ".join(sorted(self._by_name)) or "none"
        raise RpcError(f"could not find destination worker {to!r} (known workers: {known})")

    def _learn(self, worker: str | int) -> WorkerInfo | None:
        """Ask the rendezvous about a worker that joined after this one."""
        assert self.lookup is not None
        entry = self.lookup(worker)
        if entry is None:
            return None
        self.add(*entry)
        return entry[0]

    def all(self) -> list[WorkerInfo]:
        """Every worker known, by rank (this one included once it added itself)."""
        return [self._by_rank[rank].info for rank in sorted(self._by_rank)]

    def address(self, rank: int) -> str | None:
        peer = self._by_rank.get(rank)
        return peer.address if peer is not None else None
