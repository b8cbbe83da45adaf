"""What users put on functions called over RPC: ``async_execution``; ``expose`` (restricted mode).

Restricted mode (``RpcBackendOptions(restricted=True)``, env ``RRPC_RESTRICTED=1``)
runs only what a worker exposed, and unpickles only safe types (``restricted.py``,
which holds the tables; the agent holds the per-run choice):

- ``expose(fn)`` registers a function (plain, ``staticmethod``/``classmethod``,
  ``async_execution``, stacked in either order) as callable by peers.
- ``expose(cls)`` registers a class: peers may send and receive its instances,
  construct it (``remote(owner, cls, ...)``, ``rpc_sync(to, cls, ...)``) and call
  its public methods (names without a leading ``_``, inherited ones included)
  through RRef proxies (``rref.rpc_sync().method()``). A method exposed on its
  own is callable through proxies whatever its class. Subclasses of an exposed
  class are not exposed. ``expose(torch.add)`` or ``expose(nn.Linear)`` expose
  things one cannot decorate.
- Registration is per process, by the object itself: the callee must import
  the module that defines (or exposes) it before peers call it.
- rrpc's own helpers that it sends itself (RRef proxies, distributed autograd,
  ``DistributedOptimizer``, ``RemoteModule``, the liveness probe) are on an
  internal allow-list that the modules defining them fill
  (``restricted.allow_call``); each of them checks what it is given where
  that matters (``check_method`` for proxies).

Without restricted mode nothing here is consulted: a peer that passed the auth
handshake may run any code, as in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rrpc.messages import RpcError
from rrpc.restricted import allow_exposed, is_exposed, is_internal_call

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


def naming(template: str, func: Any, *args: Any) -> str:
    """``template`` with ``func``'s name first (``func`` itself if a string):
    the words of a call's ``messages.Description``."""
    return template.format(func if isinstance(func, str) else callable_name(func), *args)


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


def builtin_argument_error(func: Any, args: tuple, kwargs: dict) -> RuntimeError | None:
    """The error torch raises for a builtin operator called with arguments
    whose Python binding raised ``TypeError``, or None when torch would not.

    torch runs a builtin operator sent over RPC (``torch.add``) through its
    TorchScript schema matching, so wrong arguments are a ``RuntimeError``
    ("Overloaded torch operator invoked from Python failed to match any
    schema: ..."); the Python binding rrpc calls raises ``TypeError``. Only
    after that ``TypeError`` is torch's matcher asked (it runs nothing), so a
    call that works pays nothing."""
    name = torch.jit._builtins._find_builtin(func)
    if name is None:
        return None
    try:
        torch._C._jit_resolve_packet(name, *args, **kwargs)
    except RuntimeError as mismatch:
        return mismatch
    except Exception:
        return None
    return None  # the matcher takes these arguments: the binding's own error stands


# -- Restricted mode -------------------------------------------------------------
class NotExposedError(RpcError, PermissionError):
    """Restricted mode refused to run a function or method a peer named."""


def expose(obj: F) -> F:
    """Let peers call ``obj`` (a function) or use ``obj`` (a class) when the
    callee runs in restricted mode; returns ``obj`` unchanged.

    Works on plain functions, on ``staticmethod``/``classmethod`` objects and on
    ``async_execution`` functions, in either order, and as a plain call for
    things one cannot decorate (``expose(torch.add)``). On a class it allows its
    instances to travel and its public methods through RRef proxies.

    Example::

        @rrpc.functions.expose
        def add(x, y):
            return x + y

        @rrpc.functions.expose
        class Counter:
            def increment(self): ...
    """
    target = obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj
    if not callable(target):
        raise TypeError(f"expose() takes a function or a class, not {type(obj).__name__}")
    allow_exposed(target)
    return obj


def _how_to_expose(name: str) -> str:
    return (
        f"decorate it with @rrpc.functions.expose (or call rrpc.functions.expose({name})) "
        "in a module the callee imports"
    )


def check_call(func: Any, where: str = "") -> None:
    """In restricted mode: raise ``NotExposedError`` unless ``func`` may run."""
    if is_exposed(func) or is_internal_call(func):
        return
    name = f"{getattr(func, '__module__', '?')}.{callable_name(func)}"
    raise NotExposedError(
        f"restricted mode{where}: {name} is not exposed for remote calls; {_how_to_expose(name)}"
    )


def check_method(value: Any, method: str) -> None:
    """In restricted mode: an RRef proxy may call ``value.method`` only when the
    value's class is exposed and ``method`` is public, or the method itself is
    exposed."""
    cls = type(value)
    if not method.startswith("_") and is_exposed(cls):
        return
    if is_exposed(getattr(cls, method, None)):
        return
    name = f"{cls.__module__}.{cls.__qualname__}"
    raise NotExposedError(
        f"restricted mode: method {method!r} of {name} is not exposed for RRef proxy calls; "
        f"expose the class (rrpc.functions.expose on {cls.__qualname__}: its public methods) "
        f"or the method itself"
    )
