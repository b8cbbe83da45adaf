"""The end of a distributed autograd context: its release on every participant.

Theory of operation. Leaving a ``with context()`` block drops the context on
this worker (``ContextTable.release``) and sends AUTOGRAD_RELEASE to every
participant not told yet; each drops it and forwards the release to its own
participants not told yet, naming who has been told, so that every worker is
told once. Nobody waits for the answers (as in torch); ``wait`` does, for
tests and for the drain before ``shutdown``.

A training loop ends a context every step. The releases of ``RELEASE_DELAY``
go to each participant in one message, sent from the scheduler's thread, so
that a step's own calls do not share their lane with a release and its reply
every step; ``RELEASE_BATCH`` gathered for one participant go at once, from
the thread that left the block, so a loop of tiny steps keeps at most that
many ended contexts alive on a peer, and a message names at most that many.
A flush (timed, full, or asked for) cancels the timer armed for what it
took: the next releases wait a delay of their own.

A release is a protocol message: one that fault injection drops is sent
again (``Agent.send_reliably``); one that fails (a peer gone) is logged at
debug level, as there is nothing left to free there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rrpc.agent import Agent
from rrpc.autograd_context import ContextTable
from rrpc.dispatch import Deferred
from rrpc.futures import Future, all_settled, on_done, wait_until
from rrpc.messages import AUTOGRAD_RELEASE, WorkerInfo
from rrpc.scheduler import Handle

log = logging.getLogger("rrpc.autograd")

# Releases gathered this long go to each participant in one message (seconds;
# 0: each at once, from the thread that left the block) ...
RELEASE_DELAY = 0.005
# ... or as soon as this many are gathered for one participant, from the thread
# that left the block: what the delay holds on peers stays bounded.
RELEASE_BATCH = 16

Told = tuple[int, frozenset[int]]  # a context id, and the ranks told of its end already


class Releases:
    """The releases of one run: gathered, under way (until answered), and served."""

    def __init__(self, agent: Agent, table: ContextTable):
        self.agent = agent
        self.table = table
        self._lock = threading.Lock()
        self._pending: set[torch.futures.Future] = set()  # sent, not answered yet
        # Not sent yet (RELEASE_DELAY), by participant.
        self._unsent: dict[int, tuple[WorkerInfo, list[Told]]] = {}
        self._timer: Handle | None = None  # the scheduler's flush of those

    def release(self, context_id: int) -> None:
        """This worker's ``with context()`` block ended: release it everywhere."""
        targets = self._drop(context_id, frozenset())
        if not targets:
            return
        if RELEASE_DELAY <= 0:
            for peer, told in targets:
                self._track(self._send(peer, [(context_id, told)]))
            return
        with self._lock:
            first = not self._unsent
            full = False
            for peer, told in targets:
                gathered = self._unsent.setdefault(peer.id, (peer, []))[1]
                gathered.append((context_id, told))
                full = full or len(gathered) >= RELEASE_BATCH
        if full:
            self.flush()
        elif first:
            self._timer = self.agent.scheduler.call_later(RELEASE_DELAY, self.flush)

    def flush(self) -> None:
        """Send the releases gathered so far (the scheduler does, ``RELEASE_DELAY``
        after the first; a full batch, a drain and ``wait`` do at once)."""
        with self._lock:
            unsent, self._unsent = self._unsent, {}
            timer, self._timer = self._timer, None
            if timer is not None:  # flushed early: the next releases get a delay of their own
                timer.cancel()
            if not unsent:
                return
            flushing = Future()  # until what it took is tracked
            self._pending.add(flushing)
        try:
            for peer, releases in unsent.values():
                self._track(self._send(peer, releases))
        finally:
            with self._lock:
                self._pending.discard(flushing)
            flushing.set_result(None)

    def serve(self, payload: list, caller: WorkerInfo) -> Any:
        """AUTOGRAD_RELEASE: contexts ended (``[(context id, told)]``); drop
        them and pass the releases on to those not told yet."""
        futures = []
        for context_id, told in payload:
            for peer, told_on in self._drop(context_id, told):
                future = self._send(peer, [(context_id, told_on)])
                if future is not None:
                    futures.append(future)
        return Deferred(all_settled(futures, _failed)) if futures else None

    def pending(self) -> int:
        """Releases gathered or under way."""
        with self._lock:
            unsent = sum(len(releases) for _, releases in self._unsent.values())
            return len(self._pending) + unsent

    def wait(self, timeout: float) -> bool:
        """Flush, then wait until every release under way is answered; False on timeout."""
        self.flush()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            for future in pending:
                if not wait_until(future, deadline - time.monotonic()):
                    return False

    def stop(self) -> None:
        """The run is over: forget what was gathered or under way."""
        with self._lock:
            self._pending.clear()
            self._unsent.clear()

    def _track(self, future: torch.futures.Future | None) -> None:
        """Keep a release under way until it is answered (``wait``)."""
        if future is None:
            return
        settled = all_settled([future], _failed)
        with self._lock:
            self._pending.add(settled)

        def forget(_: torch.futures.Future) -> None:
            with self._lock:
                self._pending.discard(settled)

        on_done(settled, forget)

    def _drop(
        self, context_id: int, told: frozenset[int]
    ) -> list[tuple[WorkerInfo, frozenset[int]]]:
        """Drop the context here; the participants not in ``told`` to release
        it, with whom they need not tell again."""
        context = self.table.release(context_id)
        if context is None:
            return []
        me = self.agent.info.id
        with context.lock:
            targets = [peer for rank, peer in context.participants.items() if rank not in told]
        # Everyone told by us, or before us, need not be told again by those we tell.
        told = told | {peer.id for peer in targets} | {me}
        return [(peer, told) for peer in targets if peer.id != me]

    def _send(self, peer: WorkerInfo, releases: list[Told]) -> torch.futures.Future | None:
        """One AUTOGRAD_RELEASE of ``releases`` to ``peer``: its reply's future."""
        ids = ", ".join(str(context_id) for context_id, _ in releases)
        try:
            return self.agent.send_reliably(
                peer,
                AUTOGRAD_RELEASE,
                releases,
                self.agent.options.rpc_timeout,
                f"release of autograd context(s) {ids}",
            )
        except Exception as exc:  # shutting down: nothing left to free there
            log.debug("rrpc: release of context(s) %s to %s not sent: %s", ids, peer.name, exc)
            return None


def _failed(error: BaseException) -> None:
    log.debug("rrpc: a context release failed: %s", error)
