"""One message ⇄ a frame's payload and tensor buffers: pickling, and its undoing.

The frame around them (layout, limits, reassembly) is ``wire.py``'s; what
restricted mode lets a pickle name is ``restricted.py``'s.

Rules:

- The payload is pickle protocol 5. Each CPU tensor in it is reduced to an
  out-of-band ``PickleBuffer`` over the tensor's own memory, so its bytes are
  never copied through pickle; the transport writes those buffers next to the
  payload. A view of a larger storage sends only the bytes it views. A
  sparse tensor (COO, CSR, CSC, BSR, BSC) travels as its parts (indices and
  values, each such a buffer) with its size, layout and COO coalesced flag;
  it is rebuilt with its invariants checked, and requires grad as it did.
  Other layouts and quantized tensors go in band, through torch's pickling.
- Code the receiver cannot import (lambdas, closures, functions of
  ``__main__`` when the receiver runs another script) is pickled by value with
  cloudpickle; everything else goes by reference through the C pickler, which
  is faster. A function of ``__main__`` goes by reference to a worker that
  runs the same script (``same_main``), as in torch: the callee runs its own
  copy, with its own globals.
- A received tensor is built over the buffer the frame reader allocated for
  it, with no copy; a buffer that came through shared memory (``shm.py``) is
  a tensor over the peer's slot already.
- ``encode`` refuses a message the reader would refuse (more than
  ``wire.MAX_BUFFERS`` buffers, more than ``max_message_size`` bytes), before
  anything reaches the stream; the error gives both numbers.
- ``loads`` unpickles with the function the agent chose for its run:
  ``pickle.loads``, or ``restricted.loads`` in restricted mode. Nothing here
  decides which. The rebuild functions below are registered with
  ``restricted`` (they check what they build).
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
import numpy as np
import torch

from rrpc import by_value, restricted
from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import (
    REPLY,
    MessageTooLargeError,
    SerializationError,
)
from rrpc.shm import Placer
from rrpc.wire import HEADER, MAX_BUFFERS, Frame, Outgoing, compact_first

PICKLE_PROTOCOL = 5

# Tensors travel with a small int for their dtype, not a pickled torch.dtype.
DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128, torch.complex32,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]  # fmt: skip
# Newer dtypes, where this torch has them (appended: indices above stay stable).
DTYPES += [
    getattr(torch, name)
    for name in ("float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4",
                 "bits4x2")
    if hasattr(torch, name)
]  # fmt: skip
DTYPE_INDEX = {dtype: index for index, dtype in enumerate(DTYPES)}


_NUMPY_TYPES = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}  # fmt: skip


# Where numpy has the dtype, tensors are taken apart and rebuilt through numpy:
# a numpy view or reshape costs a fraction of a microsecond, a torch one 1-3 µs.
NUMPY_DTYPES = [_NUMPY_TYPES.get(dtype) for dtype in DTYPES]
_HAS_NUMPY_DTYPE = set(_NUMPY_TYPES) & set(DTYPES)


# -- Per-thread pickling state -------------------------------------------------
class _CodecState(threading.local):
    peer: Any = None  # the worker this thread is encoding for / decoding from
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    grad_tensors: list[torch.Tensor] | None = None
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
    so that only the pickling that is sent has effects."""
    if _state.undo is not None:
        _state.undo.append(undo)


def wait_for(future: Any) -> None:
    """From a rebuild function: the message being unpickled must not run
    before ``future`` is done (an RRef it names whose value is still being
    created here). ``loads_waiting`` returns these."""
    if _state.waits is not None:
        _state.waits.append(future)


# -- Encoding ------------------------------------------------------------------
def _tensor_bytes(tensor: torch.Tensor) -> pickle.PickleBuffer:
    """The bytes a tensor views, without a copy when it is contiguous.
    (Each torch call costs a microsecond or two: skip those that change nothing.)"""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype in _HAS_NUMPY_DTYPE:
        return pickle.PickleBuffer(tensor.numpy())  # type: ignore[arg-type]
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    if tensor.dtype is not torch.uint8:
        tensor = tensor.view(torch.uint8)
    return pickle.PickleBuffer(tensor.numpy())  # type: ignore[arg-type]


@restricted.allow
def _rebuild_tensor(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    if isinstance(buffer, np.ndarray):  # received on the stream: an array that owns its bytes
        np_dtype = NUMPY_DTYPES[dtype_index]
        if np_dtype is not None:
            tensor = torch.from_numpy(buffer.view(np_dtype).reshape(shape))
        else:
            tensor = torch.from_numpy(buffer).view(DTYPES[dtype_index]).reshape(shape)
    else:
        if not isinstance(buffer, torch.Tensor):  # in band (e.g. pickled to a file)
            buffer = torch.frombuffer(bytearray(memoryview(buffer)), dtype=torch.uint8)
        # A shared-memory slot: torch views keep the uint8 tensor (whose
        # release frees the slot) alive; numpy views would skip it for the map.
        tensor = buffer.view(DTYPES[dtype_index]).reshape(shape)
    return _with_grad(tensor, requires_grad)


def _with_grad(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    hook = _state.tensor_hook
    if requires_grad:
        if hook is not None:
            return hook(tensor)
        tensor.requires_grad_(True)
    return tensor


@restricted.allow
def _rebuild_strided(
    buffer: Any, dtype_index: int, shape: tuple, strides: tuple, requires_grad: bool
) -> torch.Tensor:
    span = _rebuild_tensor(buffer, dtype_index, (-1,), False)
    return _with_grad(span.as_strided(shape, strides), requires_grad)


# A non-contiguous view keeps its strides when the storage it spans (from its
# first element to its last) is small or at most this many times its own
# bytes; otherwise only its elements travel, contiguous.
_SPAN_FACTOR = 4
_SMALL_SPAN = 64 << 10


def _storage_span(tensor: torch.Tensor) -> torch.Tensor | None:
    """The 1-D run of storage a non-contiguous view spans, when sending it
    (and rebuilding the view's strides over it) is worth it; else None."""
    if tensor.is_conj() or tensor.is_neg() or tensor.numel() == 0:
        return None
    last = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    span = last + 1
    if span * tensor.element_size() > max(_SPAN_FACTOR * tensor.nbytes, _SMALL_SPAN):
        return None
    return tensor.detach().as_strided((span,), (1,))


@restricted.allow
def _rebuild_parameter(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    if requires_grad and _state.tensor_hook is not None:
        # In a distributed autograd context a parameter is a tensor that
        # requires grad like any other (as in torch): its gradient goes back.
        return _rebuild_tensor(buffer, dtype_index, shape, True)
    tensor = _rebuild_tensor(buffer, dtype_index, shape, False)
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


# Sparse layouts travel as their parts: each part a strided tensor (out of band, as above).
_COMPRESSED_LAYOUTS = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]


@restricted.allow
def _rebuild_sparse(
    layout_index: int,
    parts: tuple,
    shape: tuple,
    coalesced: bool,
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    """A sparse tensor from its parts; ``layout_index`` -1 is COO, else an index
    into ``_COMPRESSED_LAYOUTS``. The parts are checked (indices in bounds,
    the coalesced flag true), as a corrupt sparse tensor crashes the process."""
    if layout_index < 0:
        indices, values = parts
        tensor = torch.sparse_coo_tensor(
            indices, values, shape, is_coalesced=coalesced, check_invariants=True
        )
    else:
        compressed, plain, values = parts
        tensor = torch.sparse_compressed_tensor(
            compressed, plain, values, shape,
            layout=_COMPRESSED_LAYOUTS[layout_index], check_invariants=True,
        )  # fmt: skip
    if parameter and not (requires_grad and _state.tensor_hook is not None):
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return _with_grad(tensor, requires_grad)


def _reduce_sparse(pickler: Any, obj: torch.Tensor, parameter: bool) -> Any:
    layout = obj.layout
    if layout is torch.sparse_coo:
        layout_index = -1
    elif layout in _COMPRESSED_LAYOUTS:
        layout_index = _COMPRESSED_LAYOUTS.index(layout)
    else:
        return NotImplemented  # torch's own pickling, in band
    if not obj.is_cpu:
        obj = obj.cpu()
    requires_grad = obj.requires_grad
    if requires_grad and pickler.grad_tensors is not None:
        pickler.grad_tensors.append(obj)  # the parts below do not require grad
    plain = obj.detach()
    coalesced = False
    if layout_index < 0:
        parts: tuple = (plain._indices(), plain._values())
        coalesced = plain.is_coalesced()
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (plain.crow_indices(), plain.col_indices(), plain.values())
    else:
        parts = (plain.ccol_indices(), plain.row_indices(), plain.values())
    shape = tuple(obj.shape)
    return _rebuild_sparse, (layout_index, parts, shape, coalesced, requires_grad, parameter)


def _reduce_tensor(pickler: Any, obj: Any) -> Any:
    kind = type(obj)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return NotImplemented
    if obj.layout != torch.strided:
        return _reduce_sparse(pickler, obj, kind is torch.nn.Parameter)
    dtype_index = DTYPE_INDEX.get(obj.dtype)
    if dtype_index is None or obj.is_quantized:
        return NotImplemented  # torch's own pickling, in band
    if not obj.is_cpu:
        obj = obj.cpu()
    requires_grad = obj.requires_grad
    if requires_grad and pickler.grad_tensors is not None:
        pickler.grad_tensors.append(obj)
    if kind is torch.Tensor and not obj.is_contiguous():
        span = _storage_span(obj)
        if span is not None:  # as torch: a view arrives a view, with its strides
            shape, strides = tuple(obj.shape), obj.stride()
            return _rebuild_strided, (
                _tensor_bytes(span),
                dtype_index,
                shape,
                strides,
                requires_grad,
            )
    rebuild = _rebuild_parameter if kind is torch.nn.Parameter else _rebuild_tensor
    return rebuild, (_tensor_bytes(obj), dtype_index, tuple(obj.shape), requires_grad)


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
    # Whether this dump reduced an object (its memo may hold the only
    # reference to what the reduction made): see ``_clear_memo``.
    reduced = False

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _BY_NAME):
            if _pickled_by_value(obj):
                raise _NeedsCloudpickle
            return NotImplemented
        self.reduced = True
        return _reduce_tensor(self, obj)


def _clear_memo(pickler: _FastPickler) -> None:
    """Empty a reused pickler's memo with nothing freed inside ``clear_memo``:
    CPython 3.11's frees the entries one by one and empties its table (which
    the collector walks) only at the end, and freeing a tensor releases the
    GIL, so a collection on another thread meanwhile walked freed objects
    (a SIGSEGV under the fuzz suite). The memo may hold the only reference to
    what a reduction made (a sparse tensor's parts): after a dump that reduced
    anything, a copy holds them while the memo is cleared, and they are freed
    with it, a dict the collector stops tracking as it dies."""
    if pickler.reduced:
        pickler.reduced = False
        held = pickler.memo.copy()
        pickler.clear_memo()
        del held
    else:
        pickler.clear_memo()


by_value.remember_submodules()  # cloudpickle's slow lookup, once per function's code


class _CodePickler(cloudpickle.Pickler):
    grad_tensors: list[torch.Tensor] | None = None

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_tensor(self, obj)
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
    except BaseException:  # this attempt's output is thrown away (retry or failure)
        for undo in reversed(_state.undo):
            undo()
        raise
    finally:
        _state.undo = previous_undo
        pickler.grad_tensors = None  # a reused pickler must not keep the tensors alive
    return out.getvalue(), list(buffers), grad_tensors


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
) -> Outgoing:
    """Encode one message into frame pieces. Raises SerializationError or
    MessageTooLargeError without side effects on the stream.

    With ``shared_memory``, buffers of ``shm_threshold`` bytes or more are
    copied into its slots and only their descriptors travel in the frame.
    ``same_main``: the peer runs this worker's ``__main__`` script (see ``dumps``)."""
    payload, buffers, grad_tensors = dumps(obj, peer, same_main)
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
    previous = _state.peer, _state.tensor_hook, _state.waits
    waits: list[Any] = []
    _state.peer, _state.tensor_hook, _state.waits = peer, tensor_hook, waits
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
        _state.peer, _state.tensor_hook, _state.waits = previous
        frame.buffers = []  # the tensors hold them now: freed with the last of them
        frame.consumed()
