"""rrpc/pool.py without processes: elastic threads grow for waiting work and
retire when idle; the worker pool bounds running requests by its permits,
which a request gives back while it waits for an RPC; the callback pool runs
a burst on one thread and hands its queue on when a task blocks."""

import threading

import pytest

from rrpc import futures
from rrpc.pool import ElasticThreads, HandOnThreads, WorkerPool, lending

pytestmark = pytest.mark.timeout(30)

WAIT = 10.0


def _run(task):
    fn, args = task
    fn(*args)


def test_a_task_waiting_for_another_tasks_work_gets_a_thread_of_its_own():
    threads = ElasticThreads("rrpc-test-elastic", _run)
    produced, consumed = threading.Event(), threading.Event()
    threads.put_or_grow((lambda: consumed.set() if produced.wait(WAIT) else None, ()))
    threads.put_or_grow((produced.set, ()))  # no thread is free: one is added
    assert consumed.wait(WAIT)
    threads.stop(WAIT)


def test_a_burst_of_growing_puts_starts_a_thread_per_task_none_being_free():
    threads = ElasticThreads("rrpc-test-elastic", _run)
    arrived = threading.Barrier(5, timeout=WAIT)  # passes only if all five run at once
    for _ in range(5):
        threads.put_or_grow((arrived.wait, ()))
    threads.stop(WAIT)
    assert not arrived.broken


def test_extra_threads_end_when_idle_and_core_threads_stay():
    threads = ElasticThreads("rrpc-test-elastic", _run, core=1, idle_exit=0.05)
    core = next(iter(threads._threads))
    gate = threading.Event()
    done = threading.Event()
    threads.put_or_grow((gate.wait, (WAIT,)))  # the core thread takes it
    threads.put_or_grow((done.set, ()))  # an extra thread runs this one
    assert done.wait(WAIT)
    extra = [thread for thread in list(threads._threads) if thread is not core]
    gate.set()
    for thread in extra:
        thread.join(WAIT)
        assert not thread.is_alive()
    assert core.is_alive() and threads._threads == {core}
    threads.stop(WAIT)
    core.join(WAIT)
    assert not core.is_alive()


def test_thread_names_are_the_pool_name_and_a_number():
    names = []
    ran = threading.Event()
    threads = ElasticThreads("rrpc-test-elastic", _run, core=2)
    threads.put((lambda: (names.append(threading.current_thread().name), ran.set()), ()))
    assert ran.wait(WAIT)
    threads.stop(WAIT)
    assert names[0] in {"rrpc-test-elastic-0", "rrpc-test-elastic-1"}


def test_worker_pool_runs_at_most_size_requests_at_once_inline_ones_counted():
    pool = WorkerPool(2, "rrpc-test-pool")
    both_running = threading.Barrier(3, timeout=WAIT)  # two requests and this test
    release = threading.Event()

    def request():
        both_running.wait()
        release.wait(WAIT)

    try:
        pool.submit(request)
        pool.submit(request)
        both_running.wait()
        # Both have started (nothing queued may be overtaken): only the permits refuse.
        assert pool.run_inline(print, "never") is False
    finally:
        release.set()
        pool.stop(WAIT)


def test_nested_waits_deeper_than_the_pool_complete_their_permit_given_back():
    pool = WorkerPool(1, "rrpc-test-pool")
    depth = 4
    finished = threading.Event()

    def request(level):
        if level == depth:
            finished.set()
            return
        inner = threading.Event()
        pool.submit(lambda: (request(level + 1), inner.set()))
        # As an rpc_sync inside a request: the wait gives the only permit back.
        assert futures.blocking(inner.wait, WAIT)

    try:
        pool.submit(request, 0)
        assert finished.wait(WAIT)
    finally:
        pool.stop(WAIT)


def test_a_request_whose_reply_waits_for_its_peer_lends_its_permit_meanwhile():
    pool = WorkerPool(1, "rrpc-test-pool")
    peer_reads, other_ran = threading.Event(), threading.Event()

    def request_with_a_reply_held_up():
        # As a reply's send that a caller that does not read holds up (outbox.Outbox).
        lending(peer_reads.wait, WAIT)

    try:
        pool.submit(request_with_a_reply_held_up)
        pool.submit(other_ran.set)
        assert other_ran.wait(WAIT)  # on the one permit, while the first one's send waits
        assert not peer_reads.is_set()
    finally:
        peer_reads.set()
        pool.stop(WAIT)
    assert lending(int, "7") == 7  # not a pool's task: nothing to lend, it just waits


def test_run_inline_refuses_while_a_submitted_request_has_not_started():
    pool = WorkerPool(1, "rrpc-test-pool")
    started, release = threading.Event(), threading.Event()
    ran = []
    try:
        pool.submit(lambda: (started.set(), release.wait(WAIT)))
        assert started.wait(WAIT)
        pool.submit(ran.append, "queued")  # waits for the permit
        assert pool.run_inline(ran.append, "inline") is False  # would overtake it
        release.set()
    finally:
        pool.stop(WAIT)
    assert ran == ["queued"]
    assert pool.run_inline(ran.append, "inline") is True  # nothing waits: it runs here
    assert ran == ["queued", "inline"]


# -- HandOnThreads: the callback pool -----------------------------------------------
NEVER = 3600.0  # a grow_after the watch never reaches within a test


def _names(threads):
    return sorted(thread.name for thread in threads._threads)


def test_a_burst_runs_on_one_thread_in_order_waking_nobody_else():
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=NEVER)
    gate, ran, done = threading.Event(), [], threading.Event()
    threads.put_or_grow((gate.wait, (WAIT,)))
    for i in range(50):  # queued behind the first task, its runner at work
        threads.put_or_grow((lambda i=i: ran.append((i, threading.current_thread().name)), ()))
    threads.put_or_grow((done.set, ()))
    gate.set()
    assert done.wait(WAIT)
    threads.stop(WAIT)
    assert [i for i, _ in ran] == list(range(50))
    assert {name for _, name in ran} == {"rrpc-test-handon-0"}  # one runner, no other thread
    assert threads._watcher is not None  # it looked, and found the queue moving


def test_a_task_blocked_on_a_task_queued_behind_it_gets_the_queue_taken_on_by_the_watch():
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=0.002)
    produced, consumed = threading.Event(), threading.Event()
    threads.put_or_grow((lambda: consumed.set() if produced.wait(WAIT) else None, ()))
    threads.put_or_grow((produced.set, ()))  # behind a runner blocked on a plain Event
    assert consumed.wait(WAIT)
    threads.stop(WAIT)


def test_a_task_waiting_for_an_rpc_hands_the_queue_on_at_once():
    # The watch never looks in time: only the blocking hook can save the queue.
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=NEVER)
    produced, consumed = threading.Event(), threading.Event()
    gate = threading.Event()

    def waits_for_an_rpc():
        gate.wait(WAIT)  # until the producer is queued behind it
        # As an rpc_sync inside a callback: futures.blocking calls the pool's hook.
        if futures.blocking(produced.wait, WAIT):
            consumed.set()

    threads.put_or_grow((waits_for_an_rpc, ()))
    threads.put_or_grow((produced.set, ()))
    gate.set()
    assert consumed.wait(WAIT)
    threads.stop(WAIT)


def test_with_nothing_queued_a_blocking_task_starts_no_thread():
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=NEVER)
    waited = threading.Event()
    threads.put_or_grow((lambda: waited.set() if futures.blocking(lambda: True) else None, ()))
    assert waited.wait(WAIT)
    # The runner, parked now, is the only thread it ever had (one that _blocked
    # started would be here too, parked: nothing ends before idle_exit).
    assert _names(threads) == ["rrpc-test-handon-0"]
    threads.stop(WAIT)
    assert _names(threads) == []


def test_idle_runners_end_after_idle_exit_and_a_later_put_starts_another():
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=NEVER, idle_exit=0.05)
    ran = []
    done = threading.Event()
    threads.put_or_grow((lambda: (ran.append(threading.current_thread()), done.set()), ()))
    assert done.wait(WAIT)
    first = ran[0]
    first.join(WAIT)  # parked, then ended after idle_exit with nothing to do
    assert not first.is_alive() and first not in threads._threads
    done.clear()
    threads.put_or_grow((lambda: (ran.append(threading.current_thread()), done.set()), ()))
    assert done.wait(WAIT)
    assert ran[1] is not first
    threads.stop(WAIT)
    ran[1].join(WAIT)
    assert not ran[1].is_alive()


def test_stop_ends_parked_runners_and_the_watch():
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=0.002)
    gate, done = threading.Event(), threading.Event()
    threads.put_or_grow((gate.wait, (WAIT,)))
    threads.put_or_grow((done.set, ()))  # queued: the watch starts, and adds a runner
    assert done.wait(WAIT)
    gate.set()
    started = list(threads._threads)
    assert any(thread.name == "rrpc-test-handon-watch" for thread in started)
    threads.stop(WAIT)
    for thread in started:
        thread.join(WAIT)
        assert not thread.is_alive()


def test_a_task_waiting_for_an_rpc_does_not_hold_back_a_task_put_while_it_waits():
    # Its completion may itself be a queued task (a then() chain's): a put made
    # while the only runner waits must wake another at once, not after the watch.
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=NEVER)
    waiting, produced, consumed = threading.Event(), threading.Event(), threading.Event()

    def waits_for_an_rpc():
        def wait():
            waiting.set()
            return produced.wait(WAIT)

        if futures.blocking(wait):
            consumed.set()

    threads.put_or_grow((waits_for_an_rpc, ()))
    assert waiting.wait(WAIT)  # blocked, with nothing queued behind it
    threads.put_or_grow((produced.set, ()))
    assert consumed.wait(WAIT)
    threads.stop(WAIT)


def test_the_watch_lingers_so_that_bursts_soon_after_each_other_wake_it_once():
    # Under a steady stream of replies the queue empties and fills again all
    # the time; each time the watch had gone to sleep, a put had to wake it.
    threads = HandOnThreads("rrpc-test-handon", _run, grow_after=0.001)
    starts, looks = [], threading.Semaphore(0)
    start_watching, wait = threads._start_watching, threads._watch.wait

    def counted_start():
        starts.append(1)
        return start_watching()

    def counted_wait(timeout=None):
        if timeout is not None:
            looks.release()  # one look at the queue
        return wait(timeout)

    threads._start_watching = counted_start
    threads._watch.wait = counted_wait
    for _ in range(2):
        gate, done = threading.Event(), threading.Event()
        threads.put_or_grow((gate.wait, (WAIT,)))
        threads.put_or_grow((done.set, ()))  # queued behind a busy runner: the watch looks
        gate.set()
        assert done.wait(WAIT)
        for _ in range(3):  # it looks on at an empty queue (LINGER looks)
            assert looks.acquire(timeout=WAIT)
    assert len(starts) == 1
    threads.stop(WAIT)
