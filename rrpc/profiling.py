"""Profiling: RPCs in torch's profilers, with the callee's work attributed to them.

Under ``torch.autograd.profiler.profile()`` (Kineto or legacy) and
``torch.profiler.profile()``, every ``rpc_sync`` / ``rpc_async`` /
``remote`` is an event on the caller named as torch names it,
``rpc_async#f(worker0 -> worker1)``, and what the callee ran for it comes back
into the same profile, named ``rpc_async#f(worker0 -> worker1)#remote_op:
aten::add`` with the callee's node id (its rank), as torch does.

Theory of operation

- One check per call. The call paths (``api``, ``rref``) ask
  ``profiler_enabled()`` (torch's thread-local flag, ~30 ns) and come here
  only when it is on. A callee pays nothing: profiled requests are kinds of
  their own (``PROFILED`` | kind), served by ``_serve_profiled``.
- Sessions. What a profile gathers beyond its own thread is kept in a
  ``_Session``: the user's profile on this thread (opened when one of torch's
  profile objects starts, see ``install``), or a profiled request being served
  here (a *callee* session). Events are ``_Event`` tuples with wall-clock
  times, the clock both of torch's profilers use, so the workers of one host
  line up exactly (across hosts, as well as their clocks agree).
- Caller. A call under a user's profile opens torch's ``record_function`` with
  the call's key, sends the request as ``PROFILED | kind`` with payload
  ``(config, request)`` (what the caller's profiler records: shapes, memory,
  stacks), and ends the event through ``_call_end_callbacks_on_future``, which
  ends it under the caller's profiler state on whichever thread the reply
  arrives. The reply is ``(events, value)``: the events go into the session,
  prefixed with the key, before the caller sees the value. Under a profiler
  rrpc does not know (another tool's), the event is recorded without the
  callee's work.
- Callee. ``_serve_profiled`` enables torch's legacy profiler on the thread
  that runs the request, with the caller's config, runs the kind's own
  handler, and disables the profiler as the handler returns. The reply carries
  the events as plain tuples (restricted mode accepts them). An
  ``async_execution`` function's reply waits for its Future; by then the RPCs
  it made are in the session too. Those RPCs are timed here, not by a
  ``record_function``: the thread's profiler is off by the time they end.
  Nested calls nest: what a callee's own callee ran arrives prefixed twice.
- Merging. torch adds remote events in C++, with no Python API, so rrpc adds
  them where torch turns its records into ``FunctionEvent``s:
  ``profiler_legacy._parse_legacy_records`` (legacy) and
  ``profile._parse_kineto_results`` (Kineto). Kineto writes its Chrome trace
  from C++, so ``export_chrome_trace`` appends them to the file. ``install``
  wraps these once, at the first ``init_rpc`` (a profile entered before it is
  one rrpc does not know); a profile without rrpc events gets exactly what
  torch returns.
- Kineto. torch's own framework records no RPC event under Kineto
  (``torch.profiler``); rrpc records the same events as under the legacy
  profiler.
- Distributed backward. ``backward`` under a profile is an event named
  ``torch::distributed::autograd::backward``; the passes its gradients cause
  on this worker's pool (a send record's, torch's ``SendRpcBackward``) run
  under the profiler too and land in the same profile, as in torch, whose
  engine carries the profiler into the graph task.
- Server-process-global profiling (``_server_process_global_profile``, as
  torch's): while one is entered, every call and ``remote()`` this worker
  serves runs under the legacy profiler, and its events go to every entered
  one. Entering the first swaps the handlers; nothing is paid otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import torch
import torch.autograd.profiler as autograd_profiler
import torch.autograd.profiler_legacy as profiler_legacy
from torch.autograd import DeviceType, ProfilerConfig, ProfilerState
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, EventList, FunctionEvent

from rrpc import agent as agent_module
from rrpc import futures
from rrpc.agent import Agent, Deferred
from rrpc.functions import callable_name
from rrpc.futures import Future, on_done, settle
from rrpc.messages import CALL, PROFILED, RREF_CREATE, RpcError, WorkerInfo

log = logging.getLogger("rrpc")

REMOTE_OP = "#remote_op: "  # torch's infix between an RPC's key and a callee's event
BACKWARD_KEY = "torch::distributed::autograd::backward"
SEND_FUNCTION_KEY = "torch::distributed::autograd::SendRpcBackward"

# Whether this thread profiles: torch's thread-local flag, the one check per call.
profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled

_PROFILED_KINDS = (CALL, RREF_CREATE)  # what rpc_sync / rpc_async / remote send


class _Event(NamedTuple):
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


class _Session:
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
        self.events: list[_Event] = []
        self.closed = False
        self.previous: _Session | None = None


class _Local(threading.local):
    session: _Session | None = None  # this thread's current session
    merge: _Session | None = None  # the legacy profile whose records are being parsed


_local = _Local()


def _now_us() -> float:
    return time.time_ns() / 1000


# -- Caller --------------------------------------------------------------------
def send(
    agent: Agent,
    peer: WorkerInfo,
    kind: int,
    request: Any,
    timeout: float,
    what: str,
    mode: str,
    func: Any,
) -> Future:
    """Send a request while this thread profiles; a Future of its reply's value.

    ``mode`` is torch's ``RPCExecMode`` value ("sync", "async", "remote") and
    ``func`` the function the request runs: together they name the event.
    """
    key = f"rpc_{mode}#{event_name(func)}({agent.info.name} -> {peer.name})"
    session = _local.session
    result = Future()
    if session is not None and session.callee:
        start = _now_us()
        reply = agent.send(peer, kind | PROFILED, (session.config, request), timeout, what)
        on_done(reply, functools.partial(_nested_done, session, key, agent.info.id, start, result))
        return result
    # The reply's outcome waits beside the future that ends the event: torch's
    # end-callbacks future would turn an error into a value.
    outcome: list[tuple[Any, BaseException | None]] = []
    arrived: torch.futures.Future = torch.futures.Future()
    with autograd_profiler.record_function(key) as record:
        if session is not None and not session.closed:
            reply = agent.send(peer, kind | PROFILED, (session.config, request), timeout, what)
            on_done(reply, functools.partial(_unwrap, session, key, outcome, arrived))
        else:
            reply = agent.send(peer, kind, request, timeout, what)
            on_done(reply, functools.partial(_unwrap, None, key, outcome, arrived))
        ended = record._call_end_callbacks_on_future(arrived)
    on_done(ended, functools.partial(_settle_from, result, outcome))
    return result


def event_name(func: Any) -> str:
    """How torch names a function in an RPC's event: a builtin by its
    operator (``aten::add``), anything else by its qualified name."""
    return torch.jit._builtins._find_builtin(func) or callable_name(func)


def _unwrap(
    session: _Session | None,
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


def _split(key: str, reply: Any) -> tuple[list[_Event], Any, BaseException | None]:
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
    session: _Session,
    key: str,
    node_id: int,
    start: float,
    result: Future,
    reply: torch.futures.Future,
) -> None:
    """A call a callee made while serving a profiled request: the call itself
    and what its own callee ran go into the callee's session."""
    end = _now_us()
    value, error = futures.outcome(reply)
    events: list[_Event] = []
    if error is None:
        events, value, error = _split(key, value)
    if not session.closed:
        event = _Event(key, node_id, _UNKNOWN_THREAD, start, end, _UNKNOWN_THREAD, [], [], 0, 0,
                       False, False, -1, 0, 0)  # fmt: skip
        session.events.append(event)
        session.events.extend(events)
    settle(result, value, error)


# The type of each _Event field, checked on what a peer sends: a wrong one
# would only fail later, in the caller's profile.
_NUMBER = (int, float)
_FIELD_TYPES: tuple[Any, ...] = (
    str, int, int, _NUMBER, _NUMBER, int, list, list, int, int, bool, bool, int, int, int,
)  # fmt: skip


def _received(key: str, events: Any) -> list[_Event]:
    """A callee's events, checked (they come from a peer) and named under ``key``."""
    prefix = key + REMOTE_OP
    received = []
    try:
        for fields in events:
            event = _Event._make(fields)
            for name, value, kind in zip(_Event._fields, event, _FIELD_TYPES, strict=True):
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
        self.session = _Session((record_shapes, profile_memory, with_stack), callee=True)
        self.profiling = False
        self.local: list[_Event] = []  # what this thread ran, once stopped
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
        self.session.previous, _local.session = _local.session, self.session

    def stop(self) -> None:
        _local.session = self.session.previous
        if not self.profiling:
            return
        self.profiling = False
        records = torch.autograd._disable_profiler_legacy()
        start: Any = next(r for r in itertools.chain(*records) if r.name() == "__start_profile")
        self.thread = start.thread_id()
        self.local = _events_of(_parse_legacy(records), start.start_us())

    def events(self) -> list[tuple]:
        """Everything to send back, as plain tuples; the session closes."""
        self.session.closed = True
        fill = self.thread
        return [
            tuple(e if e.thread != _UNKNOWN_THREAD else e._replace(thread=fill, fwd_thread=fill))
            for e in itertools.chain(self.local, self.session.events)
        ]


def _serve_profiled(agent: Agent, kind: int, payload: tuple, caller: WorkerInfo) -> Any:
    """A request sent under the caller's profiler: run the kind's handler
    under ours; the reply is (events, reply)."""
    config, request = payload
    handler = agent.handlers.get(kind)
    if handler is None:
        raise RpcError(f"{agent.info.name} has no handler for kind {kind}")
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


def _reply_when_done(run: _Run, reply: torch.futures.Future, done: torch.futures.Future) -> None:
    value, error = futures.outcome(done)
    if error is not None:
        reply.set_exception(error)
    else:
        reply.set_result((run.events(), value))


# -- FunctionEvents ⇄ events ----------------------------------------------------
def _events_of(functions: list[FunctionEvent], base_us: float) -> list[_Event]:
    """torch's parsed events (times relative to ``base_us``) as ``_Event``s."""
    return [
        _Event(
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


def _function_events(events: list[_Event], base_us: float, legacy: bool) -> list[FunctionEvent]:
    """``_Event``s as torch's FunctionEvents, times relative to ``base_us``."""
    return [
        FunctionEvent(
            id=e.id,
            name=e.name,
            trace_name=None if e.name == MEMORY_EVENT_NAME else e.name,
            thread=e.thread,
            start_us=e.start_us - base_us,
            end_us=e.end_us - base_us,
            fwd_thread=e.fwd_thread,
            input_shapes=e.input_shapes,
            stack=e.stack,
            scope=e.scope,
            cpu_memory_usage=e.cpu_memory_usage,
            is_async=e.is_async,
            is_remote=e.is_remote,
            sequence_nr=e.sequence_nr,
            node_id=e.node_id,
            device_type=DeviceType.CPU,
            is_legacy=legacy,
            flops=e.flops,
        )
        for e in events
    ]


def _by_time(event: FunctionEvent) -> list[float]:
    return [event.time_range.start, -event.time_range.end]  # torch's order


# -- The bridge into torch's profilers -----------------------------------------
_parse_legacy = profiler_legacy._parse_legacy_records  # torch's, before install()
_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Wrap the places of torch's profilers where rrpc's events go in (once)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for profile in (profiler_legacy.profile, autograd_profiler.profile):
            _wrap(profile, "_start_trace", _start_trace)
            _wrap(profile, "__exit__", _exit)
        profiler_legacy._parse_legacy_records = _parse_legacy_with_rrpc
        _wrap(autograd_profiler.profile, "_parse_kineto_results", _parse_kineto_results)
        _wrap(autograd_profiler.profile, "export_chrome_trace", _export_chrome_trace)
        _installed = True


def _wrap(cls: type, name: str, wrapper: Callable[..., Any]) -> None:
    """Make ``cls.name(...)`` call ``wrapper(original, ...)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    setattr(cls, name, wrapped)


def _start_trace(original: Callable[..., Any], profile: Any) -> Any:
    result = original(profile)
    config = (profile.record_shapes, profile.profile_memory, profile.with_stack)
    session = _Session(config, callee=False)
    profile._rrpc_session = session
    session.previous, _local.session = _local.session, session
    return result


def _exit(original: Callable[..., Any], profile: Any, *exc_info: Any) -> Any:
    session = getattr(profile, "_rrpc_session", None)
    if session is not None and not session.closed:
        session.closed = True  # what arrives later is outside the profile
        previous = session.previous
        if _local.session is session:
            _local.session = previous
        _local.merge = session  # for the legacy parse, which the exit runs here
    try:
        return original(profile, *exc_info)
    finally:
        _local.merge = None


def _parse_legacy_with_rrpc(thread_records: Any) -> list[FunctionEvent]:
    functions = _parse_legacy(thread_records)
    session, _local.merge = _local.merge, None
    if session is not None and session.events:
        start = next(r for r in itertools.chain(*thread_records) if r.name() == "__start_profile")
        functions += _function_events(session.events, start.start_us(), legacy=True)
        functions.sort(key=_by_time)
    return functions


def _parse_kineto_results(original: Callable[..., Any], profile: Any, result: Any, *args, **kw):
    functions = original(profile, result, *args, **kw)
    session = getattr(profile, "_rrpc_session", None)
    if session is not None and session.events:
        base_us = result.trace_start_ns() / 1000
        functions += _function_events(session.events, base_us, legacy=False)
        functions.sort(key=_by_time)
    return functions


def _export_chrome_trace(original: Callable[..., Any], profile: Any, path: str, *args, **kw):
    written = original(profile, path, *args, **kw)
    session = getattr(profile, "_rrpc_session", None)
    # Without Kineto torch writes the trace from the parsed events, rrpc's included.
    if session is not None and session.events and autograd_profiler.kineto_available():
        _append_to_chrome_trace(path, session.events)
    return written


def _append_to_chrome_trace(path: str, events: list[_Event]) -> None:
    """Add rrpc's events to a trace Kineto wrote: each worker a process of its own."""
    try:
        with open(path) as file:
            trace = json.load(file)
        base_us = trace.get("baseTimeNanoseconds", 0) / 1000
        entries = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("rrpc: could not add RPC events to the trace %s: %s", path, exc)
        return
    pids: dict[int, int] = {}
    for event in events:
        if event.name == MEMORY_EVENT_NAME:
            continue
        if event.is_remote:
            pid = pids.get(event.node_id)
            if pid is None:
                pid = pids[event.node_id] = 1 << 30 | event.node_id  # far from real pids
                entries.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                "args": {"name": f"rrpc node {event.node_id}"}})  # fmt: skip
        else:
            pid = os.getpid()
        entries.append({
            "ph": "X", "cat": "cpu_op", "name": event.name, "pid": pid, "tid": event.thread,
            "ts": event.start_us - base_us, "dur": event.end_us - event.start_us,
            "args": {"Node Id": event.node_id, "Remote": event.is_remote},
        })  # fmt: skip
    with open(path, "w") as file:
        json.dump(trace, file)


# -- Distributed backward --------------------------------------------------------
_graph_sessions: dict[int, _Session] = {}  # autograd context id -> the profile its backward runs in


def backward_pass(context_id: int) -> contextlib.AbstractContextManager[Any]:
    """Around ``rrpc.autograd.backward``: its event, and the passes it causes
    on this worker's pool attributed to this thread's profile."""
    if not profiler_enabled():
        return contextlib.nullcontext()
    return _profiled_backward(context_id)


@contextlib.contextmanager
def _profiled_backward(context_id: int) -> Iterator[None]:
    session = _local.session
    with autograd_profiler.record_function(BACKWARD_KEY):
        if session is not None and not session.callee:
            _graph_sessions[context_id] = session
        try:
            yield
        finally:
            if _graph_sessions.get(context_id) is session:
                del _graph_sessions[context_id]


def send_function_pass(context_id: int) -> contextlib.AbstractContextManager[Any]:
    """Around the pass of a send record's gradients: profiled into the
    profile of a ``backward`` running on this worker in ``context_id``."""
    session = _graph_sessions.get(context_id) if _graph_sessions else None
    if session is None:
        return contextlib.nullcontext()
    return _profiled_send_function(session)


@contextlib.contextmanager
def _profiled_send_function(session: _Session) -> Iterator[None]:
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
class _ServerProfiles:
    """The ``_server_process_global_profile``s entered on this worker, and the
    handlers swapped in while there is any."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered: list[_server_process_global_profile] = []
        self.swapped: tuple[Agent, dict[int, Any]] | None = None

    def enter(self, profile: _server_process_global_profile) -> None:
        with self.lock:
            if not self.entered:
                agent = agent_module.current_agent()
                originals = {kind: agent.handlers[kind] for kind in _PROFILED_KINDS}
                for kind, handler in originals.items():
                    agent.register(kind, functools.partial(self._serve, handler))
                self.swapped = agent, originals
            self.entered.append(profile)

    def exit(self, profile: _server_process_global_profile) -> None:
        with self.lock:
            self.entered.remove(profile)
            if not self.entered and self.swapped is not None:
                agent, originals = self.swapped
                for kind, handler in originals.items():
                    agent.register(kind, handler)
                self.swapped = None

    def _serve(self, handler: Callable[[Any, WorkerInfo], Any], payload: Any, caller: WorkerInfo):
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
                profile._gathered.append(run.local)


_server_profiles = _ServerProfiles()


class _server_process_global_profile(profiler_legacy.profile):
    """Profile every request this worker serves, on any thread, while entered
    (torch's ``rpc._server_process_global_profile``, same arguments and results).

    Entered ones nest: each gets the requests served while it is entered.
    After exit, ``function_events`` (and ``key_averages()``, ``table()``, ...)
    hold them all and ``process_global_function_events`` one list per request.

    Example (the callee profiles what it serves, driven by the caller)::

        profile = rrpc.remote("worker1", rrpc._server_process_global_profile)
        profile.rpc_sync().__enter__()
        rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        profile.rpc_sync().__exit__(None, None, None)
        print(profile.rpc_sync().key_averages())
    """

    def config_flags(self) -> tuple[bool, bool, bool]:
        return self.record_shapes, self.profile_memory, self.with_stack

    def __enter__(self) -> _server_process_global_profile | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("Profiler context manager is not reentrant")
        self.entered = True
        self._base_us = _now_us()
        self._gathered: list[list[_Event]] = []
        _server_profiles.enter(self)
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Literal[False]:
        if not self.enabled:
            return False
        _server_profiles.exit(self)
        per_request = [
            sorted(_function_events(events, self._base_us, legacy=True), key=_by_time)
            for events in self._gathered
        ]
        self.function_events = EventList(
            list(itertools.chain.from_iterable(per_request)),
            use_device=None,
            profile_memory=self.profile_memory,
            with_flops=self.with_flops,
        )
        self.function_events._build_tree()
        self.process_global_function_events = per_request
        return False


# -- Start ---------------------------------------------------------------------
def _on_start(agent: Agent) -> None:
    install()
    # The node id torch's legacy profiler gives this worker's own events.
    set_node_id = getattr(torch._C, "_distributed_rpc", None)
    if set_node_id is not None and hasattr(set_node_id, "_set_profiler_node_id"):
        set_node_id._set_profiler_node_id(agent.info.id)
    for kind in _PROFILED_KINDS:
        agent.register(kind | PROFILED, functools.partial(_serve_profiled, agent, kind))


agent_module.on_start.append(_on_start)
