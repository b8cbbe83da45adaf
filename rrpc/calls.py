"""The call table: the requests this worker sent and still awaits, and when they expire.

A call is *open* from the moment its request is queued until exactly one of
three things ends it, whichever comes first:

- its reply (``settle``),
- its deadline (``expired(now)``),
- the stream it went out on breaking (``broken(stream)``), or the worker
  stopping (``close_all``).

Each of these removes the calls it returns from the table, atomically under
the GIL (``dict.pop``), so a call is returned once: a reply that comes after the
deadline finds nothing and is dropped. The table does not complete anything:
the agent completes what these return (a value, a timeout, a dead peer), on
the thread that asked. Which thread that is, and what it may do, is the
agent's business (its module doc); this one is unit-tested without processes
(tests/test_calls.py).

The table (``CallTable``) has no I/O and no threads. Its deadlines are
watched by ``Deadlines``: one entry on the run's scheduler
(``scheduler.Scheduler``), at the earliest deadline the table knows. ``open``
returns whether the new deadline is that earliest one, so that the entry is
moved only then (timeouts are mostly equal, so it rarely is). When the entry
is due, ``expired(now)`` scans the table, which is cheap because it runs once
per earliest deadline, not per call, and recomputes the earliest deadline of
what remains; the next entry goes there.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rrpc.messages import What, WorkerInfo


class Call(NamedTuple):
    """One open call: what completes it and what its errors say. A tuple,
    built in C (``_new_call``): no Python frame per call."""

    request_id: int
    future: Any  # a futures.Future or futures.SyncReply
    peer: WorkerInfo
    what: What  # e.g. "call of torch.add", for error messages
    deadline: float  # time.monotonic() seconds; math.inf: none
    started: float
    stream: Any  # the connection it went out on (identity only)
    row: Any = None  # the metrics row it counts in (a metrics.Row)

    @property
    def timeout(self) -> float:
        return self.deadline - self.started


_new_call = tuple.__new__


class CallTable:
    """request id -> ``Call``, for the calls this worker sent and awaits."""

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._earliest = math.inf  # no open call has an earlier deadline

    def open(
        self,
        request_id: int,
        future: Any,
        peer: WorkerInfo,
        what: What,
        timeout: float,
        now: float,
        stream: Any = None,
        row: Any = None,
    ) -> bool:
        """Record a call sent at ``now``, ``timeout`` seconds to live (0: none).
        True if its deadline is now the earliest: the deadline watcher must wake."""
        deadline = now + timeout if timeout > 0 else math.inf
        self._calls[request_id] = _new_call(
            Call, (request_id, future, peer, what, deadline, now, stream, row)
        )
        if deadline < self._earliest:
            self._earliest = deadline
            return True
        return False

    def settle(self, request_id: int) -> Call | None:
        """The call a reply answers, removed; None if it already ended."""
        return self._calls.pop(request_id, None)

    def expired(self, now: float) -> list[Call]:
        """The calls whose deadline is ``now`` or earlier, removed, in id order."""
        # A call opened during the scan may be missed by it: until the scan
        # ends, its open() must report its deadline as the earliest.
        self._earliest = math.inf
        ended, earliest = [], math.inf
        for request_id, call in list(self._calls.items()):
            if call.deadline <= now:
                if self._calls.pop(request_id, None) is not None:
                    ended.append(call)
            elif call.deadline < earliest:
                earliest = call.deadline
        self._earliest = earliest
        return ended

    def earliest(self) -> float:
        """The earliest deadline of an open call (``math.inf``: none); may be
        one already settled, which only wakes the watcher early."""
        return self._earliest

    def broken(self, stream: Any) -> list[Call]:
        """The calls that went out on ``stream``, removed (not those on a newer one)."""
        return self._take(lambda call: call.stream is stream)

    def close_all(self) -> list[Call]:
        """Every open call, removed."""
        return self._take(lambda call: True)

    def _take(self, chosen: Any) -> list[Call]:
        taken = []
        for request_id, call in list(self._calls.items()):
            if chosen(call) and self._calls.pop(request_id, None) is not None:
                taken.append(call)
        return taken

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[Call]:
        """A snapshot of the open calls."""
        return iter(list(self._calls.values()))


class Deadlines:
    """Ends the calls of ``table`` whose deadline passed, with ``expire(call)``
    on the scheduler's thread (which must not block: ``expire`` completes a
    future, handing its user callbacks on)."""

    def __init__(self, table: CallTable, scheduler: Any, expire: Callable[[Call], None]):
        self._table = table
        self._scheduler = scheduler
        self._expire = expire
        self._lock = threading.Lock()
        self._wake = math.inf  # when the one scheduler entry is due (inf: none)
        self._entry: Any = None  # its handle

    def watch(self, deadline: float) -> None:
        """A call was opened with the table's earliest ``deadline``: wake then."""
        if deadline < self._wake:
            with self._lock:
                if deadline < self._wake:
                    if self._entry is not None:
                        self._entry.cancel()
                    self._wake = deadline
                    self._entry = self._scheduler.call_at(deadline, self._due)

    def _due(self) -> None:
        with self._lock:
            # From here a watch() must schedule: the scan may miss its call.
            self._wake, self._entry = math.inf, None
        expired = self._table.expired(time.monotonic())
        self.watch(self._table.earliest())
        for call in expired:
            self._expire(call)
