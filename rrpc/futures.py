"""The futures rrpc hands to users, and where their callbacks run.

Rule: user code never runs on a thread the transport needs to make progress.
A torch Future runs its callbacks on whichever thread completes it; rrpc
completes futures on a stream's receive thread (a reply), the deadline thread
(a timeout) or a stream's close (a dead peer). A user callback that made an
RPC there (``rpc_async(...).then(lambda f: rpc_sync(...))``) would wait for a
reply that only that very thread could read: a deadlock.

So every future rrpc returns is a ``Future`` (a ``torch.futures.Future``)
whose ``then`` and ``add_done_callback`` wrap the user's callback: run on a
transport thread, the callback is handed to ``callbacks``, a pool that grows a
thread whenever none is idle (a callback may block on anything, even on
another callback); run elsewhere (the future was already done, or a user
thread completed it), it runs right there, as in torch. Transport threads say
so with ``mark_transport_thread()``. A future with user callbacks is also
completed off the transport thread as a whole (``settle``), so that its
callbacks keep torch's order: registration order, one after another.

Internal callbacks (the RRef and autograd protocols) are registered on the
torch base class's methods and run where the future completes: they never
block.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("rrpc")

_IDLE_EXIT = 30.0  # seconds an idle callback thread waits before it ends


class _Marks(threading.local):
    transport = False
    # (give back, take back): set while a worker-pool thread runs a request.
    blocking_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None


_marks = _Marks()


def mark_transport_thread() -> None:
    """Declare the calling thread one the transport needs: no user callback runs on it."""
    _marks.transport = True


def on_transport_thread() -> bool:
    return _marks.transport


def set_blocking_hooks(hooks: Any) -> Any:
    """Set the calling thread's blocking hooks (see ``blocking``); returns the previous."""
    previous, _marks.blocking_hooks = _marks.blocking_hooks, hooks
    return previous


def blocking(wait: Callable[..., Any], *args: Any) -> Any:
    """``wait(*args)``, a wait for an RPC's reply. On a thread that runs a
    request, the request's worker permit is given back meanwhile, so that
    nested calls deeper than ``num_worker_threads`` cannot deadlock."""
    hooks = _marks.blocking_hooks
    if hooks is None:
        return wait(*args)
    give_back, take_back = hooks
    give_back()
    try:
        return wait(*args)
    finally:
        take_back()


class _CallbackPool:
    """Threads for user callbacks: a task goes to an idle thread, or to a new
    one when none is idle (so a callback that blocks on another callback's
    work cannot deadlock), and an idle thread ends after ``_IDLE_EXIT`` s.

    ``_idle`` counts idle threads not yet promised a task: ``submit`` takes
    one (and queues the task) under the lock, or starts a thread for it."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._names = iter(range(1 << 62))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                self._tasks.put((fn, args))
                return
        name = f"rrpc-callback-{next(self._names)}"
        threading.Thread(target=self._run, args=((fn, args),), name=name, daemon=True).start()

    def _run(self, task: tuple[Callable[..., Any], tuple] | None) -> None:
        while True:
            if task is not None:
                fn, args = task
                try:
                    fn(*args)
                except BaseException:
                    log.exception("rrpc: a future's callback raised")
                task = fn = args = None  # type: ignore[assignment]
            with self._lock:
                self._idle += 1
            while task is None:
                try:
                    task = self._tasks.get(timeout=_IDLE_EXIT)
                except queue.Empty:
                    with self._lock:
                        if self._tasks.empty():  # no task promised to an idle thread waits
                            self._idle -= 1
                            return


callbacks = _CallbackPool()


def _off_transport(callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def run(future: Any) -> None:
        if _marks.transport:
            callbacks.submit(callback, future)
        else:
            callback(future)

    return run


class Future(torch.futures.Future):
    """A ``torch.futures.Future`` whose callbacks never run on rrpc's transport threads."""

    _has_user_callbacks = False

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

        self._has_user_callbacks = True
        super().add_done_callback(_off_transport(chain))
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

        self._has_user_callbacks = True
        super().add_done_callback(_off_transport(logged))


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
    if _marks.transport and getattr(future, "_has_user_callbacks", False):
        callbacks.submit(_set, future, value, error)
    else:
        _set(future, value, error)


def _set(future: Any, value: Any, error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def on_done(future: torch._C.Future, callback: Callable[[Any], None]) -> None:
    """Register an rrpc-internal callback: it runs where ``future`` completes,
    possibly on a transport thread, so it must never block."""
    torch._C.Future.add_done_callback(future, callback)
