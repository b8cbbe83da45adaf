"""Shared vocabulary of every layer: message kinds, worker identity, errors, per-thread state.

This is the bottom of the package; it imports nothing from rrpc. Every message
on the wire has one of the kinds below. A request kind is answered by exactly
one REPLY or ERROR carrying the request's id; ``NOTIFY``-style protocol
messages are requests too (their reply is an acknowledgement), so that every
message's delivery is known to its sender and shutdown can wait for them.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# -- Message kinds -------------------------------------------------------------
# Replies.
REPLY = 1  # payload: the result
ERROR = 2  # payload: RemoteException
# The transport's: opens each direction of a stream when the cluster has a
# token (rrpc/auth.py); no payload, and it never reaches the agent.
HANDSHAKE = 3
# Requests. Each request kind is served by one handler registered with the agent.
CALL = 10  # payload: (func, args, kwargs) -> result of func(*args, **kwargs)
RREF_CREATE = 20  # remote(): run func on the owner and keep the result under an RRef id
RREF_FETCH = 21  # to_here(): the owner's value
RREF_FORK = 22  # a user that got an RRef from another user asks the owner to count its fork
RREF_ACCEPT = 23  # to the sender of an RRef: the owner counted the copy, drop the pending child
RREF_DELETE = 24  # user forks are gone (dropped, no copies in flight), one or many
RREF_CREATE_FAILED = 25  # a CREATE was refused before it ran: fail waiters of its value
AUTOGRAD_BACKWARD = 30  # gradients for a send node, run the rest of the pass there
AUTOGRAD_RELEASE = 31  # a context ended; free its state
# A flag on a request kind: run it under the caller's profiler. Payload
# (config, request of the plain kind); the reply is (events, reply). See
# rrpc/profiling.py.
PROFILED = 0x100

KIND_NAMES = {
    value: name
    for name, value in dict(globals()).items()
    if name.isupper() and isinstance(value, int) and not name.startswith("_")
}


# Requests that run a user's function, and to_here(): in an autograd context
# torch records each end as the other's participant even when no tensor that
# requires grad travels (its forceGradRecording): the function may use the
# context (a backward, a nested call), and the reply may bring such tensors.
RECORDED_KINDS = frozenset({CALL, RREF_CREATE, RREF_FETCH, CALL | PROFILED, RREF_CREATE | PROFILED})


def kind_name(kind: int) -> str:
    if kind & PROFILED and kind != PROFILED:
        return f"{kind_name(kind & ~PROFILED)} (profiled)"
    return KIND_NAMES.get(kind, f"unknown kind {kind}")


# -- Identity ------------------------------------------------------------------
_NAME = re.compile(r"[A-Za-z0-9\-_:]+\Z")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and rank (``id``), as ``torch.distributed.rpc.WorkerInfo``."""

    name: str
    id: int

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and 0 < len(self.name) < 128) or not _NAME.match(
            self.name
        ):
            raise RpcError(
                "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and "
                f"shorter than 128 chars, but got {self.name!r}"
            )

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


# (caller rank, request id, is_reply): names one message cluster-wide, and so
# one send/recv pair of distributed autograd (the sender's send record and the
# receiver's recv nodes share it).
MessageKey = tuple[int, int, bool]


# -- Errors --------------------------------------------------------------------
class RpcError(RuntimeError):
    """Base class of the errors rrpc itself raises (not those of user functions)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call did not complete within its timeout."""


class PeerUnavailableError(RpcError, ConnectionError):
    """The peer died, closed its stream, or could not be reached."""


class AuthenticationError(RpcError, PermissionError):
    """A peer did not prove it knows the cluster's auth token, or rejected this worker."""


class MessageTooLargeError(RpcError, ValueError):
    """A message exceeds the configured ``max_message_size``."""


class SerializationError(RpcError, TypeError):
    """An argument or a result could not be pickled or unpickled."""


class ProtocolError(RpcError):
    """A peer broke a protocol: bytes on a stream that are not a well-formed
    frame (``wire.py``), or an RRef protocol event that does not fit the state
    it arrived in (``rref_protocol.py``)."""


class RemoteError(RpcError):
    """A remote exception whose own type could not be rebuilt on this side."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        # Worded as torch's, which code may match: the type is not rebuilt here.
        super().__init__(f"Original exception on remote side was {type_name}: {message}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        args = (self.type_name, self.remote_message, self.remote_traceback)
        return type(self), args, self.__dict__


# What an ERROR reply carries, and the exception rebuilt from it.
def remote_exception_payload(exc: BaseException, where: str) -> tuple:
    """What an ERROR reply carries: the exception if it pickles, and always its text.

    An error that came from another worker and is only passed on (a nested
    call, a distributed backward's hop) keeps the traceback and the worker of
    its origin: it is not formatted again at every hop."""
    origin = getattr(exc, "remote_origin", None)
    if origin is not None:
        text, where = exc.remote_traceback, origin  # type: ignore[attr-defined]
    else:
        text = "".join(traceback.format_exception(exc))
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:
        blob = None
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        message = str(exc)
    except Exception:  # its text is not the caller's to lose: the reply goes all the same
        message = "<exception str() failed>"  # traceback's wording, in ``text`` too
    return blob, name, message, text, where


def rebuild_remote_exception(
    payload: tuple, unpickle: Callable[[bytes], Any] = pickle.loads
) -> BaseException:
    """The exception an ERROR reply carries (``unpickle``: as the reply's
    payload was), else a ``RemoteError`` with its text; either with the
    remote traceback attached."""
    blob, name, message, text, where = payload
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = unpickle(blob)  # restricted mode: only safe classes
        except Exception:
            exc = None
    if not isinstance(exc, Exception):
        # Not an error the caller's ``except Exception`` would catch (a
        # callee's SystemExit, KeyboardInterrupt): a RuntimeError naming it, as
        # torch's, so that no callee can end its caller's program.
        exc = RemoteError(name, message, text)
    if getattr(exc, "remote_origin", None) is not None:
        return exc  # passed on by the peer: it has its origin's traceback and note already
    exc.remote_traceback = text  # type: ignore[attr-defined]
    exc.remote_origin = where  # type: ignore[attr-defined]
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"\nRemote traceback (on {where}):\n{text.rstrip()}")
    return exc


# -- What a call is, for its error messages ------------------------------------
class Description(tuple):
    """What a call is ("call of f", "forward() on the value of UserRRef(...)"),
    put into words only if an error message needs them:
    ``Description((words, *args))`` reads ``words(*args)`` as a string. A
    call that succeeds (nearly all) pays for a tuple, not for the formatting
    (an RRef's repr, a function's qualified name)."""

    __slots__ = ()

    def __str__(self) -> str:
        return self[0](*self[1:])


# What the agent's callers say a call is: words, or words to come.
What = str | Description


# -- Per-thread call state -----------------------------------------------------
class _ThreadState(threading.local):
    # The distributed autograd context every RPC from this thread carries (0: none).
    # Set by rrpc.autograd.context() and, while a request runs, by the agent.
    autograd_context_id: int = 0
    # True on a thread the transport needs to make progress (a stream's reader,
    # the scheduler, a lane's reader): ``futures`` hands user callbacks of the
    # futures it completes to the callback pool. It sits here, at the bottom,
    # so that the carriers that set it need not import ``futures`` above them.
    transport: bool = False
    # While a stream's reader runs a request itself (``turns.TakeTurns``):
    # hands its reading to its partner. ``futures.blocking`` calls it when the
    # request waits for an RPC, whose reply may need that reading.
    hand_off: Callable[[], None] | None = None
    # On a stream's reader: the state of the stream it serves. A pushed
    # ``outbox.Outbox`` lets its own readers send (a transport thread
    # serving another stream hands its frames to the outbox's sender).
    serving: object = None


thread_state = _ThreadState()


def mark_transport_thread() -> None:
    """Declare the calling thread one the transport needs: no user callback runs on it."""
    thread_state.transport = True


@contextlib.contextmanager
def transport_thread() -> Iterator[None]:
    """Within the block, the calling thread is one the transport needs (a user
    thread reading a lane's replies for every caller): user callbacks of the
    futures it completes go to the callback pool."""
    previous, thread_state.transport = thread_state.transport, True
    try:
        yield
    finally:
        thread_state.transport = previous
