"""The call table and its deadline watch alone: no processes, no threads, no
sockets (rrpc/calls.py); the scheduler is a list the test runs by hand."""

from __future__ import annotations

import math

import pytest

from rrpc.calls import CallTable, Deadlines
from rrpc.messages import WorkerInfo

pytestmark = pytest.mark.timeout(10)

PEER = WorkerInfo("worker1", 1)
OTHER = WorkerInfo("worker2", 2)


def _open(table: CallTable, request_id: int, timeout: float, now: float = 100.0, **kw):
    kw.setdefault("stream", "stream-a")
    kw.setdefault("peer", PEER)
    return table.open(
        request_id, f"future{request_id}", what="call of f", timeout=timeout, now=now, **kw
    )


def test_a_reply_settles_its_call_once():
    table = CallTable()
    _open(table, 1, 5.0)
    call = table.settle(1)
    assert call is not None and call.future == "future1" and call.peer == PEER
    assert table.settle(1) is None  # a duplicate or late reply finds nothing
    assert len(table) == 0


def test_open_says_when_the_deadline_watcher_must_wake():
    table = CallTable()
    assert _open(table, 1, 10.0) is True  # the first deadline
    assert _open(table, 2, 10.0, now=101.0) is False  # later than the earliest
    assert _open(table, 3, 1.0, now=101.0) is True  # earlier: wake
    assert _open(table, 4, 0) is False  # no deadline at all
    assert table.earliest() == 102.0


def test_expired_takes_exactly_the_calls_past_their_deadline():
    table = CallTable()
    _open(table, 1, 1.0)  # deadline 101
    _open(table, 2, 5.0)  # deadline 105
    _open(table, 3, 0)  # never
    _open(table, 4, 2.0)  # deadline 102
    assert table.expired(100.5) == []
    ended = table.expired(102.0)
    assert [call.request_id for call in ended] == [1, 4]
    assert table.earliest() == 105.0  # recomputed from what remains
    assert ended[0].timeout == 1.0
    assert table.settle(1) is None  # its reply, arriving late, is dropped
    assert sorted(call.request_id for call in table) == [2, 3]


def test_a_settled_call_never_expires():
    table = CallTable()
    _open(table, 1, 1.0)
    assert table.settle(1) is not None
    assert table.expired(1000.0) == []
    assert table.earliest() == math.inf


def test_a_broken_stream_ends_only_its_own_calls():
    table = CallTable()
    _open(table, 1, 5.0, stream="old")
    _open(table, 2, 5.0, stream="new")  # the same peer, reconnected
    _open(table, 3, 5.0, stream="old", peer=OTHER)
    ended = table.broken("old")
    assert sorted(call.request_id for call in ended) == [1, 3]
    assert table.broken("old") == []
    assert [call.request_id for call in table] == [2]


def test_close_all_ends_every_call_once():
    table = CallTable()
    for request_id in range(5):
        _open(table, request_id, 1.0)
    assert len(table.close_all()) == 5
    assert table.close_all() == [] and table.expired(math.inf) == []


def test_each_call_ends_exactly_once_whatever_ends_it_first():
    table = CallTable()
    for request_id in range(100):
        _open(table, request_id, 1.0 + request_id % 3, stream=request_id % 2)
    ended = []
    ended += [call.request_id for call in table.expired(101.5)]
    ended += [call.request_id for call in table.broken(0)]
    ended += [request_id for request_id in range(0, 100, 5) if table.settle(request_id)]
    ended += [call.request_id for call in table.close_all()]
    assert sorted(ended) == list(range(100))


def test_a_call_opened_while_expired_scans_is_reported_as_earliest():
    table = CallTable()
    _open(table, 1, 1.0)  # deadline 101: the scan below ends it

    class OpenDuringScan(dict):
        def items(self):
            snapshot = list(super().items())
            # Another thread opens a call after the scan took its snapshot:
            # the watcher must hear of it, the scan will not see it.
            opened.append(_open(table, 2, 50.0, now=101.0))
            return snapshot

    opened: list[bool] = []
    table._calls = OpenDuringScan(table._calls)
    assert [call.request_id for call in table.expired(101.0)] == [1]
    assert opened == [True]


class _ManualScheduler:
    """Entries the test runs itself: (when, fn, args, handle)."""

    def __init__(self):
        self.entries = []

    def call_at(self, when, fn, *args):
        handle = _Handle()
        self.entries.append((when, fn, args, handle))
        return handle

    def live(self):
        return [when for when, _, _, handle in self.entries if not handle.cancelled]

    def run_due(self, now):
        due = [e for e in self.entries if e[0] <= now and not e[3].cancelled]
        self.entries = [e for e in self.entries if e not in due]
        for _, fn, args, _ in due:
            fn(*args)


class _Handle:
    cancelled = False

    def cancel(self):
        self.cancelled = True


def test_deadlines_keep_one_entry_at_the_earliest_deadline(monkeypatch):
    table, scheduler, expired = CallTable(), _ManualScheduler(), []
    deadlines = Deadlines(table, scheduler, expired.append)
    for request_id, timeout in [(1, 10.0), (2, 10.0), (3, 1.0), (4, 5.0)]:
        if _open(table, request_id, timeout):
            deadlines.watch(100.0 + timeout)
    assert scheduler.live() == [101.0]  # moved once, to the earlier deadline

    monkeypatch.setattr("rrpc.calls.time.monotonic", lambda: 101.0)
    scheduler.run_due(101.0)
    assert [call.request_id for call in expired] == [3]
    assert scheduler.live() == [105.0]  # the next earliest of what remains

    monkeypatch.setattr("rrpc.calls.time.monotonic", lambda: 110.0)
    scheduler.run_due(110.0)
    assert [call.request_id for call in expired] == [3, 1, 2, 4]  # in id order
    assert scheduler.live() == [] and len(table) == 0
