"""An RRef's value as futures hold it, and reading it without keeping frames alive.

Rules:

- No error is raised out of a torch Future here (``wait()``/``value()`` that
  raise): torch's raise puts the Future into the error's traceback, and the
  Future holds the error from C++, invisible to the garbage collector, so the
  cycle never goes and keeps every frame of the raising stack alive (an RRef
  held by any of them would never be deleted). Futures are read with
  ``futures.outcome`` (drops that traceback); a value's error is kept as a
  ``Failed`` result, never with ``set_exception``, and raised as a copy
  (``result``). Calls read at once (``rpc_sync()`` proxies, most
  ``to_here()``) wait on an agent ``SyncReply`` instead, which raises its own
  fresh error and keeps none (``sync_result``).
- Values on the owner live in the owner ``RRef`` object (``_future``: a
  ``torch.futures.Future`` of the value, pending while ``remote()``'s function
  runs); ``evaluate_into`` runs that function into it. A call that names an
  RRef runs on its owner as ``_invoke_on_owner`` and its siblings.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import torch

from rrpc import agent as agent_module
from rrpc import autograd as dist_autograd
from rrpc import functions, messages, restricted
from rrpc.dispatch import Deferred
from rrpc.functions import async_result_error, is_async_execution
from rrpc.futures import SyncReply, copy_error, on_done, outcome, wait_until
from rrpc.messages import RpcError, RpcTimeoutError


@restricted.allow
class Failed:
    """The value of an RRef whose function raised: ``error``, without its frames.

    It travels (a fetch answered once the value is made) as an ERROR reply
    carries an error: the exception if it pickles, and always its type and
    text; the receiver rebuilds it as from an ERROR reply (``_arrived``), so
    an error that does not pickle, or does not unpickle there, is the same
    ``RemoteError`` whether the fetch came before the value was made or after."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self) -> tuple:
        where = agent_module.current_agent().info.name
        return _arrived, (messages.remote_exception_payload(self.error, where),)


@restricted.allow
def _arrived(payload: tuple) -> Failed:
    """A ``Failed`` value as it arrives: its error rebuilt as an ERROR reply's is."""
    return Failed(messages.rebuild_remote_exception(payload, agent_module.current_agent().unpickle))


def kept(error: BaseException) -> Failed:
    """Keep ``error`` as a value: its traceback becomes a note, its frames go."""
    if error.__traceback__ is not None and hasattr(error, "add_note"):  # Python >= 3.11
        text = "".join(traceback.format_tb(error.__traceback__))
        error.add_note(f"Traceback of the function behind the RRef:\n{text.rstrip()}")
    return Failed(error.with_traceback(None))


def result(future: torch.futures.Future) -> Any:
    """``future.wait()`` for a done future, raising errors (and Failed values) as copies."""
    value, error = outcome(future)
    del future  # not in the frame that the raise below puts into the traceback
    if isinstance(value, Failed):
        error = value.error
    if error is not None:
        raise copy_error(error)
    return value


def complete(target: torch.futures.Future, source: torch.futures.Future) -> None:
    """Set value future ``target`` from a call's future ``source``."""
    value, error = outcome(source)
    target.set_result(value if error is None else Failed(error))


def forward(reply: torch.futures.Future, value: torch.futures.Future) -> None:
    reply.set_result(value.wait())  # a value future never holds an exception


def evaluate_into(
    future: torch.futures.Future, func: Callable, args: tuple, kwargs: dict
) -> Deferred | None:
    """Run ``func`` into ``future`` (an error is kept there, for to_here to raise).

    Returns None when ``future`` is set, or a Deferred that completes once an
    ``async_execution`` function's future has set it."""
    try:
        if agent_module.current_agent().options.restricted:
            functions.check_call(func)
        returned = func(*args, **kwargs)
    except BaseException as exc:
        if isinstance(exc, TypeError):  # a builtin's wrong arguments: torch's RuntimeError
            exc = functions.builtin_argument_error(func, args, kwargs) or exc
        future.set_result(kept(exc))
        return None
    if isinstance(returned, Deferred):  # rrpc's own function, with a Future to wait for
        returned = returned.future
    elif not is_async_execution(func):
        future.set_result(returned)
        return None
    else:
        error = async_result_error(func, returned)
        if error is not None:
            future.set_result(Failed(error))
            return None
    set_: torch.futures.Future = torch.futures.Future()

    def finish(done: torch.futures.Future) -> None:
        complete(future, done)
        set_.set_result(None)

    on_done(returned, finish)
    return Deferred(set_)


def sync_result(reply: SyncReply) -> Any:
    """``result`` for a call's ``SyncReply``: its error is its own (fresh from
    the reply), a Failed value is raised as a copy."""
    value = reply.wait()
    if isinstance(value, Failed):
        raise copy_error(value.error)
    return value


def complete_created(
    here: dict, rref_id: Any, timed_out: BaseException, source: torch.futures.Future
) -> None:
    """remote() to this worker answered (``source``): if it failed before its
    handler took the value future out of ``here``, that error is the value
    (a timeout is the creation's). Taken, the handler sets it."""
    target = here.pop(rref_id, None)
    if target is None:
        return
    error = outcome(source)[1] or RpcError("remote() to this worker was answered unrun")
    target.set_result(Failed(timed_out if isinstance(error, RpcTimeoutError) else error))


def wait_result(future: torch.futures.Future, timeout: float, what: str) -> Any:
    """``result(future)`` once done, within ``timeout`` (0: none) or RpcTimeoutError."""
    if not wait_until(future, timeout or math.inf):
        raise RpcTimeoutError(
            f"{what} timed out after {timeout:g} s: RPC ran for more than its timeout"
        )
    return result(future)


# -- Calls that name an RRef, on its owner ---------------------------------------
def _owner_rref(target: Any) -> Any:
    """On the owner: the owner RRef a call names, itself or by id (a
    placeholder while its CREATE has not run yet)."""
    if not isinstance(target, tuple):  # the RRef itself (an RRefId is a tuple)
        return target
    return agent_module.current_agent().rrefs.holder(target)


@restricted.allow_call  # checks the method: check_method
def _invoke_on_owner(target: Any, method: str, args: tuple, kwargs: dict) -> Any:
    """On the owner: ``getattr(value, method)(*args, **kwargs)``; an
    ``async_execution`` method's reply (or RRef value) waits for its own
    Future, a ``Deferred``. A plain method's result is returned as it is: no
    Future is made and waited on for the common case."""
    value = _owner_rref(target).local_value()
    if agent_module.current_agent().options.restricted:
        functions.check_method(value, method)
    bound = getattr(value, method)
    if not is_async_execution(bound):
        return bound(*args, **kwargs)
    returned = bound(*args, **kwargs)
    error = async_result_error(bound, returned)
    if error is not None:
        raise error
    return Deferred(returned)


@restricted.allow_call
def _backward_on_owner(target: Any, context_id: int, retain_graph: bool) -> None:
    value = _owner_rref(target).local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        dist_autograd.backward(context_id, [value], retain_graph=retain_graph)


@restricted.allow_call
def _rref_typeof_on_owner(target: Any) -> type:  # torch's name, in profiles
    return type(_owner_rref(target).local_value())
