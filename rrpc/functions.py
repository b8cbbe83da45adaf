"""Decorators for functions called over RPC."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# The attribute torch.distributed.rpc.functions.async_execution sets: functions
# decorated by either framework's decorator are recognised by both.
ASYNC_ATTRIBUTE = "_wrapped_async_rpc_function"


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` whose value is the reply.

    The worker thread that ran ``fn`` is free as soon as ``fn`` returns; the
    reply is sent when the future completes. Use it for functions that wait on
    other RPCs or gather work from several callers (e.g. a batching parameter
    server). As in PyTorch, stack it under ``@staticmethod`` / ``@classmethod``.

    Example::

        @rrpc.functions.async_execution
        def add_later(to, x, y):
            return rrpc.rpc_async(to, torch.add, args=(x, y)).then(lambda f: f.wait() * 2)

        rrpc.rpc_sync("worker1", add_later, args=("worker2", torch.ones(2), 1))
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_ATTRIBUTE, fn)
    return wrapper  # type: ignore[return-value]


def is_async_execution(fn: Any) -> bool:
    return getattr(fn, ASYNC_ATTRIBUTE, None) is not None


def callable_name(func: Any) -> str:
    """How messages name a function: its qualified name when it has one."""
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def async_result_error(func: Any, result: Any) -> RuntimeError | None:
    """The error for an ``async_execution`` function that did not return a
    Future (``.then()`` returns a plain ``torch._C.Future``, which counts)."""
    if isinstance(result, torch._C.Future):
        return None
    return RuntimeError(  # torch's wording first
        "Functions decorated with @rpc.async_function must return a torch.futures.Future "
        f"object, but got {type(result).__name__}: {callable_name(func)} is marked "
        "async_execution"
    )
