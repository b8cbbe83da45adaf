"""The RRef protocol as bookkeeping: who refers to which value, and what to send.

Rules:

- Everything that decides when an owner may free a value, or when a user may
  tell the owner that it let go, lives in this file. No I/O, no threads, no
  locks: events in (method calls), messages out (``Send`` actions). ``rref.py``
  calls these methods under its lock and sends what they return.
- A wrong event (a DELETE for a fork the owner never counted, a duplicate
  CREATE) raises ``ProtocolError`` saying which event met which state; the
  caller reports it. Tests drive both tables with plain calls and no processes.

Theory of operation (PyTorch's Remote Reference Protocol, docs/source/rpc/rref.rst):

- Every RRef has a globally unique ``rref_id`` and every *user* copy of it a
  globally unique ``fork_id``; both are ``(creating worker's rank, counter)``.
  The **owner** holds the value; its ``OwnerTable`` maps each rref id that users
  refer to onto the value's holder and the set of fork ids it must wait for.
  A value nobody else refers to has no entry: the owner's own Python objects
  keep it alive like any object.
- Creating: ``remote()`` on a user makes fork ``f`` unconfirmed and sends
  CREATE(rref, f). The owner counts ``f`` before running the function and
  replies when the value is set; the reply confirms ``f``.
- Forking: a holder that pickles an RRef for worker X picks a new fork id
  ``c`` for the copy.
  * The owner counts ``c`` at once ("early fork registration"): nothing can
    free the value before X's copy exists, because the owner itself counted it.
  * A user records ``c`` as a *pending child* of its own fork. Its own fork is
    not deleted while it has pending children: its reference stands in for the
    copy in flight. X, receiving ``c``, sends FORK(rref, c) to the owner and,
    once the owner acknowledged it (``c`` counted), ACCEPT(c) to the parent,
    which drops the pending child. If X is the owner it needs no count (the
    owner does not count itself) and sends ACCEPT(c) straight away.
- Deleting: when the application drops a user RRef, its fork is *dropped*. A
  dropped fork that is confirmed and has no pending children sends
  DELETE(rref, fork); the owner removes the fork and frees the value when no
  fork is left. A fork that is not yet confirmed waits for its confirmation:
  handlers run concurrently on the owner, so a DELETE sent earlier could
  overtake the CREATE or FORK that counts the fork.
- Hence at every moment each copy of a reference is either counted by the
  owner or covered by a counted parent that waits for it: no interleaving of
  messages frees a value still referenced, and the last drop frees it after
  at most the round trips above.
- Out of order arrivals: a FORK or a FETCH for a value whose CREATE has not
  run yet (the creator passed its RRef on at once) makes a placeholder entry
  ``awaiting_create``; the CREATE fills it. Placeholders are only possible for
  values created by another worker; an unknown id of this worker's own is an
  error.
- A CREATE that never runs (the owner could not decode it) is reported by its
  creator (CREATE_FAILED): it fails the placeholder, and the owner remembers
  the failure (``failed``, the last ``FAILED_KEPT``), as a FORK or FETCH may
  still come (the RRef was passed on before the creation failed): it gets a
  holder failed already, counted as any until its forks go, instead of a
  placeholder that nothing would fill or free.

User fork transitions (``UserTable``; ``children`` = pending children)::

    state        event                      next         sends
    -----------  -------------------------  -----------  -----------------------------
    (none)       created (remote())         unconfirmed  (CREATE, sent by the caller)
    (none)       received, parent is owner  confirmed    -
    (none)       received, parent is user   unconfirmed  FORK(rref, fork) to owner
    unconfirmed  owner acknowledged         confirmed    ACCEPT(fork) to a user parent
    unconfirmed  owner unreachable/refused  failed       ACCEPT(fork) to a user parent
    any          forked to a child          same         - (child added)
    any          child accepted/discarded   same         - (child removed)
    any          child's receiver gone      same         - (child removed, as lost)
    any          dropped by the application same         - (alive = False)
    confirmed    not alive, no children     (gone)       DELETE(rref, fork) to owner
    failed       not alive, no children     (gone)       - (the owner never counted it)

Owner entry transitions (``OwnerTable``)::

    entry              event                       next                   result
    -----------------  --------------------------  ---------------------  ---------------
    absent             CREATE(f)                   forks {f}              holder
    awaiting_create    CREATE(f)                   forks + f, created     holder
    absent (other's)   FORK(f) / FETCH             awaiting_create        placeholder
    present            FORK(f)                     forks + f              -
    absent / present   forked by owner (f)         forks + f              -
    present            DELETE(f), forks left       forks - f              -
    created            DELETE(f), no fork left     absent                 holder released
    present            received from user p        same                   ACCEPT(f) to p
    present            received from owner itself  as DELETE(f)           holder
    awaiting_create    creation failed             created (as DELETE)    holder to fail
    absent, failed     FORK(f)                     forks {f}              holder failed
    absent, failed     FETCH / receipt from user   absent                 holder failed
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rrpc.messages import RREF_ACCEPT, RREF_DELETE, RREF_FORK, ProtocolError, kind_name

RRefId = tuple[int, int]  # (rank of the worker that created it, that worker's counter)
ForkId = tuple[int, int]
# Failed creations an owner remembers, each with its error (a few hundred
# bytes): a FORK or FETCH that comes after more than this many later failures
# makes a placeholder that waits for ever, as before the failure was known.
FAILED_KEPT = 1024


def format_id(unique_id: tuple[int, int]) -> str:
    return f"{unique_id[0]}:{unique_id[1]}"


@dataclass(frozen=True)
class Send:
    """An action: send a protocol message of ``kind`` to the worker of rank ``to``."""

    kind: int
    to: int
    payload: tuple

    def __repr__(self) -> str:
        return f"Send({kind_name(self.kind)} to rank {self.to}: {self.payload})"


# -- Owner side ----------------------------------------------------------------
@dataclass
class OwnerEntry:
    holder: Any  # what keeps the value alive (rref.py: the owner RRef object)
    forks: set[ForkId] = field(default_factory=set)
    awaiting_create: bool = False  # made by a FORK/FETCH that overtook its CREATE


class OwnerTable:
    """The values this worker owns that other workers refer to.

    ``make_holder(rref_id, failed)`` makes the holder of a value not created
    yet, or (``failed``: its error) never to be."""

    def __init__(self, rank: int, make_holder: Callable[[RRefId, Any], Any]):
        self.rank = rank
        self.make_holder = make_holder
        self.entries: dict[RRefId, OwnerEntry] = {}
        # Creations that failed (``creation_failed``), oldest first: rref id -> error.
        self.failed: collections.OrderedDict[RRefId, Any] = collections.OrderedDict()

    def _entry_or_placeholder(self, rref_id: RRefId, event: str) -> OwnerEntry:
        entry = self.entries.get(rref_id)
        if entry is None:
            if rref_id[0] == self.rank:
                raise ProtocolError(
                    f"{event} for RRef {format_id(rref_id)}, which worker {self.rank} created "
                    "but no longer holds for any user (deleted, or never forked)"
                )
            failed = self.failed.get(rref_id)
            entry = OwnerEntry(self.make_holder(rref_id, failed), awaiting_create=failed is None)
            self.entries[rref_id] = entry
        return entry

    def _holder_of(self, rref_id: RRefId, event: str) -> Any:
        """The holder an event that counts no fork reads; a failed one is not kept."""
        entry = self._entry_or_placeholder(rref_id, event)
        self._release_if_unreferenced(rref_id, entry)
        return entry.holder

    def _add_fork(self, entry: OwnerEntry, rref_id: RRefId, fork_id: ForkId, event: str) -> None:
        if fork_id in entry.forks:
            raise ProtocolError(
                f"{event}: fork {format_id(fork_id)} of {format_id(rref_id)} is already counted"
            )
        entry.forks.add(fork_id)

    def holder(self, rref_id: RRefId) -> Any:
        """The holder of a value a user names by id in a call (a placeholder if
        its CREATE has not run yet). The calling user keeps its fork for the
        whole call, so the entry exists or is still to be created."""
        return self._holder_of(rref_id, "call by id")

    def create(self, rref_id: RRefId, fork_id: ForkId) -> Any:
        """CREATE from the worker that called remote(): count its fork; return the holder."""
        entry = self.entries.get(rref_id)
        if entry is None:
            entry = OwnerEntry(self.make_holder(rref_id, None))
            self.entries[rref_id] = entry
        elif entry.awaiting_create:
            entry.awaiting_create = False
        else:
            raise ProtocolError(f"CREATE of RRef {format_id(rref_id)}, which exists already")
        self._add_fork(entry, rref_id, fork_id, "CREATE")
        return entry.holder

    def fork_request(self, rref_id: RRefId, fork_id: ForkId) -> None:
        """FORK from a user that received fork ``fork_id`` from another user."""
        entry = self._entry_or_placeholder(rref_id, f"FORK of {format_id(fork_id)}")
        self._add_fork(entry, rref_id, fork_id, "FORK")

    def fetch(self, rref_id: RRefId) -> Any:
        """The holder a FETCH (to_here) reads; a placeholder if CREATE has not run yet."""
        return self._holder_of(rref_id, "FETCH")

    def fork_to_user(self, rref_id: RRefId, fork_id: ForkId, holder: Any) -> None:
        """The owner pickles its own RRef for another worker: count the copy now."""
        entry = self.entries.get(rref_id)
        if entry is None:
            entry = self.entries[rref_id] = OwnerEntry(holder)
        self._add_fork(entry, rref_id, fork_id, "fork by the owner")

    def delete(self, rref_id: RRefId, fork_id: ForkId) -> Any:
        """A fork is gone. Returns the holder if that freed the value, else None."""
        entry = self.entries.get(rref_id)
        if entry is None or fork_id not in entry.forks:
            raise ProtocolError(
                f"DELETE of fork {format_id(fork_id)} of RRef {format_id(rref_id)}, which "
                f"{'has no such fork' if entry else 'has no entry'} on worker {self.rank}"
            )
        entry.forks.discard(fork_id)
        return self._release_if_unreferenced(rref_id, entry)

    def receive(self, rref_id: RRefId, fork_id: ForkId, parent: int) -> tuple[Any, list[Send]]:
        """An RRef of this owner arrived back from worker ``parent``, as fork ``fork_id``.

        Returns the holder (the owner's own object, not a copy) and the messages
        to send. If this owner sent it (to itself), the fork it counted when
        pickling is dropped again; the caller must keep the returned holder.
        """
        if parent == self.rank:
            entry = self.entries.get(rref_id)
            holder = entry.holder if entry is not None else None
            self.delete(rref_id, fork_id)
            return holder, []
        # A user sent it: the user's pending child covers it until ACCEPT.
        holder = self._holder_of(rref_id, f"receipt of fork {format_id(fork_id)}")
        return holder, [Send(RREF_ACCEPT, parent, (fork_id,))]

    def creation_failed(self, rref_id: RRefId, error: Any) -> Any:
        """The CREATE of ``rref_id`` will never run (its payload was refused):
        ``error`` is what a FORK or FETCH still to come gets (see the theory).

        Returns the placeholder's holder, for the caller to fail its waiters,
        or None if there is none."""
        self.failed[rref_id] = error
        while len(self.failed) > FAILED_KEPT:
            self.failed.popitem(last=False)
        entry = self.entries.get(rref_id)
        if entry is None or not entry.awaiting_create:
            return None
        entry.awaiting_create = False
        self._release_if_unreferenced(rref_id, entry)
        return entry.holder

    def _release_if_unreferenced(self, rref_id: RRefId, entry: OwnerEntry) -> Any:
        if entry.forks or entry.awaiting_create:
            return None
        del self.entries[rref_id]
        return entry.holder

    def num_forks(self) -> int:
        return sum(len(entry.forks) for entry in self.entries.values())


# -- User side -----------------------------------------------------------------
UNCONFIRMED, CONFIRMED, FAILED = "unconfirmed", "confirmed", "failed"


@dataclass
class UserFork:
    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int | None  # the worker that forked it to us; None for remote()'s creator
    state: str = UNCONFIRMED
    alive: bool = True  # the application still holds the RRef object
    children: set[ForkId] = field(default_factory=set)  # pending children


class UserTable:
    """This worker's user RRefs (forks) and the copies of them still in flight."""

    def __init__(self, rank: int):
        self.rank = rank
        self.forks: dict[ForkId, UserFork] = {}
        self.pending_children: dict[ForkId, ForkId] = {}  # child fork -> parent fork (ours)
        self.child_peers: dict[ForkId, int] = {}  # pending child -> the rank it was sent to
        # Children settled because their receiver is gone (``children_lost``):
        # should one have arrived after all, its ACCEPT is no error.
        self.lost: set[ForkId] = set()

    def _fork(self, fork_id: ForkId, event: str) -> UserFork:
        fork = self.forks.get(fork_id)
        if fork is None:
            raise ProtocolError(
                f"{event} for fork {format_id(fork_id)}, unknown on rank {self.rank}"
            )
        return fork

    def created(self, rref_id: RRefId, fork_id: ForkId, owner: int) -> None:
        """remote() sent CREATE for a new user fork."""
        self.forks[fork_id] = UserFork(rref_id, fork_id, owner, None)

    def received(self, rref_id: RRefId, fork_id: ForkId, owner: int, parent: int) -> list[Send]:
        """An RRef owned by another worker was unpickled here as fork ``fork_id``."""
        if fork_id in self.forks:
            raise ProtocolError(f"fork {format_id(fork_id)} received twice by rank {self.rank}")
        if parent == owner:  # the owner counted it when it pickled it
            self.forks[fork_id] = UserFork(rref_id, fork_id, owner, parent, CONFIRMED)
            return []
        self.forks[fork_id] = UserFork(rref_id, fork_id, owner, parent)
        return [Send(RREF_FORK, owner, (rref_id, fork_id))]

    def confirmed(self, fork_id: ForkId, counted: bool = True) -> list[Send]:
        """The owner acknowledged CREATE/FORK (``counted``), or failed to (False)."""
        fork = self._fork(fork_id, "confirmation")
        if fork.state != UNCONFIRMED:
            raise ProtocolError(f"confirmation of fork {format_id(fork_id)}, which is {fork.state}")
        fork.state = CONFIRMED if counted else FAILED
        sends = []
        if fork.parent is not None and fork.parent != fork.owner:
            if fork.parent == self.rank:
                sends += self.child_accepted(fork_id)
            else:
                sends.append(Send(RREF_ACCEPT, fork.parent, (fork_id,)))
        return sends + self._delete_if_done(fork)

    def fork_child(self, fork_id: ForkId, child_id: ForkId, to: int | None = None) -> None:
        """Our fork ``fork_id`` is being pickled for worker ``to`` as ``child_id``."""
        fork = self._fork(fork_id, f"fork to child {format_id(child_id)}")
        if not fork.alive:
            raise ProtocolError(f"fork {format_id(fork_id)} forked after it was dropped")
        fork.children.add(child_id)
        self.pending_children[child_id] = fork_id
        if to is not None:
            self.child_peers[child_id] = to

    def child_accepted(self, child_id: ForkId) -> list[Send]:
        """ACCEPT: the child is counted by the owner (or is the owner's), or was
        never sent (a discarded pickling)."""
        fork_id = self.pending_children.pop(child_id, None)
        self.child_peers.pop(child_id, None)
        if fork_id is None:
            if child_id in self.lost:  # its receiver was taken for gone, wrongly
                self.lost.discard(child_id)
                return []
            raise ProtocolError(
                f"ACCEPT of child {format_id(child_id)}, not pending on {self.rank}"
            )
        fork = self.forks[fork_id]
        fork.children.discard(child_id)
        return self._delete_if_done(fork)

    def children_lost(self, to: int) -> list[Send]:
        """Worker ``to`` is gone (it left, or is dead): the children sent to it
        will never be ACCEPTed, and each is settled as if it had been, lest
        its parent's DELETE wait for ever. Were ``to`` alive after all, its
        FORK might reach the owner after that DELETE: the copy would fail on
        use, a smaller harm than a value no one can free."""
        sends: list[Send] = []
        for child_id in [child for child, peer in self.child_peers.items() if peer == to]:
            sends += self.child_accepted(child_id)
            self.lost.add(child_id)
        return sends

    def dropped(self, fork_id: ForkId) -> list[Send]:
        """The application let go of the RRef object of ``fork_id``."""
        fork = self._fork(fork_id, "drop")
        fork.alive = False
        return self._delete_if_done(fork)

    def forget(self, fork_id: ForkId) -> None:
        """remote() failed before CREATE left: no such fork exists anywhere."""
        self.forks.pop(fork_id, None)

    def state(self, fork_id: ForkId) -> str | None:
        fork = self.forks.get(fork_id)
        return None if fork is None else fork.state

    def _delete_if_done(self, fork: UserFork) -> list[Send]:
        if fork.alive or fork.children or fork.state == UNCONFIRMED:
            return []
        del self.forks[fork.fork_id]
        if fork.state == FAILED:
            return []
        return [Send(RREF_DELETE, fork.owner, (fork.rref_id, fork.fork_id))]

    def counts(self) -> dict[str, int]:
        unconfirmed = [fork for fork in self.forks.values() if fork.state == UNCONFIRMED]
        return {
            "num_user_rrefs": len(self.forks),
            "num_pending_confirmations": sum(fork.parent is None for fork in unconfirmed),
            "num_pending_forks": sum(fork.parent is not None for fork in unconfirmed),
            "num_pending_children": len(self.pending_children),
        }
