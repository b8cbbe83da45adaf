"""Thread pools: threads that grow on demand and retire when idle.

``ElasticThreads`` grows a thread when none is free and retires idle ones;
on it, ``WorkerPool`` runs incoming requests (permits, requests run inline,
permits given back while a request waits for an RPC of its own).
``HandOnThreads`` runs ``futures``' user callbacks (handed off a transport
thread): one thread drains the queue, and another is added only when the
queue stops moving (see its doc).

This module imports nothing of rrpc: ``futures`` sits above it and asks it,
through ``this_thread``, whether the waiting thread runs a request or a
callback (see ``futures.blocking``; ``lending`` for a wait that is not for
an RPC: a reply's send that its caller holds up). The agent's module doc and
ARCHITECTURE.md say where the pools sit among rrpc's threads.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rrpc")


class _ThisThread(threading.local):
    # (before, after) a wait for an RPC (or a send, ``lending``), set while
    # a pool's thread runs a task: the worker pool gives a request's permit
    # back meanwhile; the callback pool hands its queue on to another thread.
    blocking_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None


this_thread = _ThisThread()


def lending(wait: Callable[..., Any], *args: Any) -> Any:
    """``wait(*args)``, a wait that may last as long as a peer chooses (a
    reply's send held up by its caller's flow control), with what the
    calling thread's task holds lent meanwhile, as for a wait for an RPC:
    a request's worker permit given back, a callback runner's queue handed
    on. Without it, a caller frozen while its reply was sent kept a permit
    until ``peer_timeout`` ended its stream; with ``num_worker_threads=1``
    every other peer's calls waited that long."""
    hooks = this_thread.blocking_hooks
    if hooks is None:  # not a pool's task: nothing to lend
        return wait(*args)
    give_back, take_back = hooks
    give_back()
    try:
        return wait(*args)
    finally:
        take_back()


class ElasticThreads:
    """Threads that take tasks from one queue and run each with ``run(task)``.

    ``core`` threads live until ``stop``. ``put_or_grow(task)`` starts one
    more whenever no thread is free for the task, so a task that waits for
    another task's work cannot deadlock the pool; such extra threads end after
    ``idle_exit`` seconds without a task. ``put(task)`` is the bare queue put
    (no Python frame: the worker pool's per-request path), for an owner that
    bounds its own concurrency.

    Accounting, under ``_lock``: ``_waiting`` threads wait for a task (or are
    about to), and ``_promised`` tasks queued by a growing put are owed one of
    them; ``put_or_grow`` finds a thread free when ``_waiting > _promised``,
    and otherwise starts one. A thread that took a task pays a promise back
    if one is owed. Exact when every put grows; a non-growing put may make
    a growing one see a free thread that is about to take the other task
    (the worker pool, its one owner, checks again when a request blocks:
    ``grow_if_queued``).
    """

    def __init__(
        self,
        name: str,
        run: Callable[[Any], None],
        core: int = 0,
        idle_exit: float = 30.0,
    ):
        self._name = name
        self._run_task = run
        self._idle_exit = idle_exit
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.put = self._tasks.put
        self._lock = threading.Lock()
        self._waiting = 0
        self._promised = 0
        self._numbers = itertools.count()
        self._threads: set[threading.Thread] = set()
        with self._lock:
            threads = [self._new_thread(core=True) for _ in range(core)]
        for thread in threads:
            thread.start()

    def put_or_grow(self, task: Any) -> None:
        """Queue ``task``, and start a thread for it if none is free."""
        with self._lock:  # an extra thread may be about to end: see _loop
            self._tasks.put(task)
            if self._waiting > self._promised:
                self._promised += 1
                return
            thread = self._new_thread(core=False)
        thread.start()

    def grow_if_queued(self) -> None:
        """Start a thread if tasks are queued and no thread is free for them."""
        with self._lock:
            if self._waiting > self._promised or self._tasks.empty():
                return
            thread = self._new_thread(core=False)
        thread.start()

    def queued(self) -> int:
        """Tasks queued and not taken yet."""
        return self._tasks.qsize()

    def _new_thread(self, core: bool) -> threading.Thread:
        """With ``_lock`` held: one more thread, for the caller to start
        once the lock is released."""
        name = f"{self._name}-{next(self._numbers)}"
        thread = threading.Thread(target=self._loop, args=(core,), name=name, daemon=True)
        self._threads.add(thread)
        return thread

    def _loop(self, core: bool) -> None:
        timeout = None if core else self._idle_exit
        while True:
            with self._lock:
                self._waiting += 1
            try:
                task = self._tasks.get(timeout=timeout)
            except queue.Empty:
                with self._lock:
                    if self._tasks.empty():  # put_or_grow() puts under this lock
                        self._waiting -= 1
                        self._threads.discard(threading.current_thread())
                        return
                task = self._tasks.get()
            with self._lock:
                self._waiting -= 1
                if self._promised:
                    self._promised -= 1
            if task is None:
                return
            self._run_task(task)
            # Drop the task now, not when the next one arrives: a request may
            # hold a peer's shared-memory slot, freed with its last tensor.
            del task

    def stop(self, timeout: float) -> None:
        """End every thread once the tasks queued before are done; wait up to
        ``timeout`` seconds for them (not for the calling thread)."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class HandOnThreads:
    """Threads that run tasks from one queue, few at a time: the callback pool.

    Waking a thread costs tens of microseconds on a small VM, and a thread per
    task would pay it per reply: 64 calls in flight kept ~70 callback threads
    busy waking each other. So one thread (a *runner*) drains the queue and
    takes the next task without sleeping; a put wakes a thread only when no
    runner is at work. Tasks are user code and may block on anything, even on
    a task queued behind them, so the queue must not wait for a blocked
    runner: another runner is added

    - at once, when a running task waits for an RPC (``futures.blocking``
      calls ``_blocked`` through ``this_thread.blocking_hooks``; while it
      waits, the task's thread does not count as a runner, so a put wakes
      another, as the completion its task waits for may be queued here), and
    - by the *watch* thread, when tasks are queued and none has started for
      ``grow_after`` seconds (a task blocked on a lock, an event, a sleep).
      That is two of the interpreter's GIL switch intervals (10 ms) by
      default: a runner that only waits for the GIL, behind a thread that
      keeps it (a caller issuing calls in a loop), gets it within one, and
      is not blocked. The watch looks every ``grow_after`` while tasks are
      queued behind busy runners, and ``LINGER`` looks more after they
      were not, then sleeps: under a steady stream of replies a put finds it
      looking already and wakes nobody.

    Runners that find the queue empty park (each on its own lock, so that a
    put wakes exactly one, the one idle the shortest) and end after
    ``idle_exit`` seconds parked. Tasks start in the order they were put.

    State, under ``_lock``: ``_tasks``; ``_runners`` (threads draining the
    queue, running a task or about to take one); ``_parked`` (locks of idle
    threads, held until the thread is woken); ``_started`` (tasks taken, the
    watch's measure of progress); ``_watching`` (the watch looks).
    """

    LINGER = 10  # looks at an empty queue before the watch sleeps

    def __init__(
        self,
        name: str,
        run: Callable[[Any], None],
        grow_after: float | None = None,
        idle_exit: float = 30.0,
    ):
        self._name = name
        self._run_task = run
        self._grow_after = 2 * sys.getswitchinterval() if grow_after is None else grow_after
        self._idle_exit = idle_exit
        self._lock = threading.Lock()
        self._watch = threading.Condition(self._lock)
        self._tasks: collections.deque = collections.deque()
        self._runners = 0
        self._parked: list[threading.Lock] = []
        self._started = 0
        self._watching = False
        self._watcher: threading.Thread | None = None
        self._stopped = False
        self._numbers = itertools.count()
        self._threads: set[threading.Thread] = set()
        self._hooks = (self._blocked, self._unblocked)

    def put_or_grow(self, task: Any) -> None:
        """Queue ``task``; wake or start a runner if none is at work."""
        with self._lock:
            self._tasks.append(task)
            if self._runners == 0:
                thread = self._add_runner()
            elif not self._watching:
                thread = self._start_watching()
            else:
                return
        if thread is not None:
            thread.start()

    def _blocked(self) -> None:
        """The calling runner waits for an RPC: it stops counting as one (a
        put then wakes another), and another takes the queue on now."""
        with self._lock:
            self._runners -= 1
            thread = self._add_runner() if self._tasks else None
        if thread is not None:
            thread.start()

    def _unblocked(self) -> None:
        """The wait is over: a runner again, until its task is done."""
        with self._lock:
            self._runners += 1

    def _add_runner(self) -> threading.Thread | None:
        """With ``_lock`` held: wake the parked thread idle the shortest, or
        make a new one (returned, for the caller to start once it released
        the lock)."""
        self._runners += 1
        if self._parked:
            self._parked.pop().release()
            return None
        return self._new_thread(self._loop)

    def _start_watching(self) -> threading.Thread | None:
        """With ``_lock`` held: tasks wait behind busy runners; the watch looks."""
        self._watching = True
        if self._watcher is None:
            self._watcher = self._new_thread(self._watch_queue, "watch")
            return self._watcher
        self._watch.notify()
        return None

    def _new_thread(self, target: Callable[[], None], suffix: str = "") -> threading.Thread:
        name = f"{self._name}-{suffix or next(self._numbers)}"
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.add(thread)
        return thread

    def _loop(self) -> None:
        this_thread.blocking_hooks = self._hooks
        while True:
            with self._lock:
                if self._tasks:
                    task = self._tasks.popleft()
                    self._started += 1
                else:
                    self._runners -= 1
                    if self._stopped:
                        self._threads.discard(threading.current_thread())
                        return
                    parked = threading.Lock()
                    parked.acquire()
                    self._parked.append(parked)
                    task = None
            if task is None:
                if not parked.acquire(timeout=self._idle_exit):
                    with self._lock:
                        if parked in self._parked:  # not woken meanwhile: end
                            self._parked.remove(parked)
                            self._threads.discard(threading.current_thread())
                            return
                continue  # woken: ``_add_runner`` counted this thread a runner again
            self._run_task(task)
            # Drop the task now, not when the next one arrives: a callback may
            # hold a peer's shared-memory slot, freed with its last tensor.
            del task

    def _watch_queue(self) -> None:
        idle_looks = 0  # looks in a row that found nothing queued
        with self._lock:
            while not self._stopped:
                if not self._watching:
                    self._watch.wait()
                    continue
                seen, queued = self._started, bool(self._tasks)
                self._watch.wait(self._grow_after)
                if not self._tasks:
                    idle_looks += 1
                    if idle_looks > self.LINGER:
                        self._watching, idle_looks = False, 0
                    continue
                idle_looks = 0
                # Queued for a whole look, and nothing started meanwhile.
                if queued and self._started == seen and not self._stopped:
                    thread = self._add_runner()  # the queue stood still: a runner is blocked
                    if thread is not None:
                        thread.start()  # under the lock: the new thread needs it only later
            self._threads.discard(threading.current_thread())

    def stop(self, timeout: float) -> None:
        """End every thread once the tasks queued before are done; wait up to
        ``timeout`` seconds for them (not for the calling thread)."""
        with self._lock:
            self._stopped = True
            threads = list(self._threads)
            for parked in self._parked:
                parked.release()
            self._runners += len(self._parked)
            self._parked.clear()
            self._watch.notify_all()
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class WorkerPool:
    """Threads running incoming requests; a bare queue keeps submit cheap.

    At most ``size`` requests run at once, counting those a stream's reader
    runs itself (``run_inline``): a permit per running request, so that
    ``num_worker_threads=1`` still means one user function at a time, in the
    order the requests came.

    A request that blocks waiting for an RPC of its own (``rpc_sync``, a
    Future's ``wait``) gives its permit back while it waits
    (``futures.blocking`` calls ``this_thread.blocking_hooks``), and a thread
    is added if none is free: a chain of nested calls deeper than ``size``
    completes instead of deadlocking. So does one whose reply's send waits
    for a caller that does not read (``lending``). Such extra threads end
    after ``_EXTRA_IDLE`` seconds without work."""

    _EXTRA_IDLE = 5.0

    def __init__(self, size: int, name: str):
        self._permits: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(size):
            self._permits.put(True)
        # Submitted and started tasks (itertools counts: atomic under the GIL);
        # while they differ, a task is on its way and nothing may overtake it.
        self._submits, self._starts = itertools.count(1), itertools.count(1)
        self._submitted = self._started = 0
        self._blocked = 0  # requests waiting for an RPC, their permit given back
        self._blocked_lock = threading.Lock()
        self._hooks = (self._release_while_blocked, self._take_back)
        self._threads = ElasticThreads(name, self._start_task, size, self._EXTRA_IDLE)
        self._put = self._threads.put

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._submitted = next(self._submits)
        if not self._blocked:  # ``size`` threads suffice for ``size`` permits
            self._put((fn, args))
            return
        # A request waiting for an RPC gave its permit back: a thread may be missing.
        self._threads.put_or_grow((fn, args))

    def queued(self) -> int:
        """Tasks submitted and not started yet."""
        return self._threads.queued()

    def run_inline(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` on this thread if a permit is free and no task
        submitted earlier is still to start; False (nothing run) otherwise."""
        if self._submitted != self._started:
            return False
        try:
            permit = self._permits.get_nowait()
        except queue.Empty:
            return False
        self._execute(permit, fn, args)
        return True

    def _start_task(self, task: tuple[Callable[..., None], tuple]) -> None:
        fn, args = task
        permit = self._permits.get()
        self._started = next(self._starts)
        self._execute(permit, fn, args)

    def _execute(self, permit: Any, fn: Callable[..., None], args: tuple) -> None:
        previous, this_thread.blocking_hooks = this_thread.blocking_hooks, self._hooks
        try:
            fn(*args)
        except BaseException:
            log.exception("rrpc: a request handler failed outside its own error handling")
        finally:
            this_thread.blocking_hooks = previous
            self._permits.put(permit)

    def _release_while_blocked(self) -> None:
        self._permits.put(True)
        with self._blocked_lock:
            self._blocked += 1
        self._threads.grow_if_queued()

    def _take_back(self) -> None:
        with self._blocked_lock:
            self._blocked -= 1
        self._permits.get()

    def stop(self, timeout: float) -> None:
        self._threads.stop(timeout)
