"""rrpc's events in torch's profilers: patched profile classes, the server-global profile.

``profiling.py`` records what RPCs ran, on both sides, into ``Session``s;
this file is where those events meet torch.

- Merging. torch adds remote events in C++, with no Python API, so rrpc adds
  them where torch turns its records into ``FunctionEvent``s:
  ``profiler_legacy._parse_legacy_records`` (legacy) and
  ``profile._parse_kineto_results`` (Kineto). Kineto writes its Chrome trace
  from C++, so ``export_chrome_trace`` appends them to the file. ``install``
  wraps these once, at the first ``init_rpc`` (a profile entered before it is
  one rrpc does not know); a profile without rrpc events gets exactly what
  torch returns. A profile's session opens as the profile starts its trace and
  closes as it exits.
- Kineto. torch's own framework records no RPC event under Kineto
  (``torch.profiler``); rrpc records the same events as under the legacy
  profiler.
- Server-process-global profiling (``_server_process_global_profile``, as
  torch's): while one is entered, every call and ``remote()`` this worker
  serves runs under the legacy profiler (``profiling.ServerProfiles`` of the
  run), and its events go to every entered one.

The patches are process-wide and stay: torch's classes are the process's, and
an unpatched profile costs nothing more than torch's own.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch.autograd.profiler as autograd_profiler
import torch.autograd.profiler_legacy as profiler_legacy
from torch.autograd import DeviceType
from torch.autograd.profiler_util import MEMORY_EVENT_NAME, EventList, FunctionEvent

from rrpc.agent import current_agent
from rrpc.profiling import (
    Event,
    ServerProfiles,
    Session,
    current_session,
    local,
    now_us,
    parse_legacy_records,
)

log = logging.getLogger("rrpc")

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
    session = Session(config, callee=False)
    profile._rrpc_session = session
    session.previous, local.session = current_session(), session
    return result


def _exit(original: Callable[..., Any], profile: Any, *exc_info: Any) -> Any:
    session = getattr(profile, "_rrpc_session", None)
    if session is not None and not session.closed:
        session.closed = True  # what arrives later is outside the profile
        previous = session.previous
        if local.session is session:
            local.session = previous
        local.merge = session  # for the legacy parse, which the exit runs here
    try:
        return original(profile, *exc_info)
    finally:
        local.merge = None


def _parse_legacy_with_rrpc(thread_records: Any) -> list[FunctionEvent]:
    functions = parse_legacy_records(thread_records)
    session, local.merge = local.merge, None
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


def _append_to_chrome_trace(path: str, events: list[Event]) -> None:
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


def _function_events(events: list[Event], base_us: float, legacy: bool) -> list[FunctionEvent]:
    """``Event``s as torch's FunctionEvents, times relative to ``base_us``."""
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


# -- Server-process-global profiling ---------------------------------------------
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

    def add_request(self, events: list[Event]) -> None:
        """What one request served while this profile was entered ran."""
        self._gathered.append(events)

    def __enter__(self) -> _server_process_global_profile | None:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("Profiler context manager is not reentrant")
        self.entered = True
        self._base_us = now_us()
        self._gathered: list[list[Event]] = []
        # The run's, kept: the profile leaves the one it entered.
        self._server_profiles: ServerProfiles = current_agent().profiling.server_profiles
        self._server_profiles.enter(self)
        return self

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to a caller (``__enter__`` returns the profile) carries
        # what it gathered, not the run's table of entered profiles.
        state = dict(self.__dict__)
        state.pop("_server_profiles", None)
        return state

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Literal[False]:
        if not self.enabled:
            return False
        self._server_profiles.exit(self)
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
