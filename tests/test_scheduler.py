"""The scheduler (rrpc/scheduler.py), without processes: callbacks run at
their time, in order, on one transport thread; cancel and stop hold."""

import threading
import time

import pytest

from rrpc import messages, scheduler
from rrpc.scheduler import Scheduler

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def sched():
    s = Scheduler()
    yield s
    s.stop()


def _recorder():
    ran: list = []
    done = threading.Event()

    def record(*args):
        ran.append((args, threading.current_thread().name, messages.thread_state.transport))
        done.set()

    return ran, done, record


def test_callback_runs_after_its_delay_on_the_scheduler_thread_marked_transport(sched):
    ran, done, record = _recorder()
    start = time.monotonic()
    sched.call_later(0.05, record, "a", 1)
    assert done.wait(10)
    assert time.monotonic() - start >= 0.05
    assert ran == [(("a", 1), "rrpc-scheduler", True)]


def test_callbacks_run_in_time_order_then_in_scheduling_order(sched):
    order = []
    finished = threading.Event()
    when = time.monotonic() + 0.01
    sched.call_at(when + 0.002, order.append, "late")
    sched.call_at(when, order.append, "first")
    sched.call_at(when, order.append, "second")
    sched.call_at(when - 1, order.append, "overdue")
    sched.call_at(when + 0.003, finished.set)
    assert finished.wait(10)
    assert order == ["overdue", "first", "second", "late"]


def test_an_earlier_entry_wakes_a_thread_sleeping_until_a_later_one(sched):
    ran, done, record = _recorder()
    sched.call_later(3600, record, "an hour")
    sched.call_later(0, record, "now")
    assert done.wait(10)
    assert [args for args, _, _ in ran] == [("now",)]


def test_cancelled_callback_never_runs_and_drops_its_arguments(sched):
    ran, done, record = _recorder()
    big = object()
    handle = sched.call_later(0.05, record, big)
    handle.cancel()
    assert handle.cancelled()
    assert handle._call is None  # holds nothing alive until its time
    sched.call_later(0.1, record, "after")
    assert done.wait(10)
    assert [args for args, _, _ in ran] == [("after",)]
    handle.cancel()  # twice: nothing happens
    assert sched.pending() == 0


def test_a_raising_callback_is_logged_and_the_next_one_runs(sched, caplog):
    ran, done, record = _recorder()
    sched.call_later(0, lambda: 1 / 0)
    sched.call_later(0.01, record, "next")
    assert done.wait(10)
    assert "a scheduled callback raised" in caplog.text
    assert [args for args, _, _ in ran] == [("next",)]


def test_many_cancelled_entries_are_compacted_away(sched):
    handles = [sched.call_later(3600, print) for _ in range(2 * scheduler._COMPACT_MIN)]
    for handle in handles:
        handle.cancel()
    assert sched.pending() == 0
    assert len(sched._heap) < scheduler._COMPACT_MIN


def test_stop_drops_waiting_entries_and_later_ones_never_run():
    sched = Scheduler()
    ran, _, record = _recorder()
    waiting = sched.call_later(3600, record, "waiting")
    sched.stop()
    late = sched.call_later(0, record, "after stop")
    assert waiting.cancelled() and late.cancelled()
    assert not sched._thread.is_alive()
    assert ran == []


def test_stop_from_a_callback_does_not_wait_for_itself():
    sched = Scheduler()
    stopped = threading.Event()

    def stop_here():
        sched.stop()
        stopped.set()

    sched.call_later(0, stop_here)
    assert stopped.wait(10)
    sched._thread.join(10)
    assert not sched._thread.is_alive()


def test_callback_may_schedule_another(sched):
    ran, done, record = _recorder()
    sched.call_later(0, lambda: sched.call_later(0.01, record, "chained"))
    assert done.wait(10)
    assert [args for args, _, _ in ran] == [("chained",)]
