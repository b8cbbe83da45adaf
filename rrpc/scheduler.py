"""The scheduler: one thread that runs short callbacks at their time, for one run.

Each ``init_rpc`` has one (``Agent.scheduler``, stopped by ``Agent.stop``);
every timed job of the run is an entry on it: call deadlines
(``calls.Deadlines``), resends of dropped protocol messages
(``Agent.send_reliably``), handshake limits (``transport``), RRef creation
timeouts, fault injection's delayed frames (``faults``).

Rules:

- A callback runs on the ``rrpc-scheduler`` thread, a transport thread
  (``messages.mark_transport_thread``): it must be short and never block, and
  it never runs user code. What it completes with ``futures.settle`` has its
  user callbacks handed to a callback thread. Queueing a frame (a send, a
  resend) does not block and may run here; anything that may wait is handed
  on, not run here.
- ``call_later`` / ``call_at`` return a ``Handle``; ``Handle.cancel()`` stops
  a callback that has not started (it drops its function and arguments at
  once, so a cancelled entry holds nothing alive until its time).
- After ``stop()`` nothing more runs: entries still waiting are dropped, and
  ``call_at`` schedules nothing (a resend or timeout that comes after the
  run ended has nobody to tell).

Theory of operation: a heap of ``(when, seq, handle)`` ordered by time, then
by order of scheduling (``seq``), so that callbacks due at the same time run
in the order they were scheduled. The thread sleeps until the earliest entry;
``call_at`` wakes it only when the new entry is earlier than that (timeouts
are mostly equal, so new entries mostly go behind the earliest and wake
nobody). While the thread runs callbacks it is not asleep and needs no wake:
it looks at the heap again before it sleeps. Cancelled entries stay in the
heap until their time unless they become most of it, when it is rebuilt
without them (a timeout that is cancelled on every completion would
otherwise grow it by the number of completions per timeout period).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from rrpc.messages import mark_transport_thread

log = logging.getLogger("rrpc")

# Rebuild the heap when cancelled entries outnumber live ones and there are
# at least this many of them (a small heap is cheaper to leave alone).
_COMPACT_MIN = 256


class Handle:
    """One scheduled callback; ``cancel()`` stops it if it has not started."""

    __slots__ = ("when", "_call", "_queued", "_scheduler")

    def __init__(self, when: float, call: tuple | None, scheduler: Scheduler):
        self.when = when
        # (fn, args) until it runs, is cancelled or dropped: one attribute, so
        # that the scheduler thread reads it whole while cancel() clears it.
        self._call: tuple[Callable[..., Any], tuple] | None = call
        self._queued = False  # in the heap (guarded by the scheduler's lock)
        self._scheduler = scheduler

    def cancel(self) -> None:
        self._scheduler._cancel(self)

    def cancelled(self) -> bool:
        """True once cancelled, run, or dropped by ``stop``."""
        return self._call is None


class Scheduler:
    """Runs callbacks at their time on one thread; see the module doc."""

    def __init__(self, name: str = "rrpc-scheduler"):
        self._heap: list[tuple[float, int, Handle]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        # The time the thread sleeps until: a new entry earlier than this must
        # wake it. -inf while it is awake (it looks at the heap before sleeping).
        self._sleeping_until = -math.inf
        self._cancelled = 0  # cancelled entries still in the heap
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> Handle:
        """Run ``fn(*args)`` on the scheduler thread ``delay_s`` seconds from now."""
        return self.call_at(time.monotonic() + max(0.0, delay_s), fn, *args)

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Handle:
        """Run ``fn(*args)`` on the scheduler thread at ``time.monotonic()`` time ``when``."""
        handle = Handle(when, (fn, args), self)
        with self._cond:
            if self._stopped:
                handle._call = None  # nothing runs after stop
                return handle
            handle._queued = True
            heapq.heappush(self._heap, (when, next(self._seq), handle))
            if when < self._sleeping_until:
                self._sleeping_until = when
                self._cond.notify()
        return handle

    def pending(self) -> int:
        """Entries waiting for their time, cancelled ones not counted."""
        with self._cond:
            return len(self._heap) - self._cancelled

    def _cancel(self, handle: Handle) -> None:
        with self._cond:
            if handle._call is None:
                return  # ran, is running, or was cancelled already
            handle._call = None
            if not handle._queued:
                return  # taken off the heap to run: the thread will skip it
            self._cancelled += 1
            if self._cancelled >= _COMPACT_MIN and 2 * self._cancelled > len(self._heap):
                self._heap = [entry for entry in self._heap if entry[2]._call is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        mark_transport_thread()
        while True:
            due = []
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    now = time.monotonic()
                    heap = self._heap
                    while heap and heap[0][0] <= now:
                        handle = heapq.heappop(heap)[2]
                        handle._queued = False
                        if handle._call is None:
                            self._cancelled -= 1
                        else:
                            due.append(handle)
                    if due:
                        break
                    self._sleeping_until = heap[0][0] if heap else math.inf
                    self._cond.wait(None if not heap else heap[0][0] - now)
                    self._sleeping_until = -math.inf
            for handle in due:
                if self._stopped:
                    return
                # A cancel() from here on either comes first (nothing runs) or
                # finds the handle spent.
                call, handle._call = handle._call, None
                if call is None:
                    continue
                try:
                    call[0](*call[1])
                except BaseException:
                    log.exception("rrpc: a scheduled callback raised")
                del call  # not held until the next callback is due
            del due

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop what waits; waits up to ``timeout`` for a
        running callback to end (not when called from the scheduler thread)."""
        with self._cond:
            self._stopped = True
            for _, _, handle in self._heap:
                handle._call, handle._queued = None, False
            self._heap, self._cancelled = [], 0
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
