"""Dynamic groups: workers that join late, leave, and come back (no world size).

Rules:

- The store holds the truth: an append-only log of membership events under
  ``rrpc/group/<group>/`` (``<group>`` is ``$RRPC_GROUP``, default
  ``default``). ``events`` counts them; ``event/<i>`` is the i-th, a JSON
  record ``{kind: "joined" | "left", name, rank, incarnation, address,
  advertised}``. Every member applies the log in order, so every member goes
  through the same sequence of views.
- Names and ranks are claimed by compare-and-set: ``name/<name>`` and
  ``rank/<rank>`` hold the holder's record, or nothing when free. Two live
  workers never hold one. A leaver frees its claims. A worker that died keeps
  them until a newcomer under that name or rank finds the holder's address
  dead (connection refused, or no answer within ``PROBE_TIMEOUT``) and takes
  them over: that is a rejoin.
- Every join of a rank is counted (``incarnation/<rank>``). The ids a worker
  mints (RRef ids, autograd context ids) start past those of its rank's
  earlier incarnations, so a rank that comes back never reuses an id a peer
  may still hold.
- Push, then pull. Whoever appends an event tells every member it knows with
  a notice (a call of ``_notice``) carrying the event and its index; the
  member applies the log up to that index before it answers. A member that
  missed a notice (one that raced a join) catches up from the log whenever it
  looks: ``get_worker_infos()``, a name or rank it does not know.
- A notice has no authority of its own: any member may send one (``_notice``
  is exposed, for restricted mode), and the rank a stream's caller gives is
  its own word (``auth.py``: the token is the cluster's, not a worker's). So
  the events of the log are read from the store, whatever a notice's text
  says, never past the log's end; and the one event outside the log, a
  leaver's "left" that it could not write to the store, proves it comes from
  the leaver: its text carries a key only that incarnation knows, whose hash
  its "joined" record holds (``leave_hash``; ``Group.heard``).
- A leaver's notice is answered once the member has marked it gone (new calls
  to it fail at once, naming it) and its own calls to the leaver are done. So
  when every member has answered, nobody has a call left on the leaver, and
  it may stop.
- User callbacks (``on_membership_change``) run on one thread,
  ``rrpc-membership``, in log order; never on a transport thread.

Theory of operation. Join (``init_rpc`` without a world size): count an
incarnation of the rank; claim the name, then the rank; append ``joined``;
apply the log up to that event (the joiner's first view, itself included);
then, once the agent serves requests, notify every member. Every step of a
join shares ``init_rpc``'s deadline (``Rendezvous.request_in_time``: each
store request gets what the earlier ones left, a probe of a claim's holder
too), so a store that slows down or stops answering ends the join by
``init_timeout``, with an error naming the step. Leave (graceful
``shutdown``): let go of every user RRef held here and wait until the owners
have the DELETEs and every call this worker made is answered; append ``left``;
free the claims; notify every member and wait for the answers; stop. A worker
that cannot reach the store at leave still notifies the members directly
(index 0: an event outside the log, with its leave key), then raises
``StoreUnreachableError``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rrpc import agent as agent_module
from rrpc import functions, logs
from rrpc.agent import Agent, current_agent
from rrpc.messages import CALL, RpcError, WorkerInfo
from rrpc.rendezvous import DEADLINE_LOOK, REQUEST_LIMIT, Rendezvous, StoreUnreachableError

log = logging.getLogger("rrpc")

PROBE_TIMEOUT = 2.0  # seconds a claim's holder has to accept a TCP connection
NOTICE_TIMEOUT = 5.0  # seconds a member has to answer a join notice


@dataclass(frozen=True)
class MembershipEvent:
    """A change of a dynamic group, as ``on_membership_change`` callbacks get it.

    ``kind`` is ``"joined"`` or ``"left"``; ``worker`` the worker that did;
    ``address`` where it serves; ``incarnation`` how many times its rank had
    joined before (a ``"joined"`` event with a name already in the group is a
    rejoin: the old process is gone, calls to it failed, calls from now on go
    to the new one)."""

    kind: str
    worker: WorkerInfo
    address: str
    incarnation: int


_callbacks: list[Callable[[MembershipEvent], Any]] = []
_deliveries: queue.SimpleQueue = queue.SimpleQueue()  # (callbacks, event), in log order
_deliverer: threading.Thread | None = None
_callbacks_lock = threading.Lock()


def on_membership_change(callback: Callable[[MembershipEvent], Any]) -> Callable[[], None]:
    """Call ``callback(event)`` whenever a worker joins or leaves this worker's
    dynamic group; returns a function that unsubscribes it.

    Callbacks run one at a time, in the order the group changed, on a thread
    of their own (they may make RPCs); an exception in one is logged. They
    stay subscribed across ``shutdown()`` and ``init_rpc()``. Events come from
    dynamic groups only (``init_rpc`` without a world size).

    Example::

        def changed(event):
            print(event.kind, event.worker.name)   # "joined trainer3", "left trainer1"

        unsubscribe = rrpc.on_membership_change(changed)
    """
    global _deliverer
    if not callable(callback):
        raise TypeError(f"callback must be callable, not {type(callback).__name__}")
    with _callbacks_lock:
        _callbacks.append(callback)
        if _deliverer is None:
            _deliverer = threading.Thread(target=_deliver, name="rrpc-membership", daemon=True)
            _deliverer.start()

    def unsubscribe() -> None:
        with _callbacks_lock:
            if callback in _callbacks:
                _callbacks.remove(callback)

    return unsubscribe


def _deliver() -> None:
    while True:
        callbacks, event = _deliveries.get()
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("rrpc: membership callback %r failed on %s", callback, event)


def get_worker_infos() -> list[WorkerInfo]:
    """Every worker of this worker's group, itself included, ordered by rank.

    In a dynamic group it reads the group's log first, so it reflects every
    join and leave the store has seen; in a static group it is the world.

    Example::

        [w.name for w in rrpc.get_worker_infos()]   # ['ps', 'trainer0', 'trainer1']
    """
    agent = current_agent()
    group = agent.group
    if group is None:
        return agent.all_workers()
    return group.workers()


class Group:
    """This worker's membership of a dynamic group; see the module doc. The
    agent holds it (``agent.group``) from the end of ``join`` to the start of
    ``leave``: while this worker is a member."""

    def __init__(self, rendezvous: Rendezvous, rank: int):
        self.rendezvous = rendezvous
        self.rank = rank
        self.prefix = f"rrpc/group/{os.environ.get('RRPC_GROUP') or 'default'}/"
        self.lock = threading.RLock()  # applying events; held across store reads
        self.applied = 0  # the log's events applied here, 1..applied
        self.members: dict[str, dict] = {}  # name -> its "joined" record
        self.agent: Agent | None = None
        self.record: dict | None = None  # this worker's own record once joined
        self._claimed: list[str] = []  # store keys holding our record
        self._joined_at = 0  # the index of our "joined" event
        # Proves a "left" outside the log ours: only its hash is published.
        self._leave_key = secrets.token_hex(16)

    # -- Store requests ------------------------------------------------------
    def _request(self, what: str, operation: Callable[[], Any], limit: float | None) -> Any:
        """A store request within ``limit`` seconds; None: a step of the join,
        within what is left of ``init_rpc``'s deadline (see the module doc)."""
        if limit is None:
            return self.rendezvous.request_in_time(f"joining, {what}", operation)
        return self.rendezvous.request(what, operation, limit)

    def next_incarnation(self) -> int:
        """How many times this rank joined before (0 the first time); counts this join."""
        store, key = self.rendezvous.store, f"{self.prefix}incarnation/{self.rank}"
        what = f"counting rank {self.rank}'s incarnations"
        return self._request(what, lambda: store.add(key, 1), None) - 1

    # -- Joining -------------------------------------------------------------
    def join(self, agent: Agent) -> None:
        """Claim name and rank, append ``joined``, learn the group (see the
        module doc), by ``init_rpc``'s deadline."""
        self.agent = agent
        name = agent.info.name
        self._request("saying the group is dynamic", self.rendezvous.mark_mode, None)
        record = {
            "kind": "joined",
            "name": name,
            "rank": self.rank,
            "incarnation": agent.incarnation,
            "address": agent.address,
            "advertised": agent.advertisement(),
            "leave_hash": _hash(self._leave_key),
        }
        self.record, mine = record, json.dumps(record)
        try:
            self._claim(f"{self.prefix}name/{name}", mine, f"worker name {name!r}")
            self._claim(f"{self.prefix}rank/{self.rank}", mine, f"rank {self.rank}")
            self._joined_at = self._append(mine, None)
            self.catch_up(self._joined_at, limit=None)
        except BaseException:
            # Within the time left: a claim not freed is taken over by the next
            # worker of that name or rank, whose probe finds our address dead
            # at once (the agent stops now).
            self._release(self.rendezvous.time_left())
            raise
        agent.group = self

    def _claim(self, key: str, mine: str, what: str) -> None:
        store = self.rendezvous.store
        for _ in range(10):
            current = self._request(
                f"claiming {what}", lambda: _text(store.compare_set(key, "", mine)), None
            )
            if current != mine:
                holder = json.loads(current)
                if self._holder_answers(holder, what):
                    raise RpcError(
                        f"{what} is not unique: worker {holder['name']!r} (rank "
                        f"{holder['rank']}) holds it and still runs at {holder['address']}"
                    )
                # Its holder died without leaving: this join is a rejoin; take it over.
                current = self._request(f"claiming {what}", _swap(store, key, current, mine), None)
                if current != mine:
                    continue  # someone else changed it meanwhile: look again
                log.info(
                    "rrpc: %s takes %s over from %r (rank %d) at %s, which no longer answers",
                    self.agent.info.name if self.agent else "?",
                    what,
                    holder["name"],
                    holder["rank"],
                    holder["address"],
                )
            self._claimed.append(key)
            return
        raise RpcError(f"could not claim {what}: it kept changing hands")

    def _holder_answers(self, holder: dict, what: str) -> bool:
        """Whether the holder of a claim still runs (it accepts connections),
        probed within what is left of the join's deadline. A probe cut short
        by the deadline proves nothing: a live holder may be slow to accept,
        and taking its name over would give one name two workers."""
        left = self.rendezvous.time_left()
        probe = min(PROBE_TIMEOUT, left)
        try:
            if probe <= 0:
                raise TimeoutError
            return _answers(holder["address"], probe)
        except TimeoutError:
            if probe >= PROBE_TIMEOUT:
                return False  # a whole probe without an answer: it no longer runs
            raise self.rendezvous.timed_out(
                f"while probing whether {holder['name']!r}, which holds {what}, still runs "
                f"at {holder['address']}"
            ) from None

    def _release(self, limit: float) -> None:
        """Free our claims (those still ours: a successor's stay), in one
        request of at most ``limit`` seconds."""
        store, mine = self.rendezvous.store, json.dumps(self.record)
        claimed, self._claimed = self._claimed, []

        def free() -> None:
            for key in claimed:
                store.compare_set(key, mine, "")

        if claimed and limit > 0:
            try:
                self._request("leaving", free, limit)
            except Exception:
                pass  # unreachable: logged; a successor takes it over after a probe

    def _append(self, text: str, limit: float | None) -> int:
        store, prefix = self.rendezvous.store, self.prefix

        def append() -> int:
            index = store.add(f"{prefix}events", 1)
            store.set(f"{prefix}event/{index}", text)
            return index

        return self._request("writing to the group's log", append, limit)

    def announce(self) -> None:
        """Tell every member that this worker joined (after it serves requests),
        waiting for their answers within what is left of ``init_rpc``'s
        deadline (a last look at least): one that misses it learns from the log."""
        assert self.record is not None
        timeout = min(NOTICE_TIMEOUT, max(DEADLINE_LOOK, self.rendezvous.time_left()))
        self._notify(self._joined_at, json.dumps(self.record), timeout, 0.0)

    # -- Applying the log ----------------------------------------------------
    def catch_up(self, index: int | None = None, limit: float | None = REQUEST_LIMIT) -> None:
        """Apply the log up to event ``index`` (None: its end), as the store
        has it; never past the log's end (an index may be a notice's word)."""
        store, prefix = self.rendezvous.store, self.prefix
        with self.lock:
            first = self.applied + 1
            if index is not None and index < first:
                return

            def read() -> list[bytes]:
                end = store.add(f"{prefix}events", 0)
                last = end if index is None else min(index, end)
                keys = [f"{prefix}event/{i}" for i in range(first, last + 1)]
                return store.multi_get(keys) if keys else []

            texts = self._request("reading the group's log", read, limit)
            for i, text in enumerate(texts, first):
                self._apply(json.loads(_text(text)))
                self.applied = i

    def heard(self, index: int, text: str) -> dict | None:
        """Apply what a notice says happened (see the module doc): the log up
        to event ``index``, read from the store; or, ``index`` 0, a leaver's
        "left" outside the log, if it proves it comes from the leaver, for the
        member's current incarnation. Returns the event a leaver's drain is
        for (a "left" as the log or its leaver has it), else None.

        Raises ``RpcError`` for a notice that cannot be true (logged): a peer
        sent it that may be a member but is no authority on membership."""
        claim = _parsed(text)
        if not isinstance(index, int) or index < 0 or claim is None:
            raise self._false_notice(index, claim or {}, "it is malformed")
        if index:
            with self.lock:
                self.catch_up(index)
                if index > self.applied:
                    raise self._false_notice(index, claim, "the group's log has no such event")
            if claim.get("kind") != "left":
                return None  # nothing to drain; what joined was read from the log
            store, key = self.rendezvous.store, f"{self.prefix}event/{index}"
            logged = self._request(
                "reading the group's log", lambda: _text(store.get(key)), REQUEST_LIMIT
            )
            event = json.loads(logged)
            return event if event["kind"] == "left" else None
        with self.lock:
            if claim.get("kind") != "left":
                raise self._false_notice(index, claim, 'only a leaver\'s own "left" is')
            current = self.members.get(str(claim.get("name")))
            if current is None or (current["rank"], current["incarnation"]) != (
                claim.get("rank"),
                claim.get("incarnation"),
            ):
                return None  # an older incarnation's, or applied already from the log
            if not _proves(current, claim.get("leave_key")):
                raise self._false_notice(index, claim, "it does not come from the leaver")
            event = {**current, "kind": "left"}
            self._apply(event)
        return event

    def _false_notice(self, index: object, claim: dict, why: str) -> RpcError:
        """The error for a false notice, logged. Its words are the sender's,
        quoted; one log line per interval for them all: the sender is unknown."""
        assert self.agent is not None
        what = f"{claim.get('kind')!r} of {claim.get('name')!r} (rank {claim.get('rank')!r})"
        where = f"event {index!r} of the group's log" if index else "an event outside the log"
        logs.event(
            "false-notice",
            "membership",
            "%s: ignored a membership notice that cannot be true (%s as %s): %s",
            self.agent.info.name,
            what,
            where,
            why,
        )
        return RpcError(
            f"{self.agent.info.name} ignored a membership notice ({what} as {where}): {why}"
        )

    def _apply(self, event: dict) -> None:
        """One event, in log order (or outside it, from a leaver that could not
        reach the store: only a "left" for the member's current incarnation applies)."""
        assert self.agent is not None
        agent = self.agent
        info = WorkerInfo(event["name"], event["rank"])
        incarnation = (event["rank"], event["incarnation"])
        if event["kind"] == "joined":
            for old in [
                record
                for record in self.members.values()
                if record["name"] == info.name or record["rank"] == info.id
            ]:
                del self.members[old["name"]]
                agent.remove_peer(
                    WorkerInfo(old["name"], old["rank"]),
                    f"worker {old['name']!r} (rank {old['rank']}) was replaced: "
                    f"{info.name!r} joined as rank {info.id} at {event['address']}",
                    close=True,  # its process is gone; its stream went to the old address
                )
            self.members[info.name] = event
            agent.add_peer(info, event["address"], event["advertised"])
        else:
            current = self.members.get(info.name)
            if current is None or (current["rank"], current["incarnation"]) != incarnation:
                return  # an older incarnation's, or already applied
            del self.members[info.name]
            if info == agent.info:
                return
            agent.remove_peer(
                info, f"worker {info.name!r} (rank {info.id}) left the group", close=False
            )
        with _callbacks_lock:
            callbacks = list(_callbacks)
        if callbacks:
            change = MembershipEvent(event["kind"], info, event["address"], event["incarnation"])
            _deliveries.put((callbacks, change))

    def lookup(self, worker: str | int) -> tuple[WorkerInfo, str, dict] | None:
        """A member by name or rank, after reading the log; None if there is none."""
        self.catch_up()
        with self.lock:
            for record in self.members.values():
                if worker in (record["name"], record["rank"]):
                    info = WorkerInfo(record["name"], record["rank"])
                    return info, record["address"], record["advertised"]
        return None

    def workers(self) -> list[WorkerInfo]:
        self.catch_up()
        with self.lock:
            infos = [WorkerInfo(r["name"], r["rank"]) for r in self.members.values()]
        return sorted(infos, key=lambda info: info.id)

    # -- Notices -------------------------------------------------------------
    def _notify(self, index: int, text: str, timeout: float, drain: float) -> None:
        """Send the event to every other member; wait for their answers (each
        within ``timeout`` seconds, 0: none). Members that are gone are skipped."""
        assert self.agent is not None
        agent = self.agent
        with self.lock:
            targets = [
                WorkerInfo(r["name"], r["rank"])
                for r in self.members.values()
                if r["name"] != agent.info.name
            ]
        replies = []
        for peer in targets:
            try:
                replies.append(
                    agent.send(
                        peer,
                        CALL,
                        (_notice, (index, text, drain), {}),
                        timeout,
                        f"membership notice to {peer.name}",
                    )
                )
            except RpcError as exc:
                log.debug("rrpc: membership notice to %s not sent: %s", peer.name, exc)
        for reply in replies:
            try:
                reply.wait()
            except Exception as exc:  # gone, or leaving too: it learns from the log
                log.debug("rrpc: membership notice not answered: %s", exc)

    # -- Leaving ---------------------------------------------------------------
    def leave(self, deadline: float, graceful: bool) -> None:
        """Append ``left``, free the claims, tell the members (see the module doc).

        Raises ``StoreUnreachableError`` if the store did not answer within
        the time left before ``deadline`` (at most ``REQUEST_LIMIT``); the
        members are told directly then, with the key that proves it us."""
        assert self.agent is not None and self.record is not None
        limit = min(REQUEST_LIMIT, _remaining(deadline)) if graceful else 2.0
        text = json.dumps({**self.record, "kind": "left"})
        unreachable: StoreUnreachableError | None = None
        try:
            index = self._append(text, limit)
            self._release(limit)
            with self.lock:  # members that joined before we left: they must hear of it
                self.catch_up(index - 1, limit=limit)
        except StoreUnreachableError as exc:
            index, unreachable = 0, exc
            text = json.dumps({**self.record, "kind": "left", "leave_key": self._leave_key})
        if self.agent.group is self:
            self.agent.group = None
        remaining = _remaining(deadline)
        if graceful and remaining > 0:
            wait = 0.0 if remaining == math.inf else remaining
            self._notify(index, text, wait, wait)
        if unreachable is not None:
            raise unreachable


def _notice(index: int, text: str, drain: float) -> None:
    """A member joined or left (event ``index`` of the log, which ``text``
    describes; 0: an event a leaver could not write to the store, ``text``
    itself). Answered once applied and, for a leaver, once this worker has no
    call left on it (``drain``: seconds, 0 no limit). What is applied is what
    the store or the leaver's proof says, not the sender (``Group.heard``)."""
    agent = agent_module._current
    group = agent.group if agent is not None else None
    if group is None:
        return  # not (or no longer) a member
    event = group.heard(index, text)
    if event is not None and group.agent is not None:
        group.agent.wait_idle(drain or math.inf, peer=event["rank"])


# Restricted mode: peers may send it. It takes only JSON text, and trusts none of it.
functions.expose(_notice)


def _swap(store: Any, key: str, expected: str, desired: str) -> Callable[[], str]:
    return lambda: _text(store.compare_set(key, expected, desired))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parsed(text: object) -> dict | None:
    """A notice's JSON object, or None if it is not one."""
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _proves(record: dict, key: object) -> bool:
    """Whether ``key`` is the leave key of the member that joined with ``record``."""
    published = record.get("leave_hash")
    if not isinstance(key, str) or not isinstance(published, str):
        return False  # a record from before leave keys proves nothing
    return hmac.compare_digest(_hash(key), published)


def _answers(address: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``address`` (host:port);
    ``TimeoutError`` if it neither accepts nor refuses within ``timeout`` seconds."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except TimeoutError:
        raise
    except OSError:
        return False


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic()) if deadline != math.inf else math.inf
