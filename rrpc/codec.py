"""One message ⇄ a frame's payload and tensor buffers: pickling, and its undoing.

The frame around them (layout, limits, reassembly) is ``wire.py``'s; what
restricted mode lets a pickle name is ``restricted.py``'s.

Rules:

- The payload is pickle protocol 5. Each tensor in it is taken apart by
  ``tensors.py`` (``reduce_tensor``): a CPU tensor's bytes go out of band, as
  a ``PickleBuffer`` over its own memory, never copied through pickle; the
  transport writes those buffers next to the payload. When two tensors of a
  message view one storage, the message is pickled a second time, with that
  storage's bytes sent once (``tensors.Storages``): they arrive sharing it.
- Code the receiver cannot import (lambdas, closures, functions of
  ``__main__`` when the receiver runs another script) is pickled by value with
  cloudpickle; everything else goes by reference through the C pickler, which
  is faster. A function of ``__main__`` goes by reference to a worker that
  runs the same script (``same_main``), as in torch: the callee runs its own
  copy, with its own globals.
- ``encode`` refuses a message the reader would refuse (more than
  ``wire.MAX_BUFFERS`` buffers, more than ``max_message_size`` bytes), before
  anything reaches the stream; the error gives both numbers.
- ``loads`` unpickles with the function the agent chose for its run:
  ``pickle.loads``, or ``restricted.loads`` in restricted mode. Nothing here
  decides which. The tensor rebuild functions (``tensors.py``) are registered
  with ``restricted`` (they check what they build).
- The pickle hooks of upper layers (RRefs need to know where they travel,
  distributed autograd must see tensors that require grad) read
  ``current_peer()`` and the tensor hook that ``loads`` installs; a reducer
  with side effects registers their undo with ``on_discard``.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch

from rrpc import by_value, restricted, tensors
from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import (
    REPLY,
    MessageTooLargeError,
    SerializationError,
)
from rrpc.shm import Placer
from rrpc.wire import HEADER, MAX_BUFFERS, Frame, Outgoing, compact_first

PICKLE_PROTOCOL = 5


# -- Per-thread pickling state -------------------------------------------------
class _CodecState(threading.local):
    peer: Any = None  # the worker this thread is encoding for / decoding from
    undo: list[Callable[[], None]] | None = None  # see on_discard
    same_main: bool = False  # the peer runs this worker's __main__ script
    waits: list[Any] | None = None  # see wait_for


_state = _CodecState()


def current_peer() -> Any:
    """The worker the message being pickled goes to (or being unpickled came from)."""
    return _state.peer


def on_discard(undo: Callable[[], None]) -> None:
    """From a reducer: call ``undo`` if the pickling now under way is thrown away.

    A reducer with a side effect (pickling an RRef counts a fork) registers
    its undo here; it runs if this attempt fails or is retried with cloudpickle,
    or if ``encode`` refuses the message it made, so that only the pickling
    that is sent has effects."""
    if _state.undo is not None:
        _state.undo.append(undo)


def wait_for(future: Any) -> None:
    """From a rebuild function: the message being unpickled must not run
    before ``future`` is done (an RRef it names whose value is still being
    created here). ``loads_waiting`` returns these."""
    if _state.waits is not None:
        _state.waits.append(future)


# -- Encoding ------------------------------------------------------------------
class _NeedsCloudpickle(Exception):
    pass


def _pickled_by_value(obj: Any) -> bool:
    """Whether ``obj`` is code the receiver cannot import by name."""
    if not isinstance(obj, types.FunctionType):
        return False
    if "<locals>" in obj.__qualname__ or obj.__name__ == "<lambda>":
        return True
    return obj.__module__ == "__main__" and not (_state.same_main and _in_main(obj))


def _in_main(function: types.FunctionType) -> bool:
    """Whether ``__main__`` has ``function`` under its name (not a redefined one)."""
    found: Any = sys.modules["__main__"]
    for part in function.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is function


_main_fingerprint: str | None = None


def main_fingerprint() -> str:
    """A digest of this process's ``__main__`` script ("" without one): two
    workers with the same digest can name each other's ``__main__`` functions."""
    global _main_fingerprint
    if _main_fingerprint is None:
        path = getattr(sys.modules["__main__"], "__file__", None)
        try:
            with open(path, "rb") as script:  # type: ignore[arg-type]
                _main_fingerprint = hashlib.sha256(script.read()).hexdigest()
        except (OSError, TypeError):
            _main_fingerprint = ""
    return _main_fingerprint


# What the pickler saves by name: saving it makes no object that could run code when freed.
_BY_NAME = (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)


class _FastPickler(pickle.Pickler):
    grad_tensors: list[torch.Tensor] | None = None
    storages: tensors.Storages | None = None
    # Whether this dump reduced an object (its memo may hold the only
    # reference to what the reduction made): see ``_clear_memo``.
    reduced = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _BY_NAME):
            if _pickled_by_value(obj):
                raise _NeedsCloudpickle
            return NotImplemented
        self.reduced = True
        return tensors.reduce_tensor(self, obj)


def _clear_memo(pickler: Any) -> None:
    """Empty a reused pickler's memo with nothing freed inside ``clear_memo``:
    CPython 3.11's frees the entries one by one and empties its table (which
    the collector walks) only at the end, and freeing a tensor releases the
    GIL, so a collection on another thread meanwhile walked freed objects
    (a SIGSEGV under the fuzz suite). The memo may hold the only reference to
    what a reduction made (a sparse tensor's parts): after a dump that reduced
    anything, a copy holds them while the memo is cleared, and they are freed
    with it, a dict the collector stops tracking as it dies."""
    if getattr(pickler, "reduced", True):
        pickler.reduced = False
        held = pickler.memo.copy()
        pickler.clear_memo()
        del held
    else:
        pickler.clear_memo()


by_value.remember_submodules()  # cloudpickle's slow lookup, once per function's code


class _CodePickler(cloudpickle.Pickler):
    grad_tensors: list[torch.Tensor] | None = None
    storages: tensors.Storages | None = None

    def reducer_override(self, obj: Any) -> Any:
        reduced = tensors.reduce_tensor(self, obj)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


class _Scratch(threading.local):
    """Per-thread reusable pickler: building one is most of the cost of a
    small message."""

    def __init__(self) -> None:
        self.renew()
        self.busy = False  # a reducer that pickles (re-entrant dumps) gets fresh objects

    def renew(self) -> None:
        """A fresh pickler. After a large message: a pickler's memo table keeps
        the size it grew to, and ``clear_memo`` walks all of it, so one message
        of 100,000 objects made every later call on the thread pay ~1 ms."""
        self.out = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.pickler = _FastPickler(self.out, PICKLE_PROTOCOL, buffer_callback=self.buffers.append)


_scratch = _Scratch()
# A payload larger than this may have grown the pickler's memo table: renew it.
_RENEW_AFTER = 16 << 10


def _dump_with(pickler: Any, out: io.BytesIO, buffers: list, obj: Any) -> tuple:
    grad_tensors: list[torch.Tensor] = []
    pickler.grad_tensors = grad_tensors
    previous_undo, _state.undo = _state.undo, []
    try:
        pickler.dump(obj)
        storages = pickler.storages
        spans = storages.shared() if storages is not None and storages.repeated else None
        if spans:  # tensors that view one storage: again, with its bytes sent once
            _undo()
            out.seek(0)
            out.truncate()
            buffers.clear()
            grad_tensors.clear()
            _clear_memo(pickler)
            pickler.storages = tensors.Storages(spans)
            pickler.dump(obj)
    except BaseException:  # this attempt's output is thrown away (retry or failure)
        _undo()
        raise
    finally:
        if previous_undo is not None:  # kept: an enclosing ``encode`` may refuse it still
            previous_undo.extend(_state.undo)
        _state.undo = previous_undo
        # A reused pickler must not keep the tensors alive.
        pickler.grad_tensors = pickler.storages = None
    return out.getvalue(), list(buffers), grad_tensors


def _undo() -> None:
    """Undo the side effects of a pickling thrown away (``on_discard``)."""
    undo, _state.undo = _state.undo, []
    for step in reversed(undo or ()):
        step()


def dumps(
    obj: Any, peer: Any = None, same_main: bool = False
) -> tuple[bytes, list[pickle.PickleBuffer], list]:
    """Pickle ``obj`` for ``peer`` (``same_main``: it runs this worker's
    ``__main__`` script): (payload, out-of-band buffers, tensors that require grad)."""
    previous_peer, _state.peer = _state.peer, peer
    previous_main, _state.same_main = _state.same_main, same_main
    scratch = _scratch
    try:
        if not scratch.busy:
            scratch.busy = True
            try:
                return _dump_with(scratch.pickler, scratch.out, scratch.buffers, obj)
            except _NeedsCloudpickle:
                pass
            finally:
                if scratch.out.tell() > _RENEW_AFTER or len(scratch.buffers) > 256:
                    scratch.renew()
                else:
                    scratch.out.seek(0)
                    scratch.out.truncate()
                    scratch.buffers.clear()
                    _clear_memo(scratch.pickler)
                scratch.busy = False
        else:
            try:
                out, buffers = io.BytesIO(), list[pickle.PickleBuffer]()
                pickler = _FastPickler(out, PICKLE_PROTOCOL, buffer_callback=buffers.append)
                return _dump_with(pickler, out, buffers, obj)
            except _NeedsCloudpickle:
                pass
        out, buffers = io.BytesIO(), list[pickle.PickleBuffer]()
        code_pickler = _CodePickler(out, PICKLE_PROTOCOL, buffer_callback=buffers.append)
        return _dump_with(code_pickler, out, buffers, obj)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
        raise SerializationError(f"cannot pickle {_describe(obj)}: {exc}") from exc
    finally:
        _state.peer, _state.same_main = previous_peer, previous_main


def encode(
    kind: int,
    request_id: int,
    obj: Any,
    *,
    autograd_context_id: int = 0,
    peer: Any = None,
    max_message_size: int = 0,
    shared_memory: Placer | None = None,
    shm_threshold: int = 256 << 10,
    same_main: bool = False,
    check_context: Callable[[int], None] | None = None,
) -> Outgoing:
    """Encode one message into frame pieces. Raises SerializationError or
    MessageTooLargeError without side effects on the stream.

    With ``shared_memory``, buffers of ``shm_threshold`` bytes or more are
    copied into its slots and only their descriptors travel in the frame.
    ``same_main``: the peer runs this worker's ``__main__`` script (see ``dumps``).
    ``check_context``: called with ``autograd_context_id`` once pickling found
    tensors that require grad; what it raises refuses the message as a refusal
    for size does, its pickling undone (distributed autograd: a context that
    ended on this worker)."""
    undo: list[Callable[[], None]] = []
    previous_undo, _state.undo = _state.undo, undo
    try:
        pickled = dumps(obj, peer, same_main)
    finally:
        _state.undo = previous_undo
    try:
        if check_context is not None and pickled[2]:
            check_context(autograd_context_id)
        return _framed(
            kind,
            request_id,
            pickled,
            autograd_context_id,
            peer,
            max_message_size,
            shared_memory,
            shm_threshold,
        )
    except BaseException:  # refused after pickling (too large): its side effects go
        for step in reversed(undo):
            step()
        raise


def _framed(
    kind: int,
    request_id: int,
    pickled: tuple,
    autograd_context_id: int,
    peer: Any,
    max_message_size: int,
    shared_memory: Placer | None,
    shm_threshold: int,
) -> Outgoing:
    """``encode``'s frame of a pickled message, or MessageTooLargeError."""
    payload, buffers, grad_tensors = pickled
    if not buffers and not (max_message_size and len(payload) > max_message_size):
        first = compact_first(kind, request_id, autograd_context_id, payload, ())
        return Outgoing([first], len(first), 0, grad_tensors)  # the commonest: no tensor
    if len(buffers) > MAX_BUFFERS:
        raise MessageTooLargeError(
            f"message to {peer} has {len(buffers)} tensor buffers, more than the "
            f"{MAX_BUFFERS} a message may carry"
        )
    raw = [buffer.raw() for buffer in buffers]
    sizes = [len(view) for view in raw]
    tensor_bytes = sum(sizes)
    if max_message_size and len(payload) + tensor_bytes > max_message_size:
        raise MessageTooLargeError(
            f"message of {len(payload) + tensor_bytes} bytes to {peer} exceeds "
            f"max_message_size={max_message_size}"
        )
    if shared_memory is None or not sizes or max(sizes) < shm_threshold:
        first = compact_first(kind, request_id, autograd_context_id, payload, sizes)
        return Outgoing([first, *raw], len(first) + tensor_bytes, tensor_bytes, grad_tensors)
    # Some buffers go through shared memory: a protobuf envelope, with their descriptors.
    envelope = Envelope(
        kind=kind,
        request_id=request_id,
        autograd_context_id=autograd_context_id,
        payload_size=len(payload),
    )
    streamed = []
    for index, view in enumerate(raw):
        shared = shared_memory.place(view, kind == REPLY) if sizes[index] >= shm_threshold else None
        if shared is None:
            streamed.append(view)
        else:
            envelope.shared_buffers[index].CopyFrom(shared)
            sizes[index] = 0
    envelope.buffer_sizes.extend(sizes)
    head = envelope.SerializeToString()
    first = HEADER.pack(len(head)) + head + payload
    size = len(first) + sum(sizes)
    return Outgoing([first, *streamed], size, tensor_bytes, grad_tensors)


def _describe(obj: Any) -> str:
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[0]):
        return f"the arguments of {getattr(obj[0], '__qualname__', obj[0])!r}"
    return f"a value of type {type(obj).__name__}"


# -- Decoding ------------------------------------------------------------------
Unpickle = Callable[..., Any]  # pickle.loads, or restricted.loads: the agent's choice


def loads(
    frame: Frame,
    peer: Any = None,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    unpickle: Unpickle = pickle.loads,
) -> Any:
    """Unpickle a frame's payload with ``unpickle``; ``tensor_hook`` sees each
    tensor that required grad."""
    return loads_waiting(frame, peer, tensor_hook, unpickle)[0]


def loads_waiting(
    frame: Frame,
    peer: Any = None,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    unpickle: Unpickle = pickle.loads,
) -> tuple[Any, list[Any]]:
    """``loads``, and the futures the message must wait for before it runs (``wait_for``)."""
    previous = _state.peer, tensors.receiving.hook, _state.waits
    waits: list[Any] = []
    _state.peer, tensors.receiving.hook, _state.waits = peer, tensor_hook, waits
    try:
        unpickle = restricted.guarded(unpickle, frame.payload)
        return unpickle(frame.payload, buffers=frame.buffers), waits
    except Exception as exc:
        hint = ""
        if isinstance(exc, AttributeError):  # a function or class this side lacks
            hint = (
                " (the RPC pickler does not serialize the code of functions defined in "
                "modules: define them on both caller and callee)"
            )
        raise SerializationError(f"cannot unpickle a message from {peer}: {exc!r}{hint}") from exc
    finally:
        _state.peer, tensors.receiving.hook, _state.waits = previous
        frame.buffers = []  # the tensors hold them now: freed with the last of them
        frame.consumed()
