"""Fault injection, for tests: fail or delay chosen messages a worker sends.

This is rrpc's ``FaultyTensorPipeRpcBackendOptions`` (torch's fault-injecting
test agent, ``torch.distributed.rpc._testing``): the same three switches,
with torch's message-type names, so that a test written for torch's faulty
agent runs on rrpc unchanged.

Theory of operation: ``init_rpc`` with a ``FaultyRpcBackendOptions`` gives the
agent an ``Injector`` (``injector``; None for any other options, and then the
agent's send path has nothing more to do than test that it is None). The
agent encodes a request, records it as pending (its deadline runs from now)
and hands the frame to ``Injector.send`` instead of the stream. The injector
names the message as torch would (``torch_name``) and then:

- **fails it** if the name is in ``messages_to_fail`` and fewer than
  ``num_fail_sends`` sends of the same message have failed: nothing goes on
  the wire and the call fails at once with ``InjectedFailure``, naming the
  message and the attempt. "The same message" is, as in torch, one with the
  same name and the same payload bytes: a sender that retries gets through on
  attempt ``num_fail_sends + 1``, while the next call of a different content
  starts its own count;
- otherwise **delays it** if the name is in ``messages_to_delay``: the frame
  goes onto the stream that many seconds later, from the run's scheduler
  (``scheduler.Scheduler``: queueing a frame does not block). The caller
  does not wait (torch blocks the sending thread instead); its timeout runs
  meanwhile, as in torch, so a delay longer than the timeout fails the call
  with the usual timeout error while the message still reaches the peer
  late. A delayed message may be overtaken by later ones;
- otherwise sends it.

Only requests are touched, never replies (torch's reply types are not among
the names it accepts either).

Names (torch's, those its faulty agent accepts) and what they select in rrpc:

| torch's name                 | rrpc's message                                            |
|------------------------------|-----------------------------------------------------------|
| PYTHON_CALL                  | CALL of a Python function                                 |
| SCRIPT_CALL                  | CALL of a builtin operator (torch.add)                    |
| PYTHON_REMOTE_CALL           | RREF_CREATE of a Python function (remote(); to this       |
|                              | worker itself, the CALL it runs as)                       |
| SCRIPT_REMOTE_CALL           | the same, of a builtin operator                           |
| PYTHON_RREF_FETCH_CALL       | RREF_FETCH (to_here())                                    |
| SCRIPT_RREF_FETCH_CALL       | RREF_FETCH too: rrpc's fetch does not know how the value  |
|                              | was made; with both delayed, the longer delay applies     |
| RREF_FORK_REQUEST            | RREF_FORK                                                 |
| RREF_CHILD_ACCEPT            | RREF_ACCEPT                                               |
| RREF_USER_DELETE             | RREF_DELETE                                               |
| CLEANUP_AUTOGRAD_CONTEXT_REQ | AUTOGRAD_RELEASE                                          |

Builtin or Python is torch's own rule (``torch.jit._builtins._find_builtin``,
or a ``ScriptFunction``). A call inside a distributed autograd context that
carries tensors requiring grad is what torch sends as ``FORWARD_AUTOGRAD_REQ``,
which its faulty agent cannot target: it is never failed nor delayed here
either.

As torch does, rrpc sends its protocol messages (RRef forks, accepts,
deletes, autograd releases) again when the injector failed them
(``Agent.send_reliably``: after 0.1 s, doubling, up to 5 times), so with
torch's ``num_fail_sends=3`` each goes through on its fourth send. Calls and
``remote()`` are not sent again: their caller sees the failure.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rrpc import metrics, wire
from rrpc.calls import CallTable
from rrpc.futures import settle
from rrpc.messages import (
    AUTOGRAD_RELEASE,
    CALL,
    RREF_ACCEPT,
    RREF_CREATE,
    RREF_DELETE,
    RREF_FETCH,
    RREF_FORK,
    RpcError,
    What,
    WorkerInfo,
    thread_state,
)
from rrpc.options import RpcBackendOptions
from rrpc.scheduler import Scheduler

# torch's names, each with what the message does (for error messages).
MESSAGE_TYPES = {
    "PYTHON_CALL": "call",
    "SCRIPT_CALL": "call",
    "PYTHON_REMOTE_CALL": "RRef creation",
    "SCRIPT_REMOTE_CALL": "RRef creation",
    "PYTHON_RREF_FETCH_CALL": "RRef fetch",
    "SCRIPT_RREF_FETCH_CALL": "RRef fetch",
    "RREF_FORK_REQUEST": "RRef fork request",
    "RREF_CHILD_ACCEPT": "RRef child accept",
    "RREF_USER_DELETE": "RRef user delete",
    "CLEANUP_AUTOGRAD_CONTEXT_REQ": "autograd context cleanup",
}
_FETCH = ("PYTHON_RREF_FETCH_CALL", "SCRIPT_RREF_FETCH_CALL")
_PROTOCOL_NAMES = {
    RREF_FORK: "RREF_FORK_REQUEST",
    RREF_ACCEPT: "RREF_CHILD_ACCEPT",
    RREF_DELETE: "RREF_USER_DELETE",
    AUTOGRAD_RELEASE: "CLEANUP_AUTOGRAD_CONTEXT_REQ",
}


class InjectedFailure(RpcError):
    """A send that ``FaultyRpcBackendOptions.messages_to_fail`` made fail."""


@dataclass
class FaultyRpcBackendOptions(RpcBackendOptions):
    """Backend options that make this worker fail or delay chosen messages it
    sends, for testing how code copes; mirrors torch's
    ``FaultyTensorPipeRpcBackendOptions``. See ``rrpc/faults.py`` for what each
    message-type name selects.

    Args (keyword only; every option of ``RpcBackendOptions`` applies too):
        messages_to_fail: message-type names (``"RREF_FORK_REQUEST"``,
            ``"PYTHON_CALL"``, ...) whose sends fail at once with
            ``InjectedFailure``, nothing going on the wire.
        num_fail_sends: how many sends of each such message fail before one
            goes through (counted per message name and content, as torch).
        messages_to_delay: message-type name -> seconds its sends wait before
            they go on the wire (the caller does not wait; its timeout runs).

    Example::

        options = rrpc.FaultyRpcBackendOptions(
            messages_to_fail=["PYTHON_REMOTE_CALL"], num_fail_sends=1,
            messages_to_delay={"PYTHON_CALL": 1.5},
        )
        rrpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options)
        rrpc.remote("worker1", f).to_here()  # raises InjectedFailure (RRef creation)
        rrpc.rpc_sync("worker1", f, timeout=1)  # raises RpcTimeoutError
    """

    messages_to_fail: list[str] = field(default_factory=list, kw_only=True)
    messages_to_delay: dict[str, float] = field(default_factory=dict, kw_only=True)
    num_fail_sends: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.messages_to_fail = list(self.messages_to_fail)
        self.messages_to_delay = dict(self.messages_to_delay)
        for name in [*self.messages_to_fail, *self.messages_to_delay]:
            if name not in MESSAGE_TYPES:
                known = ", ".join(sorted(MESSAGE_TYPES))
                raise ValueError(f"no message type {name!r} to inject faults into (known: {known})")
        for name, seconds in self.messages_to_delay.items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
                raise ValueError(
                    f"messages_to_delay[{name!r}] must be seconds >= 0, not {seconds!r}"
                )
        if isinstance(self.num_fail_sends, bool) or not isinstance(self.num_fail_sends, int):
            raise TypeError(f"num_fail_sends must be an int, not {self.num_fail_sends!r}")
        if self.num_fail_sends < 0:
            raise ValueError(f"num_fail_sends must be >= 0, got {self.num_fail_sends}")


def injector(options: RpcBackendOptions, scheduler: Scheduler) -> Injector | None:
    """The agent's injector for ``options``, delaying on ``scheduler``; None
    when they inject nothing."""
    if not isinstance(options, FaultyRpcBackendOptions):
        return None
    failing = options.messages_to_fail if options.num_fail_sends else []
    delays = {name: seconds for name, seconds in options.messages_to_delay.items() if seconds}
    if not failing and not delays:
        return None
    return Injector(failing, options.num_fail_sends, delays, scheduler)


def _is_builtin(func: Any) -> bool:
    """Whether torch would send a call of ``func`` as a script call (its rule)."""
    builtin = torch.jit._builtins._find_builtin(func) is not None
    return builtin or isinstance(func, torch.jit.ScriptFunction)


def torch_name(kind: int, obj: Any, what: What, requires_grad: bool) -> str | None:
    """The name torch gives this request (one of ``MESSAGE_TYPES``), or None
    when torch's faulty agent could not target it. ``what`` is the agent's
    description of the call; ``requires_grad``: it carries tensors that
    require grad."""
    if kind in _PROTOCOL_NAMES:
        return _PROTOCOL_NAMES[kind]
    if kind == RREF_FETCH:
        return _FETCH[0]
    if kind == RREF_CREATE:
        func, remote = obj[2], True
    elif kind == CALL:
        # remote() to this worker itself runs as a CALL (rref.remote), described as such.
        func, remote = obj[0], str(what).startswith("remote()")
    else:
        return None
    if requires_grad and thread_state.autograd_context_id:
        return None  # torch: FORWARD_AUTOGRAD_REQ
    script = "SCRIPT" if _is_builtin(func) else "PYTHON"
    return f"{script}_REMOTE_CALL" if remote else f"{script}_CALL"


class Injector:
    """Decides, for each request this worker sends, to fail, delay or send it."""

    def __init__(
        self,
        failing: list[str],
        num_fail_sends: int,
        delays: dict[str, float],
        scheduler: Scheduler,
    ):
        self._scheduler = scheduler
        self.failing = frozenset(failing)
        self.num_fail_sends = num_fail_sends
        self.delays = dict(delays)
        if any(name in self.delays for name in _FETCH):  # one rrpc kind for both names
            self.delays[_FETCH[0]] = max(self.delays.get(name, 0.0) for name in _FETCH)
        if any(name in self.failing for name in _FETCH):
            self.failing |= {_FETCH[0]}
        self._failed: dict[bytes, int] = {}  # message name and content -> sends failed
        self._lock = threading.Lock()

    def send(
        self,
        peer: WorkerInfo,
        kind: int,
        obj: Any,
        what: What,
        out: wire.Outgoing,
        put: Callable[[list[Any]], None],
        calls: CallTable,
        request_id: int,
    ) -> bool:
        """Send the encoded request ``out`` with ``put`` (the stream's), late
        or not at all; a failed send fails call ``request_id`` of ``calls``.
        True if the request was dropped (it will never be answered)."""
        name = torch_name(kind, obj, what, bool(out.grad_tensors))
        if name is None:
            put(out.pieces)
            return False
        if name in self.failing:
            attempt = self._count_failure(name, out)
            if attempt:
                call = calls.settle(request_id)
                if call is not None:
                    metrics.ended(call.row, timed_out=False)  # as every call's other ends
                    error = InjectedFailure(
                        f"{what} to {peer.name} failed: its {MESSAGE_TYPES[name]} message "
                        f"({name}) was dropped on purpose (fault injection: send {attempt} of "
                        f"the num_fail_sends={self.num_fail_sends} that fail)"
                    )
                    settle(call.future, error=error)
                return True
        delay = self.delays.get(name)
        if not delay:
            put(out.pieces)
            return False
        self._scheduler.call_later(delay, put, out.pieces)
        return False

    def _count_failure(self, name: str, out: wire.Outgoing) -> int:
        """Which failing send of this message this is (from 1), or 0 once
        ``num_fail_sends`` of them have failed."""
        digest = hashlib.blake2b(name.encode(), digest_size=16)
        first = bytes(out.pieces[0])
        (word,) = wire.HEADER.unpack_from(first)
        # the payload, not the envelope
        digest.update(first[wire.HEADER.size + wire.head_size(word) :])
        for piece in out.pieces[1:]:
            digest.update(piece)
        key = digest.digest()
        with self._lock:
            failed = self._failed.get(key, 0)
            if failed >= self.num_fail_sends:
                return 0
            self._failed[key] = failed + 1
            return failed + 1
