"""What a peer may name in restricted mode, and the unpickler that holds it to that.

Restricted mode (``RpcBackendOptions(restricted=True)``) is chosen per run: the
agent unpickles every message with ``loads`` below instead of
``pickle.loads``, and the CALL handler and RRef proxies check with
``functions.check_call`` / ``check_method`` what they run. This module holds
no switch; it holds the tables, which are the same for every run.

In every mode, ``guarded`` chooses pickle's pure-Python unpickler for a
payload CPython's C unpickler would mishandle (a BYTEARRAY8 larger than the
payload: see there).

Registration, not reach-up: the module that owns a thing puts it in a table
when it is imported, so this one names none of them.

- ``allow(obj)``: a global a pickle may name (rebuild functions, safe
  classes): the tensor rebuilders (``tensors.py``), RRef's ``_rebuild``, RemoteModule's.
- ``allow_call(fn)``: an rrpc-internal function that rrpc itself names in
  CALL / ``remote()`` messages (RRef proxies, the distributed optimizer,
  RemoteModule, the liveness probe); a pickle may name it too. Each checks
  what it is given where that matters (``check_method`` for proxies).
- ``allow_exposed(obj)``: what a user exposed (``functions.expose``): callable
  by peers and, for a class, its instances may travel.

Why these and only these. A pickle runs code only through the globals it
names (REDUCE calls them, BUILD calls their instances' ``__setstate__``):
refusing every global but these, before it is imported or looked up, leaves a
peer nothing to run but safe constructors, rrpc's rebuild functions and what
the worker exposed. Decisions:

- Tensors: only rrpc's own rebuild functions (``tensors._rebuild_*``), which
  check what they build (``reshape``/``as_strided`` are bounds-checked by
  torch, sparse invariants are checked). Torch's own reducers are refused:
  ``torch._utils._rebuild_*`` take storages that torch pickles through
  ``torch.storage._load_from_bytes``, i.e. a nested ``torch.load`` with
  ``weights_only=False``, which runs any pickle. So tensors that rrpc does not
  reduce itself (quantized, tensor subclasses, exotic layouts or dtypes)
  cannot travel in restricted mode. A BUILD on a tensor reaches
  ``Tensor.__setstate__`` (``set_`` over another tensor), which torch
  bounds-checks.
- Exceptions: builtin exception classes and rrpc's own arrive as they are;
  any other exception class (if its module is loaded here) arrives as a
  ``RemoteError`` naming it, built from its arguments' text, and is never
  instantiated.
- torch's optimizer classes (``torch.optim``): accepted, as
  ``DistributedOptimizer`` sends them; constructing one runs no peer code.
- ``builtins.getattr`` (how pickle names classmethods and torch's builtin
  functions, ``torch.add``) is replaced by a getattr on a class that returns
  only what is exposed or rrpc-internal.
- Nothing is imported to answer a pickle: a global whose module this worker
  has not imported is refused, and names are looked up in ``__dict__``s, so
  no module ``__getattr__`` nor descriptor runs.
- A pickle may name memo indices up to ``MAX_MEMO_INDEX`` only (see there).
"""

from __future__ import annotations

import builtins
import collections
import functools
import io
import pickle
import pickletools
import struct
import sys
import types
from typing import Any, TypeVar

import torch

from rrpc.messages import RemoteError, WorkerInfo

T = TypeVar("T")


class RefusedGlobalError(pickle.UnpicklingError):
    """Restricted mode refused a global a pickle named."""


# -- The tables ----------------------------------------------------------------
# (module, qualified name) -> what a pickle naming it gets.
_globals: dict[tuple[str, str], Any] = {}
# id -> the object (kept alive: ids stay unique).
_internal_calls: dict[int, Any] = {}
_exposed: dict[int, Any] = {}


def allow(obj: T) -> T:
    """Let pickles name ``obj`` (a function or class) by its own module and
    qualified name; returns ``obj``, so it serves as a decorator."""
    return allow_global(getattr(obj, "__module__", "builtins"), obj.__qualname__, obj)  # type: ignore[attr-defined]


def allow_global(module: str, name: str, obj: T) -> T:
    """Let pickles name ``module.name``, which gives them ``obj``."""
    _globals[(module, name)] = obj
    return obj


def allow_call(fn: T) -> T:
    """Let peers call ``fn``, a function rrpc itself names in its messages
    (and so let pickles name it); returns ``fn``."""
    _internal_calls[id(fn)] = fn
    return allow(fn)


def allow_exposed(obj: Any) -> None:
    """Let peers call ``obj`` (a function) or send, build and use ``obj`` (a
    class): what ``functions.expose`` registers."""
    _exposed[id(obj)] = obj


def is_internal_call(fn: Any) -> bool:
    return _internal_calls.get(id(fn)) is fn


def is_exposed(obj: Any) -> bool:
    """Whether ``obj`` was exposed: itself, the function of a bound classmethod,
    or a function it wraps (``functools.wraps``, as ``async_execution`` does)."""
    for _ in range(8):
        if id(obj) in _exposed and _exposed[id(obj)] is obj:
            return True
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif isinstance(obj, types.FunctionType):
            obj = obj.__dict__.get("__wrapped__")
        else:
            return False
    return False


# -- Refusals ------------------------------------------------------------------
def _refuse(what: str, why: str = "") -> RefusedGlobalError:
    return RefusedGlobalError(
        f"restricted mode refuses to unpickle {what}{why}: only tensors, builtin containers "
        "and scalars, torch dtypes/devices/sizes, WorkerInfo, RRefs, exceptions and what "
        "rrpc.functions.expose registered on this worker may travel (expose a function or "
        "class of yours with @rrpc.functions.expose)"
    )


_MISSING = object()


def _lookup(namespace: Any, qualname: str) -> Any:
    """``namespace.a.b`` through ``__dict__``s only (no ``__getattr__``, no descriptors)."""
    found = namespace
    for part in qualname.split("."):
        mapping = getattr(found, "__dict__", None) if isinstance(found, type) else None
        if isinstance(found, types.ModuleType):
            mapping = found.__dict__
        if mapping is None:
            return _MISSING
        owner, found = found, mapping.get(part, _MISSING)
        if found is _MISSING:
            return _MISSING
        if isinstance(found, staticmethod):
            found = found.__func__
        elif isinstance(found, classmethod):
            found = found.__get__(None, owner)
    return found


def _stand_in_error(type_name: str, *args: Any) -> BaseException:
    """An exception of a class restricted mode does not build: a RemoteError."""
    text = str(args[0]) if len(args) == 1 else ", ".join(map(str, args))
    return RemoteError(type_name, text)


def _restricted_getattr(owner: Any, name: Any) -> Any:
    if isinstance(owner, type) and isinstance(name, str):
        value = getattr(owner, name, _MISSING)
        if is_exposed(value) or is_internal_call(value):
            return value
    where = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"
    raise _refuse(f"the attribute {where}.{name}", " (not exposed)")


def _restricted_global(module: str, name: str) -> Any:
    """A global the tables do not list: exposed, an exception, an optimizer, or refused."""
    what = f"the global {module}.{name}"
    found = sys.modules.get(module)
    if found is None:
        raise _refuse(what, f" (module {module} is not imported on this worker)")
    found = _lookup(found, name)
    if found is _MISSING:
        raise _refuse(what, " (no such name)")
    if is_exposed(found):
        return found
    if isinstance(found, type):
        if issubclass(found, BaseException):
            if module.startswith("rrpc."):
                return found
            return functools.partial(_stand_in_error, f"{module}.{name}")
        if module.startswith("torch.optim.") and issubclass(found, torch.optim.Optimizer):
            return found
    raise _refuse(what)


# What is safe without anyone registering it: builtin containers and scalars,
# torch's value types, WorkerInfo (from the bottom module, which registers nothing).
for _safe in (
    list, tuple, dict, set, frozenset, str, bytes, bytearray, int, float, bool, complex,
    slice, range, collections.OrderedDict, torch.device, torch.Size, WorkerInfo,
):  # fmt: skip
    allow(_safe)
allow_global("builtins", "getattr", _restricted_getattr)
# How torch pickles a torch.layout: a lookup of torch's layouts by name.
allow_global("torch.serialization", "_get_layout", torch.serialization._get_layout)
allow_global("torch._C", "_VariableFunctionsClass", torch._C._VariableFunctionsClass)  # type: ignore[attr-defined]
for _name, _value in vars(builtins).items():
    if isinstance(_value, type) and issubclass(_value, BaseException):
        allow_global("builtins", _name, _value)
for _name, _value in vars(torch).items():
    if isinstance(_value, torch.dtype | torch.layout | torch.memory_format):
        allow_global("torch", _name, _value)
del _safe, _name, _value


# -- Unpickling ------------------------------------------------------------------
class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _globals.get((module, name))
        return found if found is not None else _restricted_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError("restricted mode refuses persistent ids in a pickle")


_PURE_UNPICKLER: Any = getattr(pickle, "_Unpickler")  # noqa: B009 -- pickle's pure-Python one


class _PurePythonUnpickler(_PURE_UNPICKLER):
    """pickle's pure-Python unpickler, which refuses a BYTEARRAY8 longer than
    the whole pickle before allocating it (``loads_pure``)."""

    def __init__(self, data: Any, *, buffers: Any = None):
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._size = len(data)

    def load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._size:
            raise pickle.UnpicklingError(f"BYTEARRAY8 of {size} bytes in a pickle of {self._size}")
        value = bytearray(size)
        self.readinto(value)
        self.append(value)

    dispatch = {**_PURE_UNPICKLER.dispatch, pickle.BYTEARRAY8[0]: load_bytearray8}


class _PurePythonRestrictedUnpickler(_PurePythonUnpickler):
    find_class = _RestrictedUnpickler.find_class
    persistent_load = _RestrictedUnpickler.persistent_load


# A memo index a pickle may name. CPython 3.11's unpickler grows its memo to
# twice the largest index PUT / LONG_BINPUT names and clears every slot while
# holding the GIL: a 9-byte pickle naming index 2**28 took 8.9 s and 4 GiB
# here. rrpc's own pickles (protocol 5) use MEMOIZE, which only appends.
MAX_MEMO_INDEX = 1 << 20
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _check_memo_indices(data: Any) -> None:
    """Refuse a pickle that names a memo index above ``MAX_MEMO_INDEX``
    (every pickle's opcodes are walked for it, before unpickling)."""
    try:
        for opcode, argument, _ in pickletools.genops(bytes(data)):
            if opcode.name in _MEMO_PUTS and int(argument or 0) > MAX_MEMO_INDEX:
                raise RefusedGlobalError(
                    f"restricted mode refuses a pickle that names memo index {argument} "
                    f"(above {MAX_MEMO_INDEX}): unpickling it would allocate its memo"
                )
    except (ValueError, TypeError):  # malformed opcodes: the unpickler says why
        return


def loads(data: Any, *, buffers: Any = None) -> Any:
    """``pickle.loads`` in restricted mode: what the tables allow, or ``RefusedGlobalError``."""
    _check_memo_indices(data)
    return _RestrictedUnpickler(io.BytesIO(data), buffers=buffers).load()


def loads_pure(data: Any, *, buffers: Any = None, restricted: bool = True) -> Any:
    """``loads`` (or, not ``restricted``, ``pickle.loads``) by pickle's
    pure-Python unpickler: for the payloads CPython's C unpickler mishandles
    (``guarded``)."""
    if not restricted:
        return _PurePythonUnpickler(data, buffers=buffers).load()
    _check_memo_indices(data)
    return _PurePythonRestrictedUnpickler(data, buffers=buffers).load()


# The same unpickling, by pickle's pure-Python unpickler (``guarded``).
_PURE_PYTHON: dict[Any, Any] = {
    pickle.loads: functools.partial(loads_pure, restricted=False),
    loads: loads_pure,
}


def guarded(unpickle: Any, payload: bytes | memoryview) -> Any:
    """``unpickle`` (``pickle.loads`` or ``loads``), or its pure-Python twin
    when some byte of ``payload``, read as BYTEARRAY8, would announce more
    bytes than the payload holds after it.

    CPython's C unpickler (3.11, 3.12) builds a BYTEARRAY8 with
    ``PyByteArray_FromStringAndSize(NULL, size)`` before it checks that the
    input holds ``size`` bytes; when the allocation fails, that function
    frees the half-built bytearray before setting its count of buffer
    exports, and the deallocator reads whatever the allocator left there: if
    positive, it raises and prints ``SystemError: deallocated bytearray object
    has exported buffers`` (running ``sys.excepthook``) from inside the
    deallocator, in the middle of ``load``. The pure-Python unpickler refuses
    such a BYTEARRAY8 before allocating anything. A true BYTEARRAY8 never
    announces more than the payload holds, so a valid pickle only takes that
    path when a byte of its data looks like one."""
    find = payload.find if isinstance(payload, bytes) else bytes(payload).find
    size = len(payload)
    index = find(b"\x96")
    while index >= 0:
        count = payload[index + 1 : index + 9]
        if len(count) == 8 and int.from_bytes(count, "little") > size - index - 9:
            return _PURE_PYTHON.get(unpickle, unpickle)
        index = find(b"\x96", index + 1)
    return unpickle
