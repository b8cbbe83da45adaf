"""The RRef protocol's driver for one run: its sender thread, the owner's handlers, drain.

The decisions (who counts which fork, when a value is freed, what to send)
are in ``rref_protocol.py``; what users hold (``RRef``, ``remote()``, the
proxies) in ``rref.py``. This file drives the tables for one run
(``init_rpc`` .. ``shutdown``): it turns pickling, unpickling, garbage
collection and replies into protocol events, sends the messages the tables
ask for, and serves the protocol's message kinds (``rrpc/worker.py``
registers them).

Rules:

- One ``RRefService`` per run, held by the agent (``agent.rrefs``). Its lock
  guards both tables; nothing is sent and no value is freed while holding it
  (a reply callback may run inline in ``agent.send``; a value's ``__del__`` may
  do anything). The messages a change of the tables calls for are queued for
  the sender thread in the same hold (``post``), and count as pending until
  it counts them in flight: a drain sees no gap between the two.
- ``RRef.__del__`` only puts an event on a ``SimpleQueue`` (``dropped``: safe
  from any thread, even inside a garbage collection that interrupts code
  holding a lock). One sender thread per run turns those drops into protocol
  events and sends every protocol message (FORK, ACCEPT, DELETE); replies come
  back on the agent's threads and feed the tables again.
- DELETEs and ACCEPTs wait up to ``rref_delete_delay`` on the sender thread
  and go as one message per peer and kind, naming every fork let go or
  counted meanwhile: a loop that drops an RRef per iteration, or passes one
  to its owner per call (each pass is an ACCEPT back to the caller), then
  costs the peer one message per few iterations, not one each. Nothing else
  waits (a delete frees and an accept ends a pending child: neither unblocks
  a caller), and a drain sends what is held at once. Drops and ACCEPTs made
  while messages are held do not wake the sender thread either: it takes
  them when the delay ends (a loop that makes one per iteration wakes it once
  per delay, not per iteration; each wake is a thread switch and a turn at
  the GIL the caller waits for: an RRef passed to its owner cost ~290 µs a
  call on one host with an ACCEPT sent each, ~100 µs without).
- Protocol messages have no timeout: the protocol is only correct if each is
  answered. A dead peer fails them at once (the agent notices), and a graceful
  shutdown waits for them (``RRefService.drain``), as torch does, for
  ``DRAIN_LIMIT`` at most: then it logs what is still pending and goes on.
- A child (a copy of a user RRef sent on) is pending until its receiver
  ACCEPTs it. A receiver that is gone never will: one that left, or fails a
  liveness probe (``_probe``: when a fork with children is dropped while its
  receiver is suspect, and every second of a drain), has its children settled.
- A protocol message known never to have left (fault injection dropped it)
  is sent again (``Agent.send_reliably``), as torch's agent retries its RRef
  messages; it counts as in flight until answered.
- Pickling an RRef is a fork (``fork``); it happens only inside an rrpc
  message, where ``codec.current_peer()`` names the destination (or,
  unpickling, the sender: ``receive_owned``, ``receive_user``).
- No error is raised out of a torch Future here, and a value's error is a
  ``Failed`` result (``rref_values.py`` says why).

Values on the owner live in the owner ``RRef`` object (``_future``: a
``torch.futures.Future`` of the value, pending while ``remote()``'s function
runs). The owner table holds that object while users refer to it, so an RRef
that comes back to its owner unpickles as the very same object.
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rrpc import codec, logs
from rrpc.agent import Agent
from rrpc.dispatch import Deferred
from rrpc.futures import on_done, outcome
from rrpc.messages import (
    RREF_ACCEPT,
    RREF_CREATE_FAILED,
    RREF_DELETE,
    RREF_FORK,
    PeerUnavailableError,
    RpcError,
    WorkerInfo,
    kind_name,
)
from rrpc.rref_protocol import (
    UNCONFIRMED,
    ForkId,
    OwnerTable,
    ProtocolError,
    RRefId,
    Send,
    UserTable,
    format_id,
)
from rrpc.rref_values import Failed, evaluate_into, forward, result

log = logging.getLogger("rrpc")

_DROP, _SEND, _FLUSH = "drop", "send", "flush"
_MAX_HELD = 256  # held DELETEs or ACCEPTs go at once when one peer has this many of a kind
_HELD_KINDS = (RREF_DELETE, RREF_ACCEPT)  # held back (see the rules), many forks per message
# A drain with no timeout of its own ends after this many seconds, as torch's
# (``kDeleteAllUsersTimeout``): a peer that never answers must not hang shutdown.
DRAIN_LIMIT = 100.0
_PROBE_TIMEOUT = 2.0  # a liveness probe of a child's receiver (``_probe``)


class RRefService:
    """The RRef protocol of one run on this worker: its tables, its sender
    thread, its handlers (``serve_*``); see the module doc.

    ``make_placeholder(service, rref_id)`` makes the owner RRef of a value
    another worker will create here (``rref.placeholder``): a FORK or FETCH
    that overtook its CREATE holds it meanwhile."""

    def __init__(self, agent: Agent, make_placeholder: Callable[[RRefService, RRefId], Any]):
        self.agent = agent
        self.rank = agent.info.id
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a message is answered
        self.make_placeholder = make_placeholder
        self.owners = OwnerTable(self.rank, self._placeholder)
        self.users = UserTable(self.rank)
        # Protocol messages sent and not answered yet (FORK is counted as an
        # unconfirmed fork in the user table instead).
        self.in_flight = {RREF_ACCEPT: 0, RREF_DELETE: 0, RREF_CREATE_FAILED: 0}
        # Forks received from a non-owner, until the owner answers their FORK:
        # a message that brought one runs only then (as in torch).
        self.confirmations: dict[ForkId, torch.futures.Future] = {}
        # Local ids from 0, as torch's; a rank that rejoined a dynamic group starts
        # past its earlier incarnations' ids, which peers may still hold.
        self._ids = itertools.count(agent.incarnation << 32)
        # DELETEs and ACCEPTs held back (see the rules): (kind, peer rank) ->
        # what each names, and when the oldest was held. Only the sender
        # thread changes these (``dropped`` and ``post`` read whether any are
        # held: the sender is lingering).
        self.delete_delay = agent.options.rref_delete_delay
        self._held: dict[tuple[int, int], list[Any]] = {}
        self._held_since = 0.0
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        # Forks dropped and not yet taken by the sender thread; it is woken
        # for them only when it is not lingering over held DELETEs (it takes
        # them when the linger ends). Appended from any thread: a deque's
        # append is atomic, and takes no lock a collection could interrupt.
        # ACCEPTs posted are taken the same way (``post``).
        self._drops: collections.deque[ForkId] = collections.deque()
        self._accepts: collections.deque[Send] = collections.deque()
        self._queued = 0  # sends posted, not yet counted in flight (under ``lock``: ``post``)
        self.released: set[ForkId] = set()  # forks let go of by release_user_forks
        self._probing: set[int] = set()  # ranks a liveness probe is out to (``_probe``)
        # remote() to this worker: the value futures its CREATEs are still to
        # run into (``serve_create``; rref.py's ``remote``), by rref id.
        self.here: dict[RRefId, torch.futures.Future] = {}
        self.running = True
        self._sender = threading.Thread(
            target=self._run_sender, name=f"rrpc-rref-{agent.info.name}", daemon=True
        )
        self._sender.start()

    def _placeholder(self, rref_id: RRefId, failed: BaseException | None) -> Any:
        """The owner table's holder of a value not created yet, or (``failed``)
        never to be: its value is that error, for every fetch."""
        holder = self.make_placeholder(self, rref_id)
        if failed is not None:
            holder._future.set_result(Failed(failed))  # new: no callback runs
        return holder

    def new_id(self) -> tuple[int, int]:
        return (self.rank, next(self._ids))  # next() on a count is atomic under the GIL

    def dropped(self, fork_id: ForkId) -> None:
        """A user RRef is gone (its ``__del__``): only queued, for the sender thread."""
        self._drops.append(fork_id)
        if not self._held:  # read after the append: see _run_sender
            self.events.put((_DROP, None))

    # -- Sending -----------------------------------------------------------------
    def post(self, sends: list[Send]) -> None:
        """Have the sender thread send ``sends``; ACCEPTs alone are taken as
        drops are (see the rules), without waking it while it lingers.

        Called with ``lock`` held, the same hold in which the tables made
        them: they count as pending (``pending``) from then until the sender
        counts them in flight, so a drain never finds nothing pending between
        a table's change (a fork confirmed, its DELETE due) and its message."""
        if not sends:
            return
        self._queued += len(sends)
        if self.delete_delay and all(send.kind == RREF_ACCEPT for send in sends):
            self._accepts.extend(sends)
            if not self._held:  # read after the extend: see _run_sender
                self.events.put((_DROP, None))
            return
        self.events.put((_SEND, sends))

    def _run_sender(self) -> None:
        while True:
            if self._held:
                # Lingering: drops and ACCEPTs made meanwhile wait for its end, unannounced.
                linger = self._held_since + self.delete_delay - time.monotonic()
                try:
                    event = self.events.get(timeout=max(0.0, linger))
                except queue.Empty:
                    event = (_FLUSH, None)  # the linger is over: take the drops, send
            else:
                # Nothing held (emptied before the deques are looked at), and
                # ``dropped`` and ``post`` read that after their append: a drop
                # or ACCEPT is either seen here or announced.
                event = (_DROP, None) if self._drops or self._accepts else self.events.get()
            if event is None:
                return
            what, item = event
            try:
                if what == _DROP:
                    self._take_drops()
                elif what == _SEND:
                    self._send_all(item, posted=True)
                else:  # _FLUSH: everything dropped or queued before it is sent
                    self._take_drops()
                    self._send_held()
                    if item is not None:
                        item.set()
                if self._held and not self.delete_delay:
                    self._send_held()
            except Exception:
                log.exception("rrpc: RRef protocol event %s %s failed", what, item)

    def _take_drops(self) -> None:
        """The drops and ACCEPTs queued without an event (see the rules)."""
        while self._accepts:
            self._send_all([self._accepts.popleft()], posted=True)
        while self._drops:
            fork_id = self._drops.popleft()
            with self.lock:
                if fork_id in self.released:  # let go of at leave already
                    self.released.discard(fork_id)
                    continue
                sends = self.users.dropped(fork_id)
            self._send_all(sends)
            if not self.delete_delay:  # switched off: a DELETE per drop, at once
                self._send_held()
        if self.users.child_peers and self.agent.suspects:  # a DELETE may wait on them
            self._probe(suspects_only=True)

    def _probe(self, suspects_only: bool) -> None:
        """Probe the receivers of pending children (``suspects_only``: those whose
        carrier broke); the children of one that is gone are settled."""
        with self.lock:
            ranks = set(self.users.child_peers.values()) - self._probing
        for rank in ranks:
            if suspects_only and rank not in self.agent.suspects:
                continue
            try:
                peer = self.agent.worker_info(rank)
                what = "liveness probe of a pending RRef child's receiver"
                probe = self.agent.probe(peer, _PROBE_TIMEOUT, what)
            except PeerUnavailableError as exc:  # it left the group
                self._children_lost(rank, exc)
                continue
            except Exception:
                continue  # this worker stops
            self._probing.add(rank)
            on_done(probe, functools.partial(self._probed, rank))

    def _probed(self, rank: int, probe: torch.futures.Future) -> None:
        self._probing.discard(rank)
        error = outcome(probe)[1]
        if isinstance(error, PeerUnavailableError) and self.running:
            self._children_lost(rank, error)

    def _children_lost(self, rank: int, error: BaseException) -> None:
        with self.lock:
            sends = self.users.children_lost(rank)
            self.post(sends)
            self.changed.notify_all()
        logs.event("rref-child-lost", str(rank), "RRefs sent to rank %d settled: %s", rank, error)

    def _send_held(self) -> None:
        held, self._held = self._held, {}
        for (kind, peer), named in held.items():
            self._send(Send(kind, peer, tuple(named)))

    def _send_all(self, sends: list[Send], posted: bool = False) -> None:
        """Send or hold ``sends``, counted in flight (``posted``: no longer queued)."""
        with self.lock:
            for send in sends:
                if send.kind in self.in_flight:
                    self.in_flight[send.kind] += 1
            if posted:
                self._queued -= len(sends)
        for send in sends:
            if send.kind not in _HELD_KINDS:
                self._send(send)
                continue
            if not self._held:
                self._held_since = time.monotonic()
            named = self._held.setdefault((send.kind, send.to), [])
            if send.kind == RREF_DELETE:
                named.append(send.payload)  # (rref id, fork id)
            else:
                named.extend(send.payload)  # (child id,)
            if len(named) >= _MAX_HELD:
                self._send_held()

    def _send(self, send: Send) -> None:
        """Send one protocol message; its answer (or failure) goes to ``_answered``."""
        try:
            peer = self.agent.worker_info(send.to)
            what = f"RRef message {kind_name(send.kind)}"
            future = self.agent.send_reliably(peer, send.kind, send.payload, 0, what)
        except BaseException as exc:
            self._answered(send, exc)
            return
        on_done(future, functools.partial(self.on_reply, send))

    def on_reply(self, send: Send, future: torch.futures.Future) -> None:
        self._answered(send, outcome(future)[1])

    def _answered(self, send: Send, error: BaseException | None) -> None:
        if not self.running:
            return  # the session is over and its tables are gone
        # A message that could not go because this worker stopped is no news:
        # an RRef dropped after the shutdown's drain (the owners stop too, and
        # free what it held; a worker leaving a group let go of its RRefs first).
        if (
            error is not None
            and not isinstance(error, PeerUnavailableError)
            and not self.agent.stopped
        ):
            logs.event("rref-message", str(send.to), "%r failed: %s", send, error)
        if send.kind == RREF_FORK:
            self._confirmed(send.payload[1], error)
            return
        with self.lock:
            # A DELETE or ACCEPT names several forks, each counted when it was queued.
            self.in_flight[send.kind] -= len(send.payload) if send.kind in _HELD_KINDS else 1
            self.changed.notify_all()

    def _confirmed(self, fork_id: ForkId, error: BaseException | None) -> list[Send]:
        """The owner answered the CREATE or FORK of ``fork_id``; send what follows."""
        waiting = None
        try:
            with self.lock:
                waiting = self.confirmations.pop(fork_id, None)
                sends = self.users.confirmed(fork_id, counted=error is None)
                self.post(sends)
                self.changed.notify_all()
        except ProtocolError:
            log.exception("rrpc: confirmation of fork %s", format_id(fork_id))
            return []
        finally:
            if waiting is not None:
                waiting.set_result(None)  # the message runs; a failed fork raises on use
        return sends

    # -- remote() confirmations --------------------------------------------------
    def on_created(self, rref_id: RRefId, fork_id: ForkId, owner: int, future) -> None:
        """The owner answered our CREATE: the fork is counted, or it never will be."""
        if not self.running:
            return
        error = outcome(future)[1]
        self._confirmed(fork_id, error)
        if error is not None and not isinstance(error, PeerUnavailableError):
            with self.lock:
                self.post([Send(RREF_CREATE_FAILED, owner, (rref_id,))])

    # -- A user's side ----------------------------------------------------------
    def created(self, rref_id: RRefId, fork_id: ForkId, owner: int) -> None:
        """remote() is about to send the CREATE of ``fork_id`` to ``owner``."""
        with self.lock:
            self.users.created(rref_id, fork_id, owner)

    def forget(self, fork_id: ForkId) -> None:
        """remote()'s CREATE could not be sent: the fork never existed."""
        with self.lock:
            self.users.forget(fork_id)

    def confirmed_fork(self, fork_id: ForkId) -> bool:
        """Whether the owner counted user fork ``fork_id``."""
        with self.lock:
            state = self.users.state(fork_id)
        return state is not None and state != UNCONFIRMED

    # -- Forks (pickling and unpickling an RRef) --------------------------------
    def fork(self, rref_id: RRefId, fork_id: ForkId | None, holder: Any) -> ForkId:
        """An RRef is pickled for another worker: its copy's fork id, counted
        (on the owner, ``fork_id`` None) or a pending child (on a user)."""
        child = self.new_id()
        with self.lock:
            if fork_id is None:
                self.owners.fork_to_user(rref_id, child, holder)
            else:
                self.users.fork_child(fork_id, child, codec.current_peer().id)
        return child

    def undo_fork(self, rref_id: RRefId, fork_id: ForkId | None, child: ForkId) -> None:
        """The message a fork was pickled into is not sent after all."""
        released = None
        try:
            with self.lock:
                if fork_id is None:
                    released = self.owners.delete(rref_id, child)
                else:
                    self.post(self.users.child_accepted(child))
        except ProtocolError:
            log.exception("rrpc: undoing fork %s of RRef %s", format_id(child), format_id(rref_id))
        del released

    def receive_owned(self, rref_id: RRefId, fork_id: ForkId, sender: WorkerInfo) -> Any:
        """An RRef this worker owns came back from ``sender``: the owner RRef
        itself. A message naming a value still being created runs after it."""
        if rref_id[0] != self.rank:
            # A value another worker created here: that worker must exist, or
            # a placeholder would wait for a CREATE that can never come.
            self.agent.worker_info(rref_id[0])
        with self.lock:
            holder, sends = self.owners.receive(rref_id, fork_id, sender.id)
            self.post(sends)
        if holder._future is not None and not holder._future.done():
            # Its remote() has not finished here: the message that names it
            # runs after, as everything the sender sent before it did.
            codec.wait_for(holder._future)
        return holder

    def receive_user(
        self, rref_id: RRefId, fork_id: ForkId, owner_rank: int, sender: WorkerInfo
    ) -> None:
        """A user RRef arrived from ``sender``: from a user, the owner must count
        it first (FORK), and the message that brought it runs once it has."""
        confirmed = None
        with self.lock:
            sends = self.users.received(rref_id, fork_id, owner_rank, sender.id)
            if sends:  # a FORK to the owner: the message runs once it is answered
                confirmed = self.confirmations[fork_id] = torch.futures.Future()
            self.post(sends)
        if confirmed is not None:
            codec.wait_for(confirmed)

    # -- Serving (the owner's side) ----------------------------------------------
    def holder(self, rref_id: RRefId) -> Any:
        """The owner RRef a call names by id (a placeholder while its CREATE has not run)."""
        with self.lock:
            return self.owners.holder(rref_id)

    def serve_create(self, payload: tuple, caller: WorkerInfo) -> Any:
        rref_id, fork_id, func, args, kwargs = payload
        if fork_id is None:  # remote() to this worker (no fork); from no one else
            value = self.here.pop(rref_id, None) if caller.id == self.rank else None
            # None: remote() failed (timed out) before this ran, and keeps no value.
            return None if value is None else evaluate_into(value, func, args, kwargs)
        with self.lock:
            holder = self.owners.create(rref_id, fork_id)
        # Counted; the reply (the user's confirmation) goes once the value is set.
        return evaluate_into(holder._future, func, args, kwargs)

    def serve_fetch(self, payload: tuple, caller: WorkerInfo) -> Any:
        (rref_id,) = payload
        with self.lock:
            holder = self.owners.fetch(rref_id)
        value = holder._future
        if value.done():
            return result(value)
        # Not created yet: reply when it is. An error then travels as a Failed
        # result (see the rules), which the user's sync_result raises.
        reply: torch.futures.Future = torch.futures.Future()
        on_done(value, functools.partial(forward, reply))
        return Deferred(reply)

    def serve_fork(self, payload: tuple, caller: WorkerInfo) -> None:
        rref_id, fork_id = payload
        with self.lock:
            self.owners.fork_request(rref_id, fork_id)

    def serve_accept(self, payload: tuple, caller: WorkerInfo) -> None:
        """ACCEPT of one or several children (held back by the sender: see the
        rules); an unknown one is an error once the others are accepted."""
        sends: list[Send] = []
        unknown: ProtocolError | None = None
        with self.lock:
            for child_id in payload:
                try:
                    sends += self.users.child_accepted(child_id)
                except ProtocolError as exc:
                    unknown = unknown or exc
            self.post(sends)
        if unknown is not None:
            raise unknown

    def serve_delete(self, payload: tuple, caller: WorkerInfo) -> None:
        released = []
        with self.lock:
            for rref_id, fork_id in payload:
                released.append(self.owners.delete(rref_id, fork_id))
        del released  # values may be freed here, outside the lock

    def serve_create_failed(self, payload: tuple, caller: WorkerInfo) -> None:
        (rref_id,) = payload
        error = RpcError(
            f"remote() creating RRef {format_id(rref_id)} on {self.agent.info.name} "
            f"failed on {caller.name} before it ran (see the error remote() got there)"
        )
        with self.lock:
            holder = self.owners.creation_failed(rref_id, error)
        if holder is not None and not holder._future.done():
            holder._future.set_result(Failed(error))

    # -- Debugging ---------------------------------------------------------------
    def debug_info(self) -> dict[str, int]:
        """``rref_debug_info()``: this worker's RRef bookkeeping, as counts."""
        with self.lock:
            return {
                "num_owner_rrefs": len(self.owners.entries),
                "num_owner_forks": self.owners.num_forks(),
                **self.users.counts(),
                "num_pending_deletes": self.in_flight[RREF_DELETE],
                "num_pending_accepts": self.in_flight[RREF_ACCEPT],
            }

    def owner_forks(self) -> dict[RRefId, set[ForkId]]:
        with self.lock:
            return {rref_id: set(entry.forks) for rref_id, entry in self.owners.entries.items()}

    # -- Shutdown ----------------------------------------------------------------
    def pending(self) -> dict[str, int]:
        counts = self.users.counts()
        pending = {
            "pending confirmations": counts["num_pending_confirmations"],
            "pending forks": counts["num_pending_forks"],
            "pending children": counts["num_pending_children"],
            # Made and not yet counted in flight by the sender thread (``post``),
            # and drops it has not taken yet.
            "protocol messages queued": self._queued + len(self._drops),
        }
        pending.update({f"{kind_name(k)} in flight": n for k, n in self.in_flight.items()})
        return {name: n for name, n in pending.items() if n}

    def release_user_forks(self) -> None:
        """Leaving a dynamic group while others stay: let go of every user RRef
        still held here, as if the application had dropped it, so that the
        owners may free the values (``drain`` then waits for the DELETEs)."""
        with self.lock:
            sends = []
            for fork in list(self.users.forks.values()):
                if fork.alive:
                    self.released.add(fork.fork_id)
                    sends += self.users.dropped(fork.fork_id)
            self.post(sends)

    def drain(self, timeout: float) -> None:
        """Wait until every confirmation, child and protocol message is answered;
        raise ``RpcError`` after ``timeout`` (inf: log, and return, after
        ``DRAIN_LIMIT``). The receivers of pending children are probed each second."""
        gc.collect()  # RRefs in reference cycles: drop them now, not after shutdown
        limit = DRAIN_LIMIT if timeout == math.inf else timeout
        deadline = time.monotonic() + limit
        probed = time.monotonic()
        while True:
            flushed = threading.Event()
            self.events.put((_FLUSH, flushed))
            flushed.wait(max(0.0, deadline - time.monotonic()))
            with self.lock:
                pending = self.pending()
                if not pending and flushed.is_set():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # Answers notify; the poll covers drops queued by __del__ meanwhile.
                self.changed.wait(min(remaining, 0.05))
            if "pending children" in pending and time.monotonic() - probed >= 1.0:
                probed = time.monotonic()
                self._probe(suspects_only=False)
        what = f"RRef protocol still waiting after {limit:g} s: {pending or 'queued events'}"
        if timeout != math.inf:
            raise RpcError(f"shutdown of {self.agent.info.name}: {what}")
        logs.event("rref-drain", self.agent.info.name, "shutdown goes on, %s", what)

    def stop(self, timeout: float = 5.0) -> None:
        """End the sender thread (waiting ``timeout`` seconds at most for it to
        finish what it sends) and forget every RRef."""
        self.running = False
        self.events.put(None)
        if self._sender is not threading.current_thread():
            self._sender.join(timeout)
        with self.lock:
            released = list(self.owners.entries.values())
            self.owners.entries.clear()
            self.users.forks.clear()
            self.users.pending_children.clear()
            self.users.child_peers.clear()
        del released
