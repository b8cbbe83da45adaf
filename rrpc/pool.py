"""The worker pool: the threads that run incoming requests (user functions
and protocol handlers) for the agent. See the class for its rules; the
agent's module doc and ARCHITECTURE.md for where it sits among rrpc's threads."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rrpc.futures import set_blocking_hooks

log = logging.getLogger("rrpc")


class WorkerPool:
    """Threads running incoming requests; a bare queue keeps submit cheap.

    At most ``size`` requests run at once, counting those a stream's reader
    runs itself (``run_inline``): a permit per running request, so that
    ``num_worker_threads=1`` still means one user function at a time, in the
    order the requests came.

    A request that blocks waiting for an RPC of its own (``rpc_sync``, a
    Future's ``wait``) gives its permit back while it waits
    (``futures.blocking``), and a thread is added if none is idle: a chain of
    nested calls deeper than ``size`` completes instead of deadlocking. Such
    extra threads end after ``_EXTRA_IDLE`` seconds without work."""

    _EXTRA_IDLE = 5.0

    def __init__(self, size: int, name: str):
        self._name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._permits: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(size):
            self._permits.put(True)
        # Submitted and started tasks (itertools counts: atomic under the GIL);
        # while they differ, a task is on its way and nothing may overtake it.
        self._submits, self._starts = itertools.count(1), itertools.count(1)
        self._submitted = self._started = 0
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task
        self._blocked = 0  # requests waiting for an RPC, their permit given back
        self._hooks = (self._release_while_blocked, self._take_back)
        self._threads = [self._start_thread(f"{name}-{i}", extra=False) for i in range(size)]

    def _start_thread(self, name: str, extra: bool) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(extra,), name=name, daemon=True)
        thread.start()
        return thread

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._submitted = next(self._submits)
        if not self._blocked:
            self._tasks.put((fn, args))
            return
        with self._lock:  # an extra thread may be about to end: see _run
            self._tasks.put((fn, args))
            if self._idle == 0:
                self._add_thread()

    def queued(self) -> int:
        """Tasks submitted and not started yet."""
        return self._tasks.qsize()

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

    def _run(self, extra: bool) -> None:
        timeout = self._EXTRA_IDLE if extra else None
        while True:
            with self._lock:
                self._idle += 1
            try:
                task = self._tasks.get(timeout=timeout)
            except queue.Empty:
                with self._lock:
                    if self._tasks.empty():  # submit() puts under this lock meanwhile
                        self._idle -= 1
                        return
                task = self._tasks.get()
            with self._lock:
                self._idle -= 1
            if task is None:
                return
            fn, args = task
            permit = self._permits.get()
            self._started = next(self._starts)
            self._execute(permit, fn, args)
            # Drop the request now, not when the next one arrives: it may hold
            # a peer's shared-memory slot, which is freed with its last tensor.
            del task, fn, args

    def _execute(self, permit: Any, fn: Callable[..., None], args: tuple) -> None:
        previous = set_blocking_hooks(self._hooks)
        try:
            fn(*args)
        except BaseException:
            log.exception("rrpc: a request handler failed outside its own error handling")
        finally:
            set_blocking_hooks(previous)
            self._permits.put(permit)

    def _add_thread(self) -> None:
        """With ``_lock`` held: one more thread, counted idle from now on."""
        self._idle += 1  # so that a burst of submits starts one thread, not many
        thread = self._start_thread(f"{self._name}-extra", extra=True)
        self._threads.append(thread)
        self._idle -= 1  # the thread counts itself in _run

    def _release_while_blocked(self) -> None:
        self._permits.put(True)
        with self._lock:
            self._blocked += 1
            if self._idle == 0 and not self._tasks.empty():
                self._add_thread()

    def _take_back(self) -> None:
        with self._lock:
            self._blocked -= 1
        self._permits.get()

    def stop(self, timeout: float) -> None:
        threads = list(self._threads)
        for _ in threads:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
