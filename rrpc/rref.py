"""What users hold of a remote value: ``RRef``, ``remote()``, proxies that run its methods.

An RRef names a value that lives on one worker, its owner; any worker may
hold one, pass it on, and call methods of the value through it. What keeps
the value alive while any worker refers to it is the RRef protocol: its
bookkeeping in ``rref_protocol.py`` (no I/O) and its driver for one run in
``rref_service.py`` (sends, serves, drains). This file is what users hold.

Rules:

- An RRef belongs to the run that made it (``_ctx``: that run's
  ``RRefService``, ``agent.rrefs``). After ``shutdown`` it cannot be used,
  and a later run never counts it.
- ``RRef.__del__`` only queues the drop for the service's sender thread
  (``RRefService.dropped``): safe from any thread, even inside a garbage
  collection that interrupts code holding a lock.
- Pickling an RRef is a fork (``__reduce__``, ``RRefService.fork``); it
  happens only inside an rrpc message, where ``codec.current_peer()`` names
  the destination (or, unpickling in ``_rebuild``, the sender).
- Calls through ``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()`` name a
  user RRef by id instead of forking it (``_call_on_owner``), which spares the
  owner an ACCEPT exchange per call; the owner runs them with
  ``rref_values._invoke_on_owner``.
- No error is raised out of a torch Future here (``rref_values.py`` says
  why): futures are read with ``futures.outcome``, a value's error is a
  ``Failed`` result raised as a copy, and a call read at once waits on the
  agent's ``SyncReply``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rrpc import agent as agent_module
from rrpc import codec, messages, restricted
from rrpc.functions import naming
from rrpc.futures import Future, copy_error, on_done, outcome, settle
from rrpc.messages import CALL, RREF_CREATE, RREF_FETCH, RpcError, RpcTimeoutError, WorkerInfo
from rrpc.options import UNSET_RPC_TIMEOUT
from rrpc.rref_protocol import ForkId, RRefId, format_id
from rrpc.rref_service import RRefService
from rrpc.rref_values import (
    _backward_on_owner,
    _invoke_on_owner,
    _rref_typeof_on_owner,
    complete_created,
    sync_result,
    wait_result,
)

T = TypeVar("T")


def _current_service() -> RRefService | None:
    """This run's RRef service; None while rrpc is not running."""
    agent = agent_module._current
    return agent.rrefs if agent is not None else None


def _service() -> RRefService:
    service = _current_service()
    if service is None:
        raise RpcError(  # worded as torch's
            "Current RPC agent is not set! Did you initialize the RPC framework "
            "(e.g. by calling rrpc.init_rpc)?"
        )
    return service


# -- The public API --------------------------------------------------------------
class RRef(Generic[T]):
    """A reference to a value that lives on one worker, its owner.

    ``RRef(value)`` makes a local RRef owned by this worker; ``rrpc.remote()``
    returns one whose value is created on another worker. RRefs can be passed
    to any worker as (part of) arguments and return values of RPCs; the owner
    keeps the value while any worker holds a reference, and frees it when the
    last one is gone. Mirrors ``torch.distributed.rpc.RRef``.

    Example::

        rref = rrpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        rref.to_here()                                   # tensor([2., 2.])
        rref.owner_name()                                # 'worker1'
        box = rrpc.remote("worker1", MyModule)
        box.rpc_sync().forward(torch.ones(3))            # runs on worker1
    """

    __slots__ = (
        "_ctx",
        "_id",
        "_fork",
        "_owner",
        "_future",
        "_creation",
        "_confirmed_at",
        "_deadline",
        "_type",
        "_type_future",
    )

    _ctx: RRefService | None
    _id: RRefId
    _fork: ForkId | None  # None on the owner
    _owner: WorkerInfo
    _future: torch.futures.Future | None  # the value, on the owner
    _creation: torch.futures.Future | None  # remote(): answered when the owner counted it
    _confirmed_at: list[float]  # remote(): [when that answer came] (inf until then)
    _deadline: float  # remote()'s timeout for that answer
    _type: type | None
    _type_future: torch.futures.Future | None  # what _get_type(blocking=False) returns

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        """Wrap ``value`` in an RRef owned by this worker (needs ``init_rpc``)."""
        ctx = _service()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(value)
        self._init(ctx, ctx.new_id(), None, ctx.agent.info, future)
        self._type = type_hint

    def __class_getitem__(cls, item: Any) -> Any:  # RRef[torch.nn.Module] in type hints
        return cls

    def _init(self, ctx, rref_id, fork_id, owner, future) -> None:
        self._ctx = ctx
        self._id = rref_id
        self._fork = fork_id
        self._owner = owner
        self._future = future
        self._creation = None
        self._confirmed_at = [math.inf]
        self._deadline = math.inf
        self._type = None
        self._type_future = None

    @classmethod
    def _make(cls, ctx, rref_id, fork_id, owner, future) -> RRef:
        rref = cls.__new__(cls)
        rref._init(ctx, rref_id, fork_id, owner, future)
        return rref

    def __del__(self) -> None:
        # A user RRef is gone: tell the sender thread. Nothing else is safe here.
        try:
            ctx = self._ctx
            if self._fork is not None and ctx is not None and ctx.running:
                ctx.dropped(self._fork)
        except Exception:
            pass  # interpreter shutdown, or a half-built object

    def _live_context(self, doing: str = "this") -> RRefService:
        ctx = self._ctx
        if ctx is None or not ctx.running or ctx is not _current_service():
            raise RpcError(
                f"{self!r}: Cannot call {doing} on it after deletion. It belongs to an RPC "
                "session that has been shut down; RRefs cannot be used after rrpc.shutdown()"
            )
        return ctx

    def _check_created(self) -> None:
        """Raise remote()'s error if the owner refused the CREATE, or did not
        confirm it within remote()'s timeout (then for good, as in torch, even
        if the confirmation came later)."""
        creation = self._creation
        if creation is None:
            return
        if self._fork is None:  # remote() to this worker: the creation is its call
            error = outcome(creation)[1] if creation.done() else None
            if isinstance(error, RpcError):  # the call failed, not the function
                raise copy_error(error)
            return
        if creation.done():
            error = outcome(creation)[1]
            if error is not None:
                raise copy_error(error)
            confirmed_at = self._confirmed_at[0]
            if confirmed_at == math.inf:  # answered just now: its callbacks are under way
                confirmed_at = time.monotonic()
            if confirmed_at <= self._deadline:
                return
        elif time.monotonic() <= self._deadline:
            return
        raise self._creation_timeout()

    def _creation_timeout(self) -> RpcTimeoutError:
        return RpcTimeoutError(
            f"RRef creation of {self!r} on {self._owner.name} timed out: remote() was not "
            "confirmed by its owner within its timeout (RPC ran for more than its timeout)"
        )

    # -- Identity ----------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The ``WorkerInfo`` of the worker that holds the value."""
        return self._owner

    def owner_name(self) -> str:
        """The name of the worker that holds the value."""
        return self._owner.name

    def is_owner(self) -> bool:
        """Whether this worker holds the value."""
        return self._fork is None

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this reference (always True on the owner).

        Until then, tensors passed to ``remote()`` must stay unchanged."""
        if self._fork is None:
            return True
        ctx = self._ctx
        if ctx is None or ctx is not _current_service():
            return False
        return ctx.confirmed_fork(self._fork)

    # -- Value -------------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner. Waits while ``remote()`` creates it."""
        if self._fork is not None:
            here = self._live_context().agent.info
            raise RuntimeError(  # torch's wording, then what to do
                f"For {self._torch_name()}, can't call localValue() on user {here!r}. "
                f"Call it on owner {self._owner!r}, or to_here() for a copy"
            )
        assert self._future is not None
        return wait_result(self._future, 0, "local_value()")

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """A copy of the value, fetched from the owner (on the owner: the value itself).

        Raises the error of the function behind ``remote()``, with its own type.
        ``timeout`` in seconds; -1: the default ``rpc_timeout``, 0: none.
        """
        ctx = self._live_context("to_here()")
        timeout = ctx.agent.resolve_timeout(timeout)
        if self._fork is None:
            assert self._future is not None
            return wait_result(self._future, timeout, f"to_here() of {self!r}")
        self._check_created()
        what = messages.Description((str.format, "to_here() of {!r}", self))
        fetch = ctx.agent.send(self._owner, RREF_FETCH, (self._id,), timeout, what, True)
        # The fetch alone would wait for the value: raise remote()'s timeout
        # if the owner has not confirmed the RRef by remote()'s deadline.
        if not fetch.wait_done(max(0.0, self._deadline - time.monotonic())):
            self._check_created()
        if self._creation is not None and self._creation.done():
            self._check_created()
        return sync_result(fetch)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run the backward pass from this RRef's value, a scalar tensor, on its owner.

        With ``dist_autograd_ctx_id``, a distributed backward pass in that
        context, started on the owner (gradients in ``get_gradients``); without
        it, a local one (gradients in ``.grad``), which only the owner can run.

        Example::

            with rrpc.autograd.context() as context_id:
                loss = rrpc.remote("worker1", torch.sum, args=(t,))
                loss.backward(context_id)
        """
        if dist_autograd_ctx_id == -1 and not self.is_owner():
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        if self.is_owner():
            _backward_on_owner(self, dist_autograd_ctx_id, retain_graph)
            return
        args = (dist_autograd_ctx_id, retain_graph)
        sync_result(_call_on_owner(self, _backward_on_owner, args, UNSET_RPC_TIMEOUT, sync=True))

    def _get_future(self) -> torch.futures.Future:
        """The future of this RRef's creation on its owner (remote()): it fails
        when remote()'s timeout passes first. For ``RRef(value)``, a completed one."""
        future = Future()
        creation = self._creation
        if creation is None:
            future.set_result(None)
            return future
        deadline = self._deadline
        if creation.done() or deadline == math.inf:
            on_done(
                creation,
                functools.partial(_creation_outcome, future, self._confirmed_at, deadline, None),
            )
            return future
        error = self._creation_timeout()
        ctx = self._ctx
        if ctx is not None:  # always: remote() made it (its call fails when the run stops)
            ctx.agent.scheduler.call_at(deadline, _settle_once, future, error)
        on_done(
            creation,
            functools.partial(_creation_outcome, future, self._confirmed_at, deadline, error),
        )
        return future

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (asked of the owner once, then cached); with
        ``blocking=False``, a Future of it, the same one every time (as torch)."""
        if not blocking and self._type_future is not None:
            return self._type_future
        if self._type is None and self._fork is not None:
            # As torch: an rpc_async to the owner (an RPC event when profiled).
            call = _call_on_owner(self, _rref_typeof_on_owner, (), timeout)
            if blocking:
                self._type = call.wait()
                return self._type
            # The owner's answer (or error, or timeout) comes in the Future.
            future = self._type_future = Future()
            on_done(call, functools.partial(_cache_type, self, future))
            return future
        if self._type is None:
            self._type = type(self.local_value())
        if blocking:
            return self._type
        future = self._type_future = Future()
        future.set_result(self._type)
        return future

    def _get_profiling_future(self) -> torch.futures.Future:
        """Done once ``remote()``'s profiler event is recorded (as torch's): the
        owner's answer to it, or on the owner the value's future."""
        future = self._creation if self._creation is not None else self._future
        assert future is not None
        return future

    # -- Proxies -----------------------------------------------------------------
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner and return their result:
        ``rref.rpc_sync().method(*args, **kwargs)``."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner and return a Future:
        ``rref.rpc_async().method(*args, **kwargs).wait()``."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls run on the owner and return an RRef to
        the result, owned there: ``rref.remote().method(*args, **kwargs)``."""
        return _Proxy(self, "remote", timeout)

    # -- Pickling (forks) --------------------------------------------------------
    def __reduce__(self) -> tuple:
        peer = codec.current_peer()
        if peer is None:
            raise RuntimeError(
                f"Can not pickle rref in python pickler: {self!r} can only be pickled by rrpc, "
                "as an argument or a result of an RPC (pickling it elsewhere would create a "
                "reference its owner cannot count)"
            )
        ctx = self._live_context("fork")
        self._check_created()  # as torch: an RRef whose creation failed is not passed on
        child = ctx.fork(self._id, self._fork, self)
        codec.on_discard(functools.partial(ctx.undo_fork, self._id, self._fork, child))
        return _rebuild, (self._id, self._owner.id, child)

    def __str__(self) -> str:  # torch's format
        if self._fork is None:
            return f"OwnerRRef({_unique_id(self._id)})"
        return f"UserRRef(RRefId = {_unique_id(self._id)}, ForkId = {_unique_id(self._fork)})"

    def _torch_name(self) -> str:
        if self._fork is None:
            return f"OwnerRRef(rref_id={_unique_id(self._id)})"
        return f"UserRRef(rref_id={_unique_id(self._id)}, fork_id={_unique_id(self._fork)})"

    def __repr__(self) -> str:
        if self._fork is None:
            return f"OwnerRRef(rref_id={format_id(self._id)}, owner={self._owner.name})"
        return (
            f"UserRRef(rref_id={format_id(self._id)}, fork_id={format_id(self._fork)}, "
            f"owner={self._owner.name})"
        )


def _cache_type(rref: RRef, future: torch.futures.Future, call: torch.futures.Future) -> None:
    value, error = outcome(call)
    if error is None:
        rref._type = value
    settle(future, value, error)


def _note_time(when: list[float], _: Any) -> None:
    when[0] = time.monotonic()


def _settle_once(future: torch.futures.Future, error: BaseException | None) -> None:
    if not future.done():
        try:
            settle(future, error=error)
        except RuntimeError:
            pass  # completed meanwhile (the timer, or the answer)


def _creation_outcome(
    future: torch.futures.Future,
    confirmed_at: list[float],
    deadline: float,
    timeout_error: BaseException | None,
    creation: torch.futures.Future,
) -> None:
    """``_get_future``'s future from remote()'s CREATE answer: its error, a
    timeout if it came after remote()'s deadline, or None."""
    error = outcome(creation)[1]
    if error is None and confirmed_at[0] > deadline:
        error = timeout_error
    _settle_once(future, error)


def _unique_id(unique_id: tuple[int, int]) -> str:
    return f"GloballyUniqueId(created_on={unique_id[0]}, local_id={unique_id[1]})"


@restricted.allow
def _rebuild(rref_id: RRefId, owner_rank: int, fork_id: ForkId) -> RRef:
    service = _current_service()
    sender = codec.current_peer()
    if service is None or sender is None:
        raise RpcError("an RRef can only be unpickled by rrpc, from a message of a running session")
    if owner_rank == service.rank:
        return service.receive_owned(rref_id, fork_id, sender)
    rref = RRef._make(service, rref_id, fork_id, service.agent.worker_info(owner_rank), None)
    service.receive_user(rref_id, fork_id, owner_rank, sender)
    return rref


def placeholder(service: RRefService, rref_id: RRefId) -> RRef:
    """The owner RRef of a value another worker will create here: a FORK or
    FETCH that overtook its CREATE holds it (``RRefService``'s holders)."""
    return RRef._make(service, rref_id, None, service.agent.info, torch.futures.Future())


class _Proxy:
    """``rref.rpc_sync()`` / ``.rpc_async()`` / ``.remote()``: attribute access
    yields a function that runs that method of the value on its owner."""

    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef, mode: str, timeout: float):
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, method: str) -> Callable[..., Any]:
        return functools.partial(_invoke, self._rref, self._mode, method, self._timeout)

    def __repr__(self) -> str:
        return f"<{self._mode}() proxy of {self._rref!r}>"


def _invoke(
    rref: RRef, mode: str, method: str, timeout: float, /, *args: Any, **kwargs: Any
) -> Any:
    rref._check_created()
    if mode == "remote":  # the RRef travels: remote() answers before the call has run
        value_type = rref._get_type(timeout)
        if not hasattr(value_type, method):  # as torch: raise here, at once
            raise AttributeError(f"{value_type.__name__!r} object has no attribute {method!r}")
        call_args = (rref, method, args, kwargs)
        return remote(rref._owner, _invoke_on_owner, call_args, timeout=timeout)
    sync = mode == "rpc_sync"
    call = _call_on_owner(rref, _invoke_on_owner, (method, args, kwargs), timeout, method, sync)
    return sync_result(call) if sync else call


def _call_on_owner(
    rref: RRef, func: Callable, args: tuple, timeout: float, method: str = "", sync: bool = False
) -> Any:
    """Run ``func(target, *args)`` on the owner, ``target`` naming ``rref``
    there (``_owner_rref``): a Future of its result, or with ``sync`` a
    ``SyncReply`` to read with ``sync_result`` at once.

    A user RRef goes by id: pickled, it would be a fork that the owner
    confirms with an ACCEPT exchange on every call. The caller holds the RRef
    until the reply (a blocking caller has it; a Future keeps it in a
    done-callback), so the owner cannot free the value meanwhile."""
    agent = rref._live_context().agent
    what = messages.Description((naming, "{}() on the value of {!r}", method or func, rref))
    target = rref if rref._fork is None else rref._id
    payload: tuple = (func, (target, *args), {})
    timeout = agent.resolve_timeout(timeout)
    # "sync"/"async": an RPC event when profiled, as torch's RRef helpers' calls are.
    reply = agent.send(rref._owner, CALL, payload, timeout, what, sync, "sync" if sync else "async")
    if not sync:
        on_done(reply, functools.partial(_hold_until_done, rref))
    return reply


def _hold_until_done(rref: RRef, future: torch.futures.Future) -> None:
    """A done-callback whose only job is to keep ``rref`` alive until then."""


def remote(
    to: Any,
    func: Callable[..., T],
    args: tuple | None = None,
    kwargs: dict | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[T]:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return an RRef to the
    result at once; ``to`` owns the result, this worker holds a user RRef.

    Args:
        to: the owner-to-be's name, rank or ``WorkerInfo`` (this worker: an owner RRef).
        func: a builtin, a picklable callable or a lambda/closure; may be an
            ``rrpc.functions.async_execution`` function (the value is its Future's).
        args, kwargs: its arguments; RRefs among them are forked to ``to``.
        timeout: seconds for the owner to confirm the RRef; -1: the default
            ``rpc_timeout``, 0: none. If it does not, the next use of the RRef
            (``to_here()``, a proxy call) raises ``rrpc.RpcTimeoutError``.

    An error raised by ``func`` is raised by ``to_here()`` and proxy calls on
    the RRef, with its own type. Tensors in ``args`` must not change until
    ``rref.confirmed_by_owner()``.

    Example::

        rref = rrpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        rref.to_here()  # tensor([4., 4.])
    """
    ctx = _service()
    agent = ctx.agent
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    peer = agent.worker_info(to)
    timeout = agent.resolve_timeout(timeout)
    payload_args, payload_kwargs = tuple(args or ()), dict(kwargs or {})
    what = messages.Description((naming, "remote() of {}", func))
    if peer.id == ctx.rank:
        # As torch: a CREATE to this worker itself (arguments copied, run on the pool)
        # sets the value to the very object returned (``here``); _get_future()'s outcome.
        value: torch.futures.Future = torch.futures.Future()
        rref = RRef._make(ctx, ctx.new_id(), None, peer, value)
        ctx.here[rref._id] = value
        request: tuple = (rref._id, None, func, payload_args, payload_kwargs)
        try:
            creation = agent.send(peer, RREF_CREATE, request, timeout, what, mode="remote")
        except BaseException:
            del ctx.here[rref._id]
            raise
        rref._creation = creation
        timed_out = rref._creation_timeout()
        on_done(creation, functools.partial(complete_created, ctx.here, rref._id, timed_out))
        return rref
    rref_id, fork_id = ctx.new_id(), ctx.new_id()
    ctx.created(rref_id, fork_id, peer.id)
    try:
        # No timeout on the message itself: its answer says whether the owner
        # counted the fork, which the protocol must know. remote()'s timeout
        # applies to the RRef's uses instead (_check_created).
        request = (rref_id, fork_id, func, payload_args, payload_kwargs)
        creation = agent.send(peer, RREF_CREATE, request, 0, what, mode="remote")
    except BaseException:
        ctx.forget(fork_id)
        raise
    rref = RRef._make(ctx, rref_id, fork_id, peer, None)
    rref._creation = creation
    rref._deadline = time.monotonic() + timeout if timeout else math.inf
    on_done(creation, functools.partial(_note_time, rref._confirmed_at))
    on_done(creation, functools.partial(ctx.on_created, rref_id, fork_id, peer.id))
    return rref


def rref_debug_info() -> dict[str, int]:
    """This worker's RRef bookkeeping, as counts.

    ``num_owner_rrefs``: values this worker owns that other workers refer to;
    ``num_owner_forks``: the user references it counts for them;
    ``num_user_rrefs``: references to other workers' values held here (and not
    yet released); ``num_pending_confirmations`` / ``num_pending_forks``: those
    the owner has not confirmed yet (from remote() / from another user);
    ``num_pending_children``: copies sent to other workers and not yet counted
    by the owner; ``num_pending_deletes`` / ``num_pending_accepts``: protocol
    messages not yet answered. All are 0 when no RRef is in use.
    """
    return _service().debug_info()


def delete_all_user_rrefs(timeout: float = 300.0) -> None:
    """Let go of every user RRef held on this worker, as if each were dropped,
    and wait until their owners have counted the deletes (torch's
    ``_delete_all_user_and_unforked_owner_rrefs``; ``shutdown`` needs no call
    to it). An RRef object still referenced afterwards must not be used.
    Raises ``RpcError`` if the owners have not answered within ``timeout``."""
    service = _service()
    service.release_user_forks()
    service.drain(timeout)


def owner_forks() -> dict[RRefId, set[ForkId]]:
    """The owner table, for tests and debugging: rref id -> fork ids it counts."""
    return _service().owner_forks()


__all__ = ["RRef", "delete_all_user_rrefs", "owner_forks", "remote", "rref_debug_info"]
