"""What one ``init_rpc`` runs: its services, the kinds each serves, the order they start and stop.

Rules:

- One place. ``start_services`` builds every service of the run, in the order
  of the table below, on the agent that ``init_rpc`` made; the agent holds
  them (``agent.profiling``, ``agent.autograd``, ``agent.rrefs``, ...) and the
  public functions of ``rref`` and ``autograd`` find theirs there, through
  the current agent. Nothing starts because a module was imported.
- Every handler is registered before a peer can learn this worker's address
  (``init_rpc`` starts the services before it meets the others).
- ``drain_services`` is a graceful shutdown's first step: the protocols finish
  this worker's own traffic. ``stop_services`` runs after the agent stopped
  (nothing arrives any more) and stops them in the reverse order.
- This module sits above the protocols (it imports them); they import only
  downward (agent, codec, futures, messages).

The services, in the order they start (they stop in the reverse order):

=========  ==============================================  =========================
service    serves (message kinds)                          also
=========  ==============================================  =========================
calls      CALL (``run_call``; ``run_restricted_call`` in  -
           restricted mode)
profiling  CALL | PROFILED, RREF_CREATE | PROFILED         a send layer; torch's
                                                           profile classes patched
                                                           (once per process)
autograd   AUTOGRAD_BACKWARD, AUTOGRAD_RELEASE             ``agent.autograd_hooks``
rrefs      RREF_CREATE, RREF_FETCH, RREF_FORK,             the ``rrpc-rref-<name>``
           RREF_ACCEPT, RREF_DELETE, RREF_CREATE_FAILED    sender thread; drained
exporter   Prometheus scrapes over HTTP (``metrics_port``) -
=========  ==============================================  =========================

A dynamic group's membership (``agent.group``) joins after they start, as
``init_rpc``'s rendezvous step; ``shutdown`` leaves the group after they
drained and before they stop.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from rrpc import functions, futures, metrics, rref, torch_profiler
from rrpc.agent import Agent
from rrpc.autograd import Autograd
from rrpc.dispatch import Deferred
from rrpc.functions import async_result_error, is_async_execution
from rrpc.messages import (
    AUTOGRAD_BACKWARD,
    AUTOGRAD_RELEASE,
    CALL,
    PROFILED,
    RREF_ACCEPT,
    RREF_CREATE,
    RREF_CREATE_FAILED,
    RREF_DELETE,
    RREF_FETCH,
    RREF_FORK,
    WorkerInfo,
)
from rrpc.profiling import PROFILED_KINDS, Profiling
from rrpc.rref_service import RRefService


def start_services(agent: Agent) -> None:
    """Build and start this run's services on ``agent`` (see the table above)."""
    agent.register(CALL, run_restricted_call if agent.options.restricted else run_call)

    torch_profiler.install()  # process-wide, once: where rrpc's events join torch's profiles
    futures.install_collect_all()  # process-wide: its callbacks off the transport
    profiling = agent.profiling = Profiling(agent)
    for kind in PROFILED_KINDS:  # a call or remote() made under the caller's profiler
        agent.register(kind | PROFILED, functools.partial(profiling.serve, kind))
    agent.add_send_layer(profiling.send_layer)  # a user's call under a profiler is an event

    autograd = agent.autograd = Autograd(agent, profiling)
    agent.register(AUTOGRAD_BACKWARD, autograd.serve_backward)
    agent.register(AUTOGRAD_RELEASE, autograd.releases.serve)
    agent.autograd_hooks = autograd.hooks

    rrefs = agent.rrefs = RRefService(agent, rref.placeholder)
    agent.register(RREF_CREATE, rrefs.serve_create)
    agent.register(RREF_FETCH, rrefs.serve_fetch)
    agent.register(RREF_FORK, rrefs.serve_fork)
    agent.register(RREF_ACCEPT, rrefs.serve_accept)
    agent.register(RREF_DELETE, rrefs.serve_delete)
    agent.register(RREF_CREATE_FAILED, rrefs.serve_create_failed)

    port = agent.options.metrics_port
    if port:
        host = agent.address.rsplit(":", 1)[0].strip("[]")  # the worker's own host
        agent.exporter = metrics.Exporter(
            host, port, agent.info.name, agent.metrics, functools.partial(worker_stats, agent)
        )


def drain_services(agent: Agent, timeout: float) -> None:
    """A graceful shutdown's first step: wait (up to ``timeout`` seconds)
    until the protocols' own messages are answered."""
    agent.autograd.releases.flush()  # gathered releases go now, not after the agent stopped
    if agent.group is not None:  # leaving a group that goes on: let go of the RRefs held here
        agent.rrefs.release_user_forks()
    agent.rrefs.drain(timeout)


def stop_services(agent: Agent, until: float | None = None) -> None:
    """Stop what ``start_services`` started, in the reverse order, once the
    agent has stopped; the services are forgotten. Safe after a partial start.
    Their threads get until ``until`` (``time.monotonic()``; by default 5 s
    from now) to end; one still busy then ends by itself (they are daemons)."""
    if until is None:
        until = time.monotonic() + 5.0
    exporter, agent.exporter = agent.exporter, None
    if exporter is not None:
        exporter.stop()
    if agent.rrefs is not None:
        agent.rrefs.stop(max(0.0, until - time.monotonic()))
        agent.rrefs = None
    if agent.autograd is not None:
        agent.autograd.stop()
        agent.autograd = None
    agent.profiling = None


def worker_stats(agent: Agent) -> dict[str, float]:
    """``rrpc.stats("worker")`` of ``agent``: what is open or queued, and the
    services' tables' sizes."""
    gauges: dict[str, float] = {"in_flight": len(agent.calls), "queue_depth": agent.queue_depth()}
    gauges.update(agent.rrefs.debug_info())
    gauges.update({f"autograd_{name}": n for name, n in agent.autograd.debug_info().items()})
    return gauges


def run_restricted_call(payload: tuple, caller: WorkerInfo) -> Any:
    """CALL in restricted mode: only what this worker exposed (``functions.check_call``)."""
    functions.check_call(payload[0])
    return run_call(payload, caller)


def run_call(payload: tuple, caller: WorkerInfo) -> Any:
    """CALL: ``func(*args, **kwargs)``; an ``async_execution`` function's reply
    waits for its Future."""
    func, args, kwargs = payload
    if is_async_execution(func):
        future = func(*args, **kwargs)
        error = async_result_error(func, future)
        if error is not None:
            raise error
        return Deferred(future)
    try:
        return func(*args, **kwargs)
    except TypeError:
        mismatch = functions.builtin_argument_error(func, args, kwargs)
        if mismatch is None:
            raise
    raise mismatch  # a builtin's wrong arguments: torch's RuntimeError, as torch raises it
