"""Remote references: ``remote()``, ``RRef``, and the messages of the RRef protocol.

The decisions (who counts which fork, when a value is freed, what to send)
are in ``rref_protocol.py``; this file drives them: it turns pickling,
unpickling, garbage collection and replies into protocol events, sends the
messages the tables ask for, and serves the protocol's message kinds.

Rules:

- One ``_Context`` per RPC session (``init_rpc`` .. ``shutdown``). Its lock
  guards both tables; nothing is sent and no value is freed while holding it
  (a reply callback may run inline in ``agent.send``; a value's ``__del__`` may
  do anything).
- ``RRef.__del__`` only puts an event on a ``SimpleQueue`` (safe from any
  thread, even inside a garbage collection that interrupts code holding a lock).
  One sender thread per session turns those drops into protocol events and
  sends every protocol message (FORK, ACCEPT, DELETE); replies come back on the
  agent's threads and feed the tables again.
- DELETEs wait up to ``rref_delete_delay`` on the sender thread and go as one
  message per owner, naming every fork let go meanwhile: a loop that drops an
  RRef per iteration then costs the owner one message per few iterations, not
  one each. Nothing else waits (a delete frees, it never unblocks a caller),
  and a drain sends what is held at once.
- Protocol messages have no timeout: the protocol is only correct if each is
  answered. A dead peer fails them at once (the agent notices), and a graceful
  shutdown waits for them (``_Context.drain``).
- A protocol message known never to have left (fault injection dropped it)
  is sent again (``Agent.send_reliably``), as torch's agent retries its RRef
  messages; it counts as in flight until answered.
- Pickling an RRef is a fork; it happens only inside an rrpc message, where
  ``codec.current_peer()`` names the destination (or, unpickling, the sender).
- No error is raised out of a torch Future here (``wait()``/``value()`` that
  raise): torch's raise puts the Future into the error's traceback, and the
  Future holds the error from C++, invisible to the garbage collector, so the
  cycle never goes and keeps every frame of the raising stack alive (an RRef
  held by any of them would never be deleted). Futures are read with
  ``futures.outcome`` (drops that traceback); a value's error is kept as a ``_Failed``
  result, never with ``set_exception``, and raised as a copy (``_result``).
  Calls read at once (``rpc_sync()`` proxies, most ``to_here()``) wait on an
  agent ``SyncReply`` instead, which raises its own fresh error and keeps none.

Values on the owner live in the owner ``RRef`` object (``_future``: a
``torch.futures.Future`` of the value, pending while ``remote()``'s function
runs). The owner table holds that object while users refer to it, so an RRef
that comes back to its owner unpickles as the very same object.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rrpc import agent as agent_module
from rrpc import autograd as dist_autograd
from rrpc import codec, functions, logs, profiling
from rrpc.agent import Agent, Deferred
from rrpc.functions import (
    async_execution,
    async_result_error,
    callable_name,
    is_async_execution,
)
from rrpc.futures import (
    Future,
    SyncReply,
    copy_error,
    on_done,
    outcome,
    settle,
    wait_until,
)
from rrpc.messages import (
    CALL,
    RREF_ACCEPT,
    RREF_CREATE,
    RREF_CREATE_FAILED,
    RREF_DELETE,
    RREF_FETCH,
    RREF_FORK,
    PeerUnavailableError,
    RpcError,
    RpcTimeoutError,
    WorkerInfo,
    kind_name,
)
from rrpc.options import UNSET_RPC_TIMEOUT
from rrpc.profiling import profiler_enabled
from rrpc.rref_protocol import (
    UNCONFIRMED,
    ForkId,
    OwnerTable,
    ProtocolError,
    RRefId,
    Send,
    UserTable,
    format_id,
)

log = logging.getLogger("rrpc")

T = TypeVar("T")

_DROP, _SEND, _FLUSH = "drop", "send", "flush"
_MAX_HELD_DELETES = 256  # held DELETEs go at once when one owner has this many


class _Context:
    """The RRef state of one RPC session on this worker."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.rank = agent.info.id
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a message is answered
        self.owners = OwnerTable(self.rank, self._placeholder)
        self.users = UserTable(self.rank)
        # Protocol messages sent and not answered yet (FORK is counted as an
        # unconfirmed fork in the user table instead).
        self.in_flight = {RREF_ACCEPT: 0, RREF_DELETE: 0, RREF_CREATE_FAILED: 0}
        # Forks received from a non-owner, until the owner answers their FORK:
        # a message that brought one runs only then (as in torch).
        self.confirmations: dict[ForkId, torch.futures.Future] = {}
        # Local ids from 0, as torch's; a rank that rejoined a dynamic group starts
        # past its earlier incarnations' ids, which peers may still hold.
        self._ids = itertools.count(agent.incarnation << 32)
        # DELETEs held back (see the rules): owner rank -> forks, and when the
        # oldest of them was dropped. Only the sender thread touches these.
        self.delete_delay = agent.options.rref_delete_delay
        self._held_deletes: dict[int, list[tuple[RRefId, ForkId]]] = {}
        self._held_since = 0.0
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.released: set[ForkId] = set()  # forks let go of by release_user_forks
        self.running = True
        self._sender = threading.Thread(
            target=self._run_sender, name=f"rrpc-rref-{agent.info.name}", daemon=True
        )
        self._sender.start()

    def new_id(self) -> tuple[int, int]:
        return (self.rank, next(self._ids))  # next() on a count is atomic under the GIL

    def _placeholder(self, rref_id: RRefId) -> RRef:
        return RRef._make(self, rref_id, None, self.agent.info, torch.futures.Future())

    # -- Sending -----------------------------------------------------------------
    def post(self, sends: list[Send]) -> None:
        if sends:
            self.events.put((_SEND, sends))

    def _run_sender(self) -> None:
        while True:
            if self._held_deletes:
                linger = self._held_since + self.delete_delay - time.monotonic()
                try:
                    event = self.events.get(timeout=max(0.0, linger))
                except queue.Empty:
                    self._send_deletes()
                    continue
            else:
                event = self.events.get()
            if event is None:
                return
            what, item = event
            try:
                if what == _DROP:
                    with self.lock:
                        if item in self.released:  # let go of at leave already
                            self.released.discard(item)
                            continue
                        sends = self.users.dropped(item)
                    self._send_all(sends)
                elif what == _SEND:
                    self._send_all(item)
                else:  # _FLUSH: everything queued before it is sent
                    self._send_deletes()
                    item.set()
                if self._held_deletes and not self.delete_delay:
                    self._send_deletes()
            except Exception:
                log.exception("rrpc: RRef protocol event %s %s failed", what, item)

    def _send_deletes(self) -> None:
        held, self._held_deletes = self._held_deletes, {}
        for owner, forks in held.items():
            self._send(Send(RREF_DELETE, owner, tuple(forks)))

    def _send_all(self, sends: list[Send]) -> None:
        for send in sends:
            if send.kind in self.in_flight:
                with self.lock:
                    self.in_flight[send.kind] += 1
            if send.kind != RREF_DELETE:
                self._send(send)
                continue
            if not self._held_deletes:
                self._held_since = time.monotonic()
            forks = self._held_deletes.setdefault(send.to, [])
            forks.append(send.payload)
            if len(forks) >= _MAX_HELD_DELETES:
                self._send_deletes()

    def _send(self, send: Send) -> None:
        """Send one protocol message; its answer (or failure) goes to ``_answered``."""
        try:
            peer = self.agent.worker_info(send.to)
            what = f"RRef message {kind_name(send.kind)}"
            future = self.agent.send_reliably(peer, send.kind, send.payload, 0, what)
        except BaseException as exc:
            self._answered(send, exc)
            return
        on_done(future, functools.partial(self._on_reply, send))

    def _on_reply(self, send: Send, future: torch.futures.Future) -> None:
        self._answered(send, outcome(future)[1])

    def _answered(self, send: Send, error: BaseException | None) -> None:
        if not self.running:
            return  # the session is over and its tables are gone
        if error is not None and not isinstance(error, PeerUnavailableError):
            logs.event("rref-message", str(send.to), "%r failed: %s", send, error)
        if send.kind == RREF_FORK:
            self._confirmed(send.payload[1], error)
            return
        with self.lock:
            # A DELETE names several forks, each counted when it was queued.
            self.in_flight[send.kind] -= len(send.payload) if send.kind == RREF_DELETE else 1
            self.changed.notify_all()

    def _confirmed(self, fork_id: ForkId, error: BaseException | None) -> list[Send]:
        """The owner answered the CREATE or FORK of ``fork_id``; send what follows."""
        waiting = None
        try:
            with self.lock:
                waiting = self.confirmations.pop(fork_id, None)
                sends = self.users.confirmed(fork_id, counted=error is None)
                self.changed.notify_all()
        except ProtocolError:
            log.exception("rrpc: confirmation of fork %s", format_id(fork_id))
            return []
        finally:
            if waiting is not None:
                waiting.set_result(None)  # the message runs; a failed fork raises on use
        self.post(sends)
        return sends

    # -- remote() confirmations --------------------------------------------------
    def on_created(self, rref_id: RRefId, fork_id: ForkId, owner: int, future) -> None:
        """The owner answered our CREATE: the fork is counted, or it never will be."""
        if not self.running:
            return
        error = outcome(future)[1]
        self._confirmed(fork_id, error)
        if error is not None and not isinstance(error, PeerUnavailableError):
            self.post([Send(RREF_CREATE_FAILED, owner, (rref_id,))])

    # -- Serving (the owner's side) ----------------------------------------------
    def serve_create(self, payload: tuple, caller: WorkerInfo) -> Any:
        rref_id, fork_id, func, args, kwargs = payload
        with self.lock:
            holder = self.owners.create(rref_id, fork_id)
        # Counted; the reply (the user's confirmation) goes once the value is set.
        return _evaluate_into(holder._future, func, args, kwargs)

    def serve_fetch(self, payload: tuple, caller: WorkerInfo) -> Any:
        (rref_id,) = payload
        with self.lock:
            holder = self.owners.fetch(rref_id)
        value = holder._future
        if value.done():
            return _result(value)
        # Not created yet: reply when it is. An error then travels as a _Failed
        # result (see the rules), which the user's _result raises.
        reply: torch.futures.Future = torch.futures.Future()
        on_done(value, functools.partial(_forward, reply))
        return Deferred(reply)

    def serve_fork(self, payload: tuple, caller: WorkerInfo) -> None:
        rref_id, fork_id = payload
        with self.lock:
            self.owners.fork_request(rref_id, fork_id)

    def serve_accept(self, payload: tuple, caller: WorkerInfo) -> None:
        (child_id,) = payload
        with self.lock:
            sends = self.users.child_accepted(child_id)
        self.post(sends)

    def serve_delete(self, payload: tuple, caller: WorkerInfo) -> None:
        released = []
        with self.lock:
            for rref_id, fork_id in payload:
                released.append(self.owners.delete(rref_id, fork_id))
        del released  # values may be freed here, outside the lock

    def serve_create_failed(self, payload: tuple, caller: WorkerInfo) -> None:
        (rref_id,) = payload
        with self.lock:
            holder = self.owners.creation_failed(rref_id)
        if holder is not None and not holder._future.done():
            error = RpcError(
                f"remote() creating RRef {format_id(rref_id)} on {self.agent.info.name} "
                f"failed on {caller.name} before it ran (see the error remote() got there)"
            )
            holder._future.set_result(_Failed(error))

    # -- Shutdown ----------------------------------------------------------------
    def pending(self) -> dict[str, int]:
        counts = self.users.counts()
        pending = {
            "pending confirmations": counts["num_pending_confirmations"],
            "pending forks": counts["num_pending_forks"],
            "pending children": counts["num_pending_children"],
        }
        pending.update({f"{kind_name(k)} in flight": n for k, n in self.in_flight.items()})
        return {name: n for name, n in pending.items() if n}

    def release_user_forks(self) -> None:
        """Leaving a dynamic group while others stay: let go of every user RRef
        still held here, as if the application had dropped it, so that the
        owners may free the values (``drain`` then waits for the DELETEs)."""
        with self.lock:
            sends = []
            for fork in list(self.users.forks.values()):
                if fork.alive:
                    self.released.add(fork.fork_id)
                    sends += self.users.dropped(fork.fork_id)
        self.post(sends)

    def drain(self, timeout: float) -> None:
        """Wait until every confirmation, child and protocol message is answered."""
        gc.collect()  # RRefs in reference cycles: drop them now, not after shutdown
        deadline = time.monotonic() + timeout
        while True:
            flushed = threading.Event()
            self.events.put((_FLUSH, flushed))
            flushed.wait(None if deadline == math.inf else max(0.0, deadline - time.monotonic()))
            with self.lock:
                pending = self.pending()
                if not pending and flushed.is_set():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                # Answers notify; the poll covers drops queued by __del__ meanwhile.
                self.changed.wait(min(remaining, 0.05))
        raise RpcError(
            f"shutdown of {self.agent.info.name}: RRef protocol still waiting after "
            f"{timeout:g} s: {pending or 'queued events'}"
        )

    def stop(self) -> None:
        self.running = False
        self.events.put(None)
        if self._sender is not threading.current_thread():
            self._sender.join(5.0)
        with self.lock:
            released = list(self.owners.entries.values())
            self.owners.entries.clear()
            self.users.forks.clear()
            self.users.pending_children.clear()
        del released


_ctx: _Context | None = None


def _context() -> _Context:
    ctx = _ctx
    if ctx is None:
        if agent_module._current is None:
            raise RpcError(  # worded as torch's
                "Current RPC agent is not set! Did you initialize the RPC framework "
                "(e.g. by calling rrpc.init_rpc)?"
            )
        raise RpcError("RRefs are not available: rrpc.rref was not started with this agent")
    return ctx


def _on_start(agent: Agent) -> None:
    global _ctx
    if _ctx is not None:
        _ctx.stop()
    ctx = _ctx = _Context(agent)
    agent.register(RREF_CREATE, ctx.serve_create)
    agent.register(RREF_FETCH, ctx.serve_fetch)
    agent.register(RREF_FORK, ctx.serve_fork)
    agent.register(RREF_ACCEPT, ctx.serve_accept)
    agent.register(RREF_DELETE, ctx.serve_delete)
    agent.register(RREF_CREATE_FAILED, ctx.serve_create_failed)


def _on_drain(timeout: float) -> None:
    if _ctx is not None:
        _ctx.drain(timeout)


def _on_stop() -> None:
    global _ctx
    ctx, _ctx = _ctx, None
    if ctx is not None:
        ctx.stop()


agent_module.on_start.append(_on_start)
agent_module.on_drain.append(_on_drain)
agent_module.on_stop.append(_on_stop)


# -- Helpers ---------------------------------------------------------------------


class _Failed:
    """The value of an RRef whose function raised: ``error``, without its frames."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self) -> tuple:
        return _Failed, (self.error,)


def _kept(error: BaseException) -> _Failed:
    """Keep ``error`` as a value: its traceback becomes a note, its frames go."""
    if error.__traceback__ is not None and hasattr(error, "add_note"):  # Python >= 3.11
        text = "".join(traceback.format_tb(error.__traceback__))
        error.add_note(f"Traceback of the function behind the RRef:\n{text.rstrip()}")
    return _Failed(error.with_traceback(None))


def _result(future: torch.futures.Future) -> Any:
    """``future.wait()`` for a done future, raising errors (and _Failed values) as copies."""
    value, error = outcome(future)
    del future  # not in the frame that the raise below puts into the traceback
    if isinstance(value, _Failed):
        error = value.error
    if error is not None:
        raise copy_error(error)
    return value


def _sync_result(reply: SyncReply) -> Any:
    """``_result`` for a call's ``SyncReply``: its error is its own (fresh from
    the reply), a _Failed value is raised as a copy."""
    value = reply.wait()
    if isinstance(value, _Failed):
        raise copy_error(value.error)
    return value


def _complete(target: torch.futures.Future, source: torch.futures.Future) -> None:
    """Set value future ``target`` from a call's future ``source``."""
    value, error = outcome(source)
    target.set_result(value if error is None else _Failed(error))


def _complete_created(
    target: torch.futures.Future, timed_out: BaseException, source: torch.futures.Future
) -> None:
    """``_complete`` for remote() to this worker: a timeout is the creation's."""
    value, error = outcome(source)
    if isinstance(error, RpcTimeoutError):
        error = timed_out
    target.set_result(value if error is None else _Failed(error))


def _forward(reply: torch.futures.Future, value: torch.futures.Future) -> None:
    reply.set_result(value.wait())  # a value future never holds an exception


def _evaluate_into(
    future: torch.futures.Future, func: Callable, args: tuple, kwargs: dict
) -> Deferred | None:
    """Run ``func`` into ``future`` (an error is kept there, for to_here to raise).

    Returns None when ``future`` is set, or a Deferred that completes once an
    ``async_execution`` function's future has set it."""
    try:
        if functions.restricted:
            functions.check_call(func)
        result = func(*args, **kwargs)
    except BaseException as exc:
        future.set_result(_kept(exc))
        return None
    if not is_async_execution(func):
        future.set_result(result)
        return None
    error = async_result_error(func, result)
    if error is not None:
        future.set_result(_Failed(error))
        return None
    set_: torch.futures.Future = torch.futures.Future()

    def finish(done: torch.futures.Future) -> None:
        _complete(future, done)
        set_.set_result(None)

    on_done(result, finish)
    return Deferred(set_)


def _wait(future: torch.futures.Future, timeout: float, what: str) -> Any:
    """``_result(future)`` once done, within ``timeout`` (0: none) or RpcTimeoutError."""
    if not wait_until(future, timeout or math.inf):
        raise RpcTimeoutError(
            f"{what} timed out after {timeout:g} s: RPC ran for more than its timeout"
        )
    return _result(future)


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

    _ctx: _Context | None
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
        ctx = _context()
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
                ctx.events.put((_DROP, self._fork))
        except Exception:
            pass  # interpreter shutdown, or a half-built object

    def _live_context(self, doing: str = "this") -> _Context:
        ctx = self._ctx
        if ctx is None or not ctx.running or ctx is not _ctx:
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
        if creation is None or self._fork is None:
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
        if ctx is None or ctx is not _ctx:
            return False
        with ctx.lock:
            state = ctx.users.state(self._fork)
        return state is not None and state != UNCONFIRMED

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
        return _wait(self._future, 0, "local_value()")

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> T:
        """A copy of the value, fetched from the owner (on the owner: the value itself).

        Raises the error of the function behind ``remote()``, with its own type.
        ``timeout`` in seconds; -1: the default ``rpc_timeout``, 0: none.
        """
        ctx = self._live_context("to_here()")
        timeout = ctx.agent.resolve_timeout(timeout)
        if self._fork is None:
            assert self._future is not None
            return _wait(self._future, timeout, f"to_here() of {self!r}")
        self._check_created()
        what = f"to_here() of {self!r}"
        fetch = ctx.agent.send(self._owner, RREF_FETCH, (self._id,), timeout, what, True)
        # The fetch alone would wait for the value: raise remote()'s timeout
        # if the owner has not confirmed the RRef by remote()'s deadline.
        if not fetch.wait_done(max(0.0, self._deadline - time.monotonic())):
            self._check_created()
        if self._creation is not None and self._creation.done():
            self._check_created()
        return _sync_result(fetch)

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
        _sync_result(_call_on_owner(self, _backward_on_owner, args, UNSET_RPC_TIMEOUT, sync=True))

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
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), _fail_once, (future, error))
        timer.daemon = True
        timer.start()
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
        child = ctx.new_id()
        with ctx.lock:
            if self._fork is None:
                ctx.owners.fork_to_user(self._id, child, self)
            else:
                ctx.users.fork_child(self._fork, child)
        codec.on_discard(functools.partial(_undo_fork, ctx, self._id, self._fork, child))
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


def _fail_once(future: torch.futures.Future, error: BaseException) -> None:
    if not future.done():
        try:
            settle(future, error=error)
        except RuntimeError:
            pass  # completed meanwhile


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
    if error is not None:
        _fail_once(future, error)
    elif not future.done():
        try:
            settle(future, None)
        except RuntimeError:
            pass  # the timer failed it meanwhile


def _unique_id(unique_id: tuple[int, int]) -> str:
    return f"GloballyUniqueId(created_on={unique_id[0]}, local_id={unique_id[1]})"


def _undo_fork(ctx: _Context, rref_id: RRefId, fork_id: ForkId | None, child: ForkId) -> None:
    """The message a fork was pickled into is not sent after all."""
    released = None
    sends: list[Send] = []
    try:
        with ctx.lock:
            if fork_id is None:
                released = ctx.owners.delete(rref_id, child)
            else:
                sends = ctx.users.child_accepted(child)
    except ProtocolError:
        log.exception("rrpc: undoing fork %s of RRef %s", format_id(child), format_id(rref_id))
    del released
    ctx.post(sends)


def _rebuild(rref_id: RRefId, owner_rank: int, fork_id: ForkId) -> RRef:
    ctx = _ctx
    sender = codec.current_peer()
    if ctx is None or sender is None:
        raise RpcError("an RRef can only be unpickled by rrpc, from a message of a running session")
    if owner_rank == ctx.rank:
        if rref_id[0] != ctx.rank:
            # A value another worker created here: that worker must exist, or
            # a placeholder would wait for a CREATE that can never come.
            ctx.agent.worker_info(rref_id[0])
        with ctx.lock:
            holder, sends = ctx.owners.receive(rref_id, fork_id, sender.id)
        ctx.post(sends)
        if holder._future is not None and not holder._future.done():
            # Its remote() has not finished here: the message that names it
            # runs after, as everything the sender sent before it did.
            codec.wait_for(holder._future)
        return holder
    rref = RRef._make(ctx, rref_id, fork_id, ctx.agent.worker_info(owner_rank), None)
    confirmed = None
    with ctx.lock:
        sends = ctx.users.received(rref_id, fork_id, owner_rank, sender.id)
        if sends:  # a FORK to the owner: the message runs once it is answered
            confirmed = ctx.confirmations[fork_id] = torch.futures.Future()
    ctx.post(sends)
    if confirmed is not None:
        codec.wait_for(confirmed)
    return rref


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
    return _sync_result(call) if sync else call


def _call_on_owner(
    rref: RRef, func: Callable, args: tuple, timeout: float, method: str = "", sync: bool = False
) -> Any:
    """Run ``func(target, *args)`` on the owner, ``target`` naming ``rref``
    there (``_owner_rref``): a Future of its result, or with ``sync`` a
    ``SyncReply`` to read with ``_sync_result`` at once.

    A user RRef goes by id: pickled, it would be a fork that the owner
    confirms with an ACCEPT exchange on every call. The caller holds the RRef
    until the reply (a blocking caller has it; a Future keeps it in a
    done-callback), so the owner cannot free the value meanwhile."""
    agent = rref._live_context().agent
    what = f"{method or callable_name(func)}() on the value of {rref!r}"
    target = rref if rref._fork is None else rref._id
    payload: tuple = (func, (target, *args), {})
    timeout = agent.resolve_timeout(timeout)
    if profiler_enabled():  # an RPC event, as torch's RRef helpers' calls are
        mode = "sync" if sync else "async"
        reply = profiling.send(agent, rref._owner, CALL, payload, timeout, what, mode, func)
    else:
        reply = agent.send(rref._owner, CALL, payload, timeout, what, sync)
    if not sync:
        on_done(reply, functools.partial(_hold_until_done, rref))
    return reply


def _hold_until_done(rref: RRef, future: torch.futures.Future) -> None:
    """A done-callback whose only job is to keep ``rref`` alive until then."""


def _owner_rref(target: RRef | RRefId) -> RRef:
    """On the owner: the RRef a call names, itself or by id (a placeholder
    while its CREATE has not run yet)."""
    if isinstance(target, RRef):
        return target
    ctx = _context()
    with ctx.lock:
        return ctx.owners.holder(target)


@async_execution
def _invoke_on_owner(
    target: RRef | RRefId, method: str, args: tuple, kwargs: dict
) -> torch.futures.Future:
    """On the owner: ``getattr(value, method)(*args, **kwargs)``, as a Future so
    that an ``async_execution`` method's reply waits for its own Future."""
    value = _owner_rref(target).local_value()
    if functions.restricted:
        functions.check_method(value, method)
    bound = getattr(value, method)
    if is_async_execution(bound):
        return bound(*args, **kwargs)
    # An error is raised here, not set on the Future: see the rules.
    result: torch.futures.Future = torch.futures.Future()
    result.set_result(bound(*args, **kwargs))
    return result


def _backward_on_owner(target: RRef | RRefId, context_id: int, retain_graph: bool) -> None:
    value = _owner_rref(target).local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        dist_autograd.backward(context_id, [value], retain_graph=retain_graph)


def _rref_typeof_on_owner(target: RRef | RRefId) -> type:  # torch's name, in profiles
    return type(_owner_rref(target).local_value())


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
    ctx = _context()
    agent = ctx.agent
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    peer = agent.worker_info(to)
    timeout = agent.resolve_timeout(timeout)
    payload_args, payload_kwargs = tuple(args or ()), dict(kwargs or {})
    what = f"remote() of {callable_name(func)}"
    profiled = profiler_enabled()  # the one check profiling costs (rrpc/profiling.py)
    if peer.id == ctx.rank:
        # Run it through the agent like any call (arguments are copied, the
        # function runs on the worker pool); the result goes into the owner RRef.
        value: torch.futures.Future = torch.futures.Future()
        request: tuple = (func, payload_args, payload_kwargs)
        if profiled:
            call = profiling.send(agent, peer, CALL, request, timeout, what, "remote", func)
        else:
            call = agent.send(peer, CALL, request, timeout, what)
        rref = RRef._make(ctx, ctx.new_id(), None, peer, value)
        # As torch: the call's outcome is _get_future()'s, and a call that ran
        # past remote()'s timeout is an RRef creation that timed out.
        rref._creation = call
        on_done(call, functools.partial(_complete_created, value, rref._creation_timeout()))
        return rref
    rref_id, fork_id = ctx.new_id(), ctx.new_id()
    with ctx.lock:
        ctx.users.created(rref_id, fork_id, peer.id)
    try:
        # No timeout on the message itself: its answer says whether the owner
        # counted the fork, which the protocol must know. remote()'s timeout
        # applies to the RRef's uses instead (_check_created).
        request = (rref_id, fork_id, func, payload_args, payload_kwargs)
        if profiled:
            creation = profiling.send(agent, peer, RREF_CREATE, request, 0, what, "remote", func)
        else:
            creation = agent.send(peer, RREF_CREATE, request, 0, what)
    except BaseException:
        with ctx.lock:
            ctx.users.forget(fork_id)
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
    ctx = _context()
    with ctx.lock:
        info = {
            "num_owner_rrefs": len(ctx.owners.entries),
            "num_owner_forks": ctx.owners.num_forks(),
            **ctx.users.counts(),
            "num_pending_deletes": ctx.in_flight[RREF_DELETE],
            "num_pending_accepts": ctx.in_flight[RREF_ACCEPT],
        }
    return info


def delete_all_user_rrefs(timeout: float = 300.0) -> None:
    """Let go of every user RRef held on this worker, as if each were dropped,
    and wait until their owners have counted the deletes (torch's
    ``_delete_all_user_and_unforked_owner_rrefs``; ``shutdown`` needs no call
    to it). An RRef object still referenced afterwards must not be used.
    Raises ``RpcError`` if the owners have not answered within ``timeout``."""
    ctx = _context()
    ctx.release_user_forks()
    ctx.drain(timeout)


def owner_forks() -> dict[RRefId, set[ForkId]]:
    """The owner table, for tests and debugging: rref id -> fork ids it counts."""
    ctx = _context()
    with ctx.lock:
        return {rref_id: set(entry.forks) for rref_id, entry in ctx.owners.entries.items()}


__all__ = ["RRef", "delete_all_user_rrefs", "owner_forks", "remote", "rref_debug_info"]
