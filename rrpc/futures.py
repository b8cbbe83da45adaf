"""The futures rrpc hands to users, and where their callbacks run.

Rule: user code never runs on a thread the transport needs to make progress.
A torch Future runs its callbacks on whichever thread completes it; rrpc
completes futures on a stream's receive thread (a reply), the scheduler's
thread (a timeout) or a stream's close (a dead peer). A user callback that made an
RPC there (``rpc_async(...).then(lambda f: rpc_sync(...))``) would wait for a
reply that only that very thread could read: a deadlock.

So every future rrpc returns is a ``Future`` (a ``torch.futures.Future``)
whose ``then`` and ``add_done_callback`` wrap the user's callback: run on a
transport thread, the callback is handed to ``callbacks``, a pool
(``pool.HandOnThreads``) where one thread runs the queued callbacks one
after another and another takes the queue on when a callback waits for an
RPC or the queue stands still (a callback may block on anything, even on
another callback); run elsewhere
(the future was already done, or a user thread completed it), it runs right
there, as in torch. Transport threads say so with
``messages.mark_transport_thread()``. A future with user callbacks is also
completed off the transport thread as a whole (``settle``), so that its
callbacks keep torch's order: registration order, one after another.
``torch.futures.collect_all`` combines futures in C++, out of reach of these
wrappers: over rrpc's futures it is ``collect_all`` below (``init_rpc``
installs it), whose callbacks run off the transport too.

Internal callbacks (the RRef and autograd protocols) are registered on the
torch base class's methods and run where the future completes: they never
block.

Every wait and every combination of futures in rrpc goes through this module:

- ``SyncReply``: what ``rpc_sync`` (and the RRef protocol's synchronous
  calls) wait on: a bare lock, a fraction of a torch Future's cost, never
  seen by user code.
- ``wait_until(future, timeout)``: wait without raising (True once done).
  Through ``blocking``: a request that waits gives its worker permit back,
  and a callback that waits hands the callback queue on to another thread
  (the pools say what the waiting thread runs: ``pool.this_thread``).
- ``all_of`` (fails at the first failure, as soon as it happens),
  ``all_settled`` (never fails: done when all are) and ``values_of`` (every
  value, or the first error once all are done): combinations, built with
  internal callbacks, so they cost no thread.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from rrpc import pool
from rrpc.messages import thread_state

# lane.py imports it from here; it lives in messages.py (below the carriers).

log = logging.getLogger("rrpc")

_IDLE_EXIT = 30.0  # seconds an idle callback thread waits before it ends


def blocking(wait: Callable[..., Any], *args: Any) -> Any:
    """``wait(*args)``, a wait for an RPC's reply. On a thread that runs a
    request, the request's worker permit is given back meanwhile, so that
    nested calls deeper than ``num_worker_threads`` cannot deadlock; on a
    callback thread, another thread takes the queued callbacks on."""
    hand_off = thread_state.hand_off  # set while a stream's reader runs the request
    if hand_off is not None:
        hand_off()
    return pool.lending(wait, *args)  # what the pools' task holds, lent meanwhile


def _run_callback(task: tuple[Callable[..., Any], tuple]) -> None:
    fn, args = task
    try:
        fn(*args)
    except BaseException:
        log.exception("rrpc: a future's callback raised")


# Threads for user callbacks handed off a transport thread: one drains the
# queue, another is added when a callback waits for an RPC or the queue stands
# still for 10 ms (a callback may block on another callback's work); each ends
# after _IDLE_EXIT s idle. Process-wide: no thread until a callback needs one.
callbacks = pool.HandOnThreads("rrpc-callback", _run_callback, idle_exit=_IDLE_EXIT)


def _off_transport(callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def run(future: Any) -> None:
        if thread_state.transport:
            callbacks.put_or_grow((callback, (future,)))
        else:
            callback(future)

    return run


# Guards every Future's list of callbacks waiting for it (short sections, no call out).
_pending_lock = threading.Lock()


def _run_logged(run: Callable[[Any], None], future: Any) -> None:
    """One callback of a future: one that raises is logged, as torch does,
    and neither stops the others nor reaches the thread completing it."""
    try:
        run(future)
    except Exception:
        log.exception("rrpc: a future's callback raised")


class Future(torch.futures.Future):
    """A ``torch.futures.Future`` whose callbacks never run on rrpc's transport threads.

    Its outcome and its user callbacks are also kept here, in Python: each of
    torch's ``add_done_callback``, ``then``, ``value`` and ``wait`` lets go of
    the GIL, and with another thread of the process running Python, getting
    it back costs up to the interpreter's switch interval (5 ms; measured
    here: 0.5-2.6 ms a call, against ~1 us alone). rrpc completes its
    futures through ``set_result``/``set_exception`` below, which complete
    the torch future (its C++ callbacks, and every waiter, as before) and
    then run the callbacks registered here, in their order."""

    _has_user_callbacks = False
    _outcome: tuple[Any, BaseException | None] | None = None  # once completed here
    _pending: list[Callable[[Any], None]] | None = None  # callbacks waiting for the outcome

    _failing = False  # torch's set_exception sets the error through set_result

    def set_result(self, value: Any) -> None:
        if self._failing:
            super().set_result(value)
        else:
            self._complete((value, None), super().set_result, value)

    def set_exception(self, error: BaseException) -> None:
        self._complete((None, error), self._set_error, error)

    def _set_error(self, error: BaseException) -> None:
        self._failing = True
        try:
            super().set_exception(error)
        finally:
            self._failing = False

    def done(self) -> bool:
        return self._outcome is not None or super().done()

    def _complete(
        self, outcome: tuple[Any, BaseException | None], complete: Callable[[Any], None], arg: Any
    ) -> None:
        """Keep the outcome, complete the torch future (``complete(arg)``:
        its waiters wake), then run the callbacks registered before. The
        outcome is kept first: a waiter that woke and adds a callback finds
        the future done and runs it at once, as torch runs one added to a
        completed future."""
        with _pending_lock:
            if self._outcome is not None:
                pending = None  # completed already: torch raises
            else:
                self._outcome = outcome
                pending, self._pending = self._pending, None
        try:
            complete(arg)
        except BaseException:
            if pending is not None or self._outcome is outcome:
                with _pending_lock:  # refused (completed by other means): as it was
                    self._outcome, self._pending = None, pending
            raise
        for run in pending or ():
            _run_logged(run, self)

    def _when_done(self, run: Callable[[Any], None], user: bool = True) -> None:
        """``run(self)`` once the outcome is here: now if it is. ``user``: a
        user's callback (``settle`` then completes the future off the
        transport, so that it runs in order with the others, as in torch)."""
        if user:
            self._has_user_callbacks = True
        with _pending_lock:
            if self._outcome is None:
                if self._pending is None:
                    self._pending = []
                self._pending.append(run)
                return
        _run_logged(run, self)

    def then(self, callback: Callable[[Any], Any]) -> Future:
        if not callable(callback):
            raise TypeError(
                f"then(): incompatible function arguments: the callback must be callable, "
                f"not {callback!r}"
            )
        child = Future()

        def chain(parent: Any) -> None:
            try:
                result = callback(parent)
            except BaseException as exc:
                # As torch: a RuntimeError that names the callback's error. Its
                # traceback goes as text: frames kept by the child would hold it.
                error = f"{type(exc).__name__}: {exc}"
                where = "".join(traceback.format_tb(exc.__traceback__))
                del exc
                child.set_exception(
                    RuntimeError(
                        f"Got the following error when running the callback: {error}\n\n"
                        f"At:\n{where}"
                    )
                )
                return
            child.set_result(result)

        self._when_done(_off_transport(chain))
        return child

    def wait(self) -> Any:
        return self._read(torch.futures.Future.wait)

    def value(self) -> Any:
        return self._read(torch.futures.Future.value)

    def _read(self, read: Callable[[Any], Any]) -> Any:
        """The value, or raise a copy of the error. torch raises the error it
        keeps, whose traceback then holds the reader's frames, which hold this
        future, which holds the error from C++, where the garbage collector
        cannot see the cycle: every frame of the raising stack (and any RRef in
        them) would stay alive for good."""
        outcome = self._outcome
        if outcome is not None:
            if outcome[1] is None:
                return outcome[0]
            error = copy_error(outcome[1])
        else:
            try:
                return read(self) if self.done() else blocking(read, self)
            except BaseException as kept:
                kept.__traceback__ = None
                error = copy_error(kept)
        del self  # not in the frame the raise below puts into the traceback
        try:
            raise error
        finally:
            del error

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        def logged(future: Any) -> None:
            try:
                callback(future)
            except Exception:
                log.exception("rrpc: a done-callback raised")

        self._when_done(_off_transport(logged))


def copy_error(error: BaseException) -> BaseException:
    """A fresh copy to raise, so that the kept one never gets a traceback."""
    kind = type(error)
    try:
        clone = copy.copy(error)  # rebuilds from args: keeps C fields (OSError.errno)
    except Exception:
        try:  # an __init__ that does not take its own args back
            clone = kind.__new__(kind)
            clone.args = error.args
            clone.__dict__.update(error.__dict__)
        except Exception:
            return error
    notes = error.__dict__.get("__notes__")
    if notes is not None:
        clone.__dict__["__notes__"] = list(notes)  # add_note on the copy must not reach the kept
    clone.__cause__ = error.__cause__
    return clone


def settle(future: Any, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` with ``value`` or ``error``, running its user
    callbacks off the transport (see the module doc)."""
    if thread_state.transport and getattr(future, "_has_user_callbacks", False):
        callbacks.put_or_grow((_set, (future, value, error)))
    else:
        _set(future, value, error)


def _set(future: Any, value: Any, error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def outcome(future: torch.futures.Future) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, error) of a done future, without raising: torch's
    raise puts the future into the error's traceback, and the future holds the
    error from C++, a cycle the garbage collector cannot see (it would keep
    every frame of the raising stack alive)."""
    try:
        return future.value(), None
    except BaseException as exc:
        exc.__traceback__ = None  # the frames of torch's raise, which hold the future
        return None, exc


def on_done(future: torch._C.Future, callback: Callable[[Any], None]) -> None:
    """Register an rrpc-internal callback: it runs where ``future`` completes,
    possibly on a transport thread, so it must never block. On an rrpc
    ``Future``, in its own list (no GIL let go), in order with the others."""
    if isinstance(future, Future):
        future._when_done(callback, user=False)
    else:
        torch._C.Future.add_done_callback(future, callback)


class SyncReply:
    """The reply to a call whose caller blocks for it at once: a bare lock,
    released when the reply is in. Its error is raised as it was set, once,
    and the reply keeps neither value nor error afterwards."""

    __slots__ = ("_arrived", "_value", "_error", "lead")

    def __init__(self, lead: Callable[[Callable[[], bool], float], bool] | None = None) -> None:
        self._arrived = threading.Lock()
        self._arrived.acquire()
        self._value: Any = None
        self._error: BaseException | None = None
        # A lane's ``lead``: the waiting thread reads replies itself while
        # nobody else does, until its own is in (see lane.py).
        self.lead = lead

    def set_result(self, value: Any) -> None:
        self._value = value
        self._arrived.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._arrived.release()

    def done(self) -> bool:
        return not self._arrived.locked()

    def wait_done(self, timeout: float) -> bool:
        """True once the reply is in, False after ``timeout`` seconds (inf: none)."""
        if not self._arrived.acquire(blocking=False):
            if self.lead is not None:
                blocking(self.lead, self.done, time.monotonic() + timeout)
                if self._arrived.acquire(blocking=False):
                    self._arrived.release()
                    return True
            limit = -1 if timeout == math.inf else max(0.0, timeout)
            if not blocking(self._arrived.acquire, True, limit):
                return False
        self._arrived.release()
        return True

    def wait(self) -> Any:
        """The value, or raise the error (the reply holds on to neither)."""
        self.wait_done(math.inf)
        value, error, self._value, self._error = self._value, self._error, None, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # no cycle between this frame and the error's traceback
        return value


def wait_until(future: Any, timeout: float) -> bool:
    """Wait for ``future`` (a torch Future or a ``SyncReply``) to be done, at most
    ``timeout`` seconds (``math.inf``: no limit); True if it is. Never raises
    the future's error."""
    if isinstance(future, SyncReply):
        return future.wait_done(timeout)
    if future.done():
        return True
    event = threading.Event()
    on_done(future, lambda _: event.set())
    return bool(blocking(event.wait, None if timeout == math.inf else max(0.0, timeout)))


def all_of(futures: list[torch.futures.Future]) -> torch.futures.Future:
    """A future done when all are, failing with the first failure as soon as it happens."""
    return _combine(futures, fail_fast=True)


def all_settled(
    futures: list[torch.futures.Future], on_error: Callable[[BaseException], None] | None = None
) -> torch.futures.Future:
    """A future that never fails, done when all ``futures`` are; each failure
    goes to ``on_error`` (best-effort work: releases, deletes)."""
    return _combine(futures, fail_fast=False, on_error=on_error)


def _combine(
    futures: list[torch.futures.Future],
    fail_fast: bool,
    on_error: Callable[[BaseException], None] | None = None,
) -> torch.futures.Future:
    """Done (with None) when every future is; with ``fail_fast``, failed by the
    first failure as soon as it happens. Exactly one completion: which one is
    decided under the lock, so a failure and the last success racing on two
    threads cannot both complete it."""
    combined = Future()
    lock = threading.Lock()
    remaining = [len(futures)]
    decided = [False]

    def done(future: torch.futures.Future) -> None:
        error = None
        try:
            future.wait()
        except BaseException as exc:
            error = exc
            if on_error is not None:
                on_error(exc)
        with lock:
            remaining[0] -= 1
            if decided[0] or not ((fail_fast and error is not None) or remaining[0] == 0):
                return
            decided[0] = True
        if fail_fast and error is not None:
            combined.set_exception(error)
        else:
            combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for future in futures:
        on_done(future, done)
    return combined


def values_of(futures: list[torch.futures.Future]) -> list[Any]:
    """Every future's value, waiting for all; raises the first error once all are done."""
    results, error = [], None
    for future in futures:
        try:
            results.append(future.wait())
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    return results


# -- torch.futures.collect_all over rrpc's futures ----------------------------------
_torch_collect_all = torch.futures.collect_all


def collect_all(futures: list[torch.futures.Future]) -> torch.futures.Future:
    """``torch.futures.collect_all``, put in its place by ``install_collect_all``.

    torch's combines the futures in C++ and completes the combination where
    the last of them completes: for rrpc's, on the thread that read the last
    reply, where a ``then`` callback of the combination would run, and wait
    for ever if it made an RPC to the same peer (its reply is that thread's to
    read). A list holding an rrpc ``Future`` gets an rrpc ``Future`` instead,
    whose callbacks run off the transport; as torch's, it is done when all
    are, with the list of futures, or with the first error met."""
    futures = list(futures)
    if not any(isinstance(future, Future) for future in futures):
        return _torch_collect_all(futures)
    combined = Future()
    lock = threading.Lock()
    remaining, first_error = [len(futures)], list[BaseException | None]([None])

    def done(future: torch.futures.Future) -> None:
        error = outcome(future)[1]
        with lock:
            if error is not None and first_error[0] is None:
                first_error[0] = error
            remaining[0] -= 1
            if remaining[0]:
                return
        settle(combined, futures if first_error[0] is None else None, first_error[0])

    for future in futures:
        on_done(future, done)
    return combined


def install_collect_all() -> None:
    """Make ``torch.futures.collect_all`` the one above (process-wide, once;
    for any other list it is torch's own). Code that imported the name
    before keeps torch's."""
    torch.futures.collect_all = collect_all
