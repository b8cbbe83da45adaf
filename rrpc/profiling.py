"""Profiling: RPCs as events in torch's profilers, the callee's work attributed to them.

Under ``torch.autograd.profiler.profile()`` (Kineto or legacy) and
``torch.profiler.profile()``, every ``rpc_sync`` / ``rpc_async`` /
``remote`` is an event on the caller named as torch names it,
``rpc_async#f(worker0 -> worker1)``, and what the callee ran for it comes back
into the same profile, named ``rpc_async#f(worker0 -> worker1)#remote_op:
aten::add`` with the callee's node id (its rank), as torch does.

This file records the events: on the send path, on the callee, around
distributed backward passes. ``torch_profiler.py`` puts them into torch's
profiles (its patches to torch's profile classes) and holds the
server-process-global profile.

Theory of operation

- One check per call. ``Profiling.send_layer`` is a layer of the agent's send
  path (``Agent.add_send_layer``). A user's call (a send with a ``mode``:
  ``rpc_sync``, ``rpc_async``, ``remote``, RRef proxies) asks
  ``profiler_enabled()`` (torch's thread-local flag, ~30 ns) and is recorded
  only when it is on; rrpc's own messages go on untouched. A callee pays
  nothing: profiled requests are kinds of their own (``PROFILED`` | kind),
  served by ``Profiling.serve``.
- Sessions. What a profile gathers beyond its own thread is kept in a
  ``Session``: the user's profile on this thread (opened when one of torch's
  profile objects starts, ``torch_profiler.install``), or a profiled request
  being served here (a *callee* session). Events are ``Event`` tuples with
  wall-clock times, the clock both of torch's profilers use, so the workers of
  one host line up exactly (across hosts, as well as their clocks agree).
- Caller. A call under a user's profile opens torch's ``record_function`` with
  the call's key, sends the request as ``PROFILED | kind`` with payload
  ``(config, request)`` (what the caller's profiler records: shapes, memory,
  stacks), and ends the event through ``_call_end_callbacks_on_future``, which
  ends it under the caller's profiler state on whichever thread the reply
  arrives. The reply is ``(events, value)``: the events go into the session,
  prefixed with the key, before the caller sees the value. Under a profiler
  rrpc does not know (another tool's), the event is recorded without the
  callee's work.
- Callee. ``Profiling.serve`` enables torch's legacy profiler on the thread
  that runs the request, with the caller's config, runs the kind's own
  handler, and disables the profiler as the handler returns. The reply carries
  the events as plain tuples (restricted mode accepts them). An
  ``async_execution`` function's reply waits for its Future; by then the RPCs
  it made are in the session too. Those RPCs are timed here, not by a
  ``record_function``: the thread's profiler is off by the time they end.
  Nested calls nest: what a callee's own callee ran arrives prefixed twice.
- Distributed backward. ``backward`` under a profile is an event named
  ``torch::distributed::autograd::backward``; the passes its gradients cause
  on this worker's pool (a send record's, torch's ``SendRpcBackward``) run
  under the profiler too and land in the same profile, as in torch, whose
  engine carries the profiler into the graph task.
- Server-process-global profiling (``ServerProfiles``): while one is entered,
  every call and ``remote()`` this worker serves runs under the legacy
  profiler, and its events go to every entered one. Entering the first swaps
  the handlers; nothing is paid otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.autograd.profiler as autograd_profiler
import torch.autograd.profiler_legacy as profiler_legacy
from torch.autograd import ProfilerConfig, ProfilerState
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, FunctionEvent

from rrpc import futures
from rrpc.agent import Agent, Send
from rrpc.dispatch import Deferred, Handler
from rrpc.functions import callable_name
from rrpc.futures import Future, on_done, settle
from rrpc.messages import CALL, PROFILED, RREF_CREATE, RpcError, What, WorkerInfo

log = logging.getLogger("rrpc")

REMOTE_OP = "#remote_op: "  # torch's infix between an RPC's key and a callee's event
BACKWARD_KEY = "torch::distributed::autograd::backward"
SEND_FUNCTION_KEY = "torch::distributed::autograd::SendRpcBackward"

# Whether this thread profiles: torch's thread-local flag, the one check per call.
profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled

PROFILED_KINDS = (CALL, RREF_CREATE)  # what rpc_sync / rpc_async / remote send

# torch's own parse of legacy records, taken before ``torch_profiler.install``
# wraps it: a callee's events are parsed without any session's merged in.
parse_legacy_records = profiler_legacy._parse_legacy_records


class Event(NamedTuple):
    """One event, as it travels and waits in a session (wall-clock microseconds)."""

    name: str
    node_id: int
    thread: int
    start_us: float
    end_us: float
    fwd_thread: int
    input_shapes: list
    stack: list
    scope: int
    cpu_memory_usage: int
    is_async: bool
    is_remote: bool
    sequence_nr: int
    flops: int
    id: int


_UNKNOWN_THREAD = -1  # a callee session's own events: its thread is learned at its end


class Session:
    """What one profile gathers from other threads and workers.

    ``config``: (record_shapes, profile_memory, with_stack) of the profile,
    sent with each profiled request. ``callee``: a profiled request served
    here, whose events go back with its reply. ``events`` is appended to from
    reply threads (``list.extend`` is atomic); nothing is added once ``closed``.
    """

    __slots__ = ("config", "callee", "events", "closed", "previous")

    def __init__(self, config: tuple[bool, bool, bool], callee: bool):
        self.config = config
        self.callee = callee
        self.events: list[Event] = []
        self.closed = False
        self.previous: Session | None = None


class _Local(threading.local):
    session: Session | None = None  # this thread's current session
    merge: Session | None = None  # the legacy profile whose records are being parsed


# Per thread, not per run: a user's profile may outlive an init_rpc .. shutdown.
local = _Local()


def current_session() -> Session | None:
    """This thread's innermost open session. A profile stopped on another
    thread than the one that started it cannot unlink its session from that
    one's: closed sessions are dropped here, as the thread next looks (else
    each such profile's events stayed alive, chained to the next one's)."""
    session = local.session
    if session is not None and session.closed:
        while session is not None and session.closed:
            session = session.previous
        local.session = session
    return session


def now_us() -> float:
    return time.time_ns() / 1000


class Profiling:
    """Profiling's part of one run: its send layer, its handlers of profiled
    requests (``serve``), the backward passes being profiled and the
    server-process-global profiles entered (``server_profiles``)."""

    def __init__(self, agent: Agent):
        self.agent = agent
        # autograd context id -> the profile its backward runs in
        self.graph_sessions: dict[int, Session] = {}
        self.server_profiles = ServerProfiles(agent)
        # The node id torch's legacy profiler gives this worker's own events.
        bindings = getattr(torch._C, "_distributed_rpc", None)
        if bindings is not None and hasattr(bindings, "_set_profiler_node_id"):
            bindings._set_profiler_node_id(agent.info.id)

    # -- Caller ------------------------------------------------------------------
    def send_layer(self, send: Send) -> Send:
        """The agent's send layer around ``send``: a user's call made while this
        thread profiles is recorded, and its reply is a Future of the value
        (see the module doc); anything else goes on as it is."""

        def send_profiled_if_profiling(
            peer: WorkerInfo,
            kind: int,
            obj: Any,
            timeout: float,
            what: What,
            sync: bool = False,
            mode: str | None = None,
        ) -> Any:
            if mode is None or not profiler_enabled():  # the one check a call pays
                return send(peer, kind, obj, timeout, what, sync, mode)
            return self._send_profiled(send, peer, kind, obj, timeout, what, mode)

        return send_profiled_if_profiling

    def _send_profiled(
        self,
        send: Send,
        peer: WorkerInfo,
        kind: int,
        request: Any,
        timeout: float,
        what: What,
        mode: str,
    ) -> Future:
        """Send a user's call while this thread profiles. ``mode`` is torch's
        ``RPCExecMode`` value ("sync", "async", "remote"); with the function the
        request runs it names the event."""
        func = request[2] if kind == RREF_CREATE else request[0]
        agent = self.agent
        key = f"rpc_{mode}#{event_name(func)}({agent.info.name} -> {peer.name})"
        session = current_session()
        result = Future()
        if session is not None and session.callee:
            start = now_us()
            reply = send(peer, kind | PROFILED, (session.config, request), timeout, what)
            on_done(
                reply, functools.partial(_nested_done, session, key, agent.info.id, start, result)
            )
            return result
        # The reply's outcome waits beside the future that ends the event: torch's
        # end-callbacks future would turn an error into a value.
        outcome: list[tuple[Any, BaseException | None]] = []
        arrived: torch.futures.Future = torch.futures.Future()
        with autograd_profiler.record_function(key) as record:
            if session is not None and not session.closed:
                reply = send(peer, kind | PROFILED, (session.config, request), timeout, what)
                on_done(reply, functools.partial(_unwrap, session, key, outcome, arrived))
            else:
                reply = send(peer, kind, request, timeout, what)
                on_done(reply, functools.partial(_unwrap, None, key, outcome, arrived))
            ended = record._call_end_callbacks_on_future(arrived)
        on_done(ended, functools.partial(_settle_from, result, outcome))
        return result

    # -- Callee ------------------------------------------------------------------
    def serve(self, kind: int, payload: tuple, caller: WorkerInfo) -> Any:
        """A request sent under the caller's profiler (``PROFILED | kind``): run
        the kind's handler under ours; the reply is (events, reply)."""
        config, request = payload
        handler = self.agent.handlers.get(kind)
        if handler is None:
            raise RpcError(f"{self.agent.info.name} has no handler for kind {kind}")
        run = _Run(config)
        run.start()
        try:
            result = handler(request, caller)
        finally:
            run.stop()
        if isinstance(result, Deferred):
            reply: torch.futures.Future = torch.futures.Future()
            on_done(result.future, functools.partial(_reply_when_done, run, reply))
            return Deferred(reply)
        return run.events(), result

    # -- Distributed backward ----------------------------------------------------
    def backward_pass(self, context_id: int) -> contextlib.AbstractContextManager[Any]:
        """Around ``rrpc.autograd.backward``: its event, and the passes it causes
        on this worker's pool attributed to this thread's profile."""
        if not profiler_enabled():
            return contextlib.nullcontext()
        return self._profiled_backward(context_id)

    @contextlib.contextmanager
    def _profiled_backward(self, context_id: int) -> Iterator[None]:
        session = current_session()
        with autograd_profiler.record_function(BACKWARD_KEY):
            if session is not None and not session.callee:
                self.graph_sessions[context_id] = session
            try:
                yield
            finally:
                if self.graph_sessions.get(context_id) is session:
                    del self.graph_sessions[context_id]

    def send_function_pass(self, context_id: int) -> contextlib.AbstractContextManager[Any]:
        """Around the pass of a send record's gradients: profiled into the
        profile of a ``backward`` running on this worker in ``context_id``."""
        session = self.graph_sessions.get(context_id) if self.graph_sessions else None
        if session is None:
            return contextlib.nullcontext()
        return _profiled_send_function(session)


def event_name(func: Any) -> str:
    """How torch names a function in an RPC's event: a builtin by its
    operator (``aten::add``), anything else by its qualified name."""
    return torch.jit._builtins._find_builtin(func) or callable_name(func)


def _unwrap(
    session: Session | None,
    key: str,
    outcome: list[tuple[Any, BaseException | None]],
    arrived: torch.futures.Future,
    reply: torch.futures.Future,
) -> None:
    """The reply came: a profiled one's events into the session; the event ends."""
    value, error = futures.outcome(reply)
    if error is None and session is not None:
        events, value, error = _split(key, value)
        if not session.closed:
            session.events.extend(events)
    outcome.append((value, error))
    arrived.set_result(None)


def _split(key: str, reply: Any) -> tuple[list[Event], Any, BaseException | None]:
    """A profiled reply's (events, value), its events named under ``key``; an
    error if it is no such pair (it comes from a peer)."""
    if not (isinstance(reply, tuple) and len(reply) == 2):
        return [], None, RpcError(f"{key}: the callee's reply is not (events, value)")
    return _received(key, reply[0]), reply[1], None


def _settle_from(
    result: Future, outcome: list[tuple[Any, BaseException | None]], ended: Any
) -> None:
    value, error = outcome[0]
    settle(result, value, error)


def _nested_done(
    session: Session,
    key: str,
    node_id: int,
    start: float,
    result: Future,
    reply: torch.futures.Future,
) -> None:
    """A call a callee made while serving a profiled request: the call itself
    and what its own callee ran go into the callee's session."""
    end = now_us()
    value, error = futures.outcome(reply)
    events: list[Event] = []
    if error is None:
        events, value, error = _split(key, value)
    if not session.closed:
        event = Event(key, node_id, _UNKNOWN_THREAD, start, end, _UNKNOWN_THREAD, [], [], 0, 0,
                      False, False, -1, 0, 0)  # fmt: skip
        session.events.append(event)
        session.events.extend(events)
    settle(result, value, error)


# The type of each Event field, checked on what a peer sends: a wrong one
# would only fail later, in the caller's profile.
_NUMBER = (int, float)
_FIELD_TYPES: tuple[Any, ...] = (
    str, int, int, _NUMBER, _NUMBER, int, list, list, int, int, bool, bool, int, int, int,
)  # fmt: skip


def _received(key: str, events: Any) -> list[Event]:
    """A callee's events, checked (they come from a peer) and named under ``key``."""
    prefix = key + REMOTE_OP
    received = []
    try:
        for fields in events:
            event = Event._make(fields)
            for name, value, kind in zip(Event._fields, event, _FIELD_TYPES, strict=True):
                if not isinstance(value, kind):
                    raise TypeError(f"{name} is a {type(value).__name__}")
            name = event.name if event.name == MEMORY_EVENT_NAME else prefix + event.name
            received.append(event._replace(name=name, is_remote=True))
    except (TypeError, ValueError) as exc:
        log.warning("rrpc: dropped the profiler events of %s: malformed (%s)", key, exc)
        return []
    return received


# -- Callee --------------------------------------------------------------------
class _Run:
    """torch's legacy profiler on the thread serving one request: ``start``,
    the handler, ``stop``; ``events()`` once the reply is ready."""

    def __init__(self, config: Any):
        record_shapes, profile_memory, with_stack = (bool(flag) for flag in config)
        self.session = Session((record_shapes, profile_memory, with_stack), callee=True)
        self.profiling = False
        self.local: list[Event] = []  # what this thread ran, once stopped
        self.thread = _UNKNOWN_THREAD

    def start(self) -> None:
        # A thread already profiled (by the server-process-global profiler, or
        # a request run by a thread that profiles) keeps its profiler.
        if not profiler_enabled():
            record_shapes, profile_memory, with_stack = self.session.config
            config = ProfilerConfig(
                ProfilerState.CPU, record_shapes, profile_memory, with_stack, False, False,
                torch._C._profiler._ExperimentalConfig(),
            )  # fmt: skip
            torch.autograd._enable_profiler_legacy(config)
            self.profiling = True
        self.session.previous, local.session = current_session(), self.session

    def stop(self) -> None:
        local.session = self.session.previous
        if not self.profiling:
            return
        self.profiling = False
        records = torch.autograd._disable_profiler_legacy()
        start: Any = next(r for r in itertools.chain(*records) if r.name() == "__start_profile")
        self.thread = start.thread_id()
        self.local = _events_of(parse_legacy_records(records), start.start_us())

    def events(self) -> list[tuple]:
        """Everything to send back, as plain tuples; the session closes."""
        self.session.closed = True
        fill = self.thread
        return [
            tuple(e if e.thread != _UNKNOWN_THREAD else e._replace(thread=fill, fwd_thread=fill))
            for e in itertools.chain(self.local, self.session.events)
        ]


def _reply_when_done(run: _Run, reply: torch.futures.Future, done: torch.futures.Future) -> None:
    value, error = futures.outcome(done)
    if error is not None:
        reply.set_exception(error)
    else:
        reply.set_result((run.events(), value))


def _events_of(functions: list[FunctionEvent], base_us: float) -> list[Event]:
    """torch's parsed events (times relative to ``base_us``) as ``Event``s."""
    return [
        Event(
            e.name,
            e.node_id,
            e.thread,
            base_us + e.time_range.start,
            base_us + e.time_range.end,
            e.fwd_thread if e.fwd_thread is not None else e.thread,
            list(e.input_shapes or []),
            list(e.stack or []),
            e.scope,
            e.cpu_memory_usage,
            e.is_async,
            e.is_remote,
            e.sequence_nr,
            e.flops or 0,
            e.id,
        )  # fmt: skip
        for e in functions
    ]


@contextlib.contextmanager
def _profiled_send_function(session: Session) -> Iterator[None]:
    run = _Run(session.config)
    run.start()
    try:
        with autograd_profiler.record_function(SEND_FUNCTION_KEY):
            yield
    finally:
        run.stop()
        if not session.closed:
            session.events.extend(run.local)


# -- Server-process-global profiling ---------------------------------------------
class ServerProfiles:
    """The server-process-global profiles entered on this worker
    (``torch_profiler._server_process_global_profile``), and the handlers
    swapped in while there is any.

    A profile gives ``config_flags()`` (what to record) and takes
    ``add_request(events)`` (what one request served meanwhile ran)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.lock = threading.Lock()
        self.entered: list[Any] = []
        self.originals: dict[int, Handler] = {}  # while any is entered

    def enter(self, profile: Any) -> None:
        with self.lock:
            if not self.entered:
                agent = self.agent
                self.originals = {kind: agent.handlers[kind] for kind in PROFILED_KINDS}
                for kind, handler in self.originals.items():
                    agent.register(kind, functools.partial(self._serve, handler))
            self.entered.append(profile)

    def exit(self, profile: Any) -> None:
        with self.lock:
            self.entered.remove(profile)
            if not self.entered:
                for kind, handler in self.originals.items():
                    self.agent.register(kind, handler)
                self.originals = {}

    def _serve(self, handler: Handler, payload: Any, caller: WorkerInfo) -> Any:
        with self.lock:
            profiles = list(self.entered)
        if not profiles or profiler_enabled():
            return handler(payload, caller)
        run = _Run(profiles[-1].config_flags())
        run.start()
        try:
            return handler(payload, caller)
        finally:
            run.stop()
            for profile in profiles:
                profile.add_request(run.local)
