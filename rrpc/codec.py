"""One message ⇄ frame bytes. No I/O: bytes in, frames out (and back).

Frame layout (schema and field meanings in ``proto/rrpc.proto``)::

    +-----------+--------------------+------------------+----------+-----+------------+
    | u32 LE  H | Envelope (H bytes) | payload (pickle) | buffer 0 | ... | buffer n-1 |
    +-----------+--------------------+------------------+----------+-----+------------+

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
- A received tensor is built over a buffer the reader allocated for it: one
  copy from the socket's packets, none after. A buffer sent through shared
  memory (``shm.py``) has size 0 in the stream and a descriptor in the
  envelope; the reader builds the tensor over the peer's slot, with no copy.
- Every length is checked before it is trusted: the envelope's size, the
  frame's total (shared buffers included) against ``max_message_size``, and
  its count of buffers against ``MAX_BUFFERS``; the error gives both numbers.
- Memory is committed as bytes arrive, never as they are announced: a buffer
  declared larger than ``GROW_FROM`` grows (``_GrowingBuffer``: anonymous
  memory enlarged in place by ``mremap``, no copy) as its bytes come in, so a
  frame that declares 16 GiB and sends a few KiB costs a few MiB. A stream
  that ends drops its reader's partial frame (``FrameReader.close``).
- With an auth token, each direction of a stream opens with a HANDSHAKE frame
  (``handshake_frame``; see ``auth.py``): an envelope alone, which
  ``read_handshake`` reads strictly, before anything else the peer sent.
- Restricted mode (``set_restricted``, chosen once at ``init_rpc``): payloads
  are unpickled by ``_RestrictedUnpickler``, which accepts only safe globals
  and refuses the rest by name before importing or running anything; see
  "Restricted unpickling" below for what is accepted and why (torch's own
  tensor reducers are not). The default path is ``pickle.loads``, unchanged.
- The pickle hooks of upper layers (RRefs need to know where they travel,
  distributed autograd must see tensors that require grad) read
  ``current_peer()`` and the tensor hook that ``loads`` installs; a reducer
  with side effects registers their undo with ``on_discard``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import mmap
import pickle
import pickletools
import struct
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import torch

from rrpc._proto.rrpc_pb2 import Envelope, Handshake, SharedBuffer
from rrpc.messages import (
    HANDSHAKE,
    MessageTooLargeError,
    RemoteError,
    RpcError,
    SerializationError,
)
from rrpc.shm import Placer

HEADER = struct.Struct("<I")
MAX_ENVELOPE_SIZE = 1 << 20  # an envelope is tens of bytes; anything near this is garbage
# Tensor buffers in one frame. Each costs the receiver a Python object (~100
# bytes) for as little as one byte on the wire; a message of more tensors than
# this is refused by its sender.
MAX_BUFFERS = 1 << 16
GROW_FROM = 32 << 20  # a received buffer larger than this grows as its bytes arrive
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


class ProtocolError(RpcError):
    """Bytes on a stream that are not a well-formed frame."""


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
@dataclass
class Outgoing:
    """An encoded frame: ``pieces`` written in order are the frame's bytes."""

    pieces: list[Any]  # bytes, then one memoryview per tensor buffer sent in the stream
    size: int  # bytes in the stream
    tensor_bytes: int  # bytes of all tensor buffers, in the stream or in shared memory
    # Tensors in the message that require grad, in pickling order (for autograd).
    grad_tensors: list[torch.Tensor] = field(default_factory=list)


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


def _rebuild_parameter(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    if requires_grad and _state.tensor_hook is not None:
        # In a distributed autograd context a parameter is a tensor that
        # requires grad like any other (as in torch): its gradient goes back.
        return _rebuild_tensor(buffer, dtype_index, shape, True)
    tensor = _rebuild_tensor(buffer, dtype_index, shape, False)
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


# Sparse layouts travel as their parts: each part a strided tensor (out of band, as above).
_COMPRESSED_LAYOUTS = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]


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


class _FastPickler(pickle.Pickler):
    grad_tensors: list[torch.Tensor] | None = None

    def reducer_override(self, obj: Any) -> Any:
        if _pickled_by_value(obj):
            raise _NeedsCloudpickle
        return _reduce_tensor(self, obj)


class _CodePickler(cloudpickle.Pickler):
    grad_tensors: list[torch.Tensor] | None = None

    def reducer_override(self, obj: Any) -> Any:
        reduced = _reduce_tensor(self, obj)
        return super().reducer_override(obj) if reduced is NotImplemented else reduced


class _Scratch(threading.local):
    """Per-thread reusable pickler and envelope: building them is most of the
    cost of a small message."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.pickler = _FastPickler(self.out, PICKLE_PROTOCOL, buffer_callback=self.buffers.append)
        self.envelope = Envelope()
        self.busy = False  # a reducer that pickles (re-entrant dumps) gets fresh objects


_scratch = _Scratch()


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
                scratch.out.seek(0)
                scratch.out.truncate()
                scratch.buffers.clear()
                scratch.pickler.clear_memo()
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
    shm_threshold: int = 1 << 20,
    same_main: bool = False,
) -> Outgoing:
    """Encode one message into frame pieces. Raises SerializationError or
    MessageTooLargeError without side effects on the stream.

    With ``shared_memory``, buffers of ``shm_threshold`` bytes or more are
    copied into its slots and only their descriptors travel in the frame.
    ``same_main``: the peer runs this worker's ``__main__`` script (see ``dumps``)."""
    payload, buffers, grad_tensors = dumps(obj, peer, same_main)
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
    envelope = _scratch.envelope
    envelope.Clear()
    envelope.kind = kind
    envelope.request_id = request_id
    envelope.autograd_context_id = autograd_context_id
    envelope.payload_size = len(payload)
    streamed = raw
    if shared_memory is not None and sizes and max(sizes) >= shm_threshold:
        streamed = []
        for index, view in enumerate(raw):
            shared = shared_memory.place(view) if sizes[index] >= shm_threshold else None
            if shared is None:
                streamed.append(view)
            else:
                envelope.shared_buffers[index].CopyFrom(shared)
                sizes[index] = 0
    if sizes:
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
@dataclass
class Frame:
    envelope: Envelope
    payload: bytes | memoryview
    # One writable 1-D uint8 buffer per out-of-band buffer: a numpy array when
    # it came in the stream, a tensor over the slot when through shared memory.
    buffers: list[np.ndarray | torch.Tensor]
    # Called once, when the payload is unpickled (``loads``) or the frame is
    # dropped undecoded: the transport's count of a peer's requests waiting
    # to be run (transport._InFlight).
    on_consumed: Callable[[], None] | None = None

    def tensor_bytes(self) -> int:
        return sum(len(buffer) for buffer in self.buffers)

    def consumed(self) -> None:
        callback, self.on_consumed = self.on_consumed, None
        if callback is not None:
            callback()

    def __del__(self) -> None:
        self.consumed()


def loads(
    frame: Frame,
    peer: Any = None,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Unpickle a frame's payload; ``tensor_hook`` sees each tensor that required grad."""
    return loads_waiting(frame, peer, tensor_hook)[0]


def loads_waiting(
    frame: Frame,
    peer: Any = None,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[Any, list[Any]]:
    """``loads``, and the futures the message must wait for before it runs (``wait_for``)."""
    previous = _state.peer, _state.tensor_hook, _state.waits
    waits: list[Any] = []
    _state.peer, _state.tensor_hook, _state.waits = peer, tensor_hook, waits
    try:
        return _unpickle(frame.payload, buffers=frame.buffers), waits
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
        frame.consumed()


# -- Restricted unpickling ---------------------------------------------------------
# What a peer's pickle may name in restricted mode (``set_restricted``). A pickle
# runs code only through the globals it names (REDUCE calls them, BUILD calls
# their instances' ``__setstate__``): refusing every global but these, before
# it is imported or looked up, leaves a peer nothing to run but safe
# constructors, rrpc's rebuild functions and what the worker exposed.
#
# Decisions:
# - Tensors: only rrpc's own rebuild functions (``_rebuild_*`` above), which
#   check what they build (``reshape``/``as_strided`` are bounds-checked by
#   torch, sparse invariants are checked). Torch's own reducers are refused:
#   ``torch._utils._rebuild_*`` take storages that torch pickles through
#   ``torch.storage._load_from_bytes``, i.e. a nested ``torch.load`` with
#   ``weights_only=False``, which runs any pickle. So tensors that rrpc does
#   not reduce itself (quantized, tensor subclasses, exotic layouts or dtypes)
#   cannot travel in restricted mode. A BUILD on a tensor reaches
#   ``Tensor.__setstate__`` (``set_`` over another tensor), which torch
#   bounds-checks.
# - Exceptions: builtin exception classes and rrpc's own arrive as they are; any
#   other exception class (if its module is loaded here) arrives as a
#   ``RemoteError`` naming it, built from its arguments' text, and is never
#   instantiated.
# - torch's optimizer classes (``torch.optim``): accepted, as
#   ``DistributedOptimizer`` sends them; constructing one runs no peer code.
# - ``builtins.getattr`` (how pickle names classmethods and torch's builtin
#   functions, ``torch.add``) is replaced by a getattr on a class that returns
#   only what is exposed or rrpc-internal.
# - Nothing is imported to answer a pickle: a global whose module this worker
#   has not imported is refused, and names are looked up in ``__dict__``s, so
#   no module ``__getattr__`` nor descriptor runs.
class RefusedGlobalError(pickle.UnpicklingError):
    """Restricted mode refused a global a pickle named."""


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
    from rrpc.messages import RemoteError

    text = str(args[0]) if len(args) == 1 else ", ".join(map(str, args))
    return RemoteError(type_name, text)


def _restricted_getattr(owner: Any, name: Any) -> Any:
    from rrpc.functions import is_exposed, is_internal_call

    if isinstance(owner, type) and isinstance(name, str):
        value = getattr(owner, name, _MISSING)
        if is_exposed(value) or is_internal_call(value):
            return value
    where = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"
    raise _refuse(f"the attribute {where}.{name}", " (not exposed)")


_safe_globals: dict[tuple[str, str], Any] = {}


def _build_safe_globals() -> dict[tuple[str, str], Any]:
    import builtins
    import collections

    from rrpc import messages, rref
    from rrpc.functions import _internal_calls
    from rrpc.nn.api import remote_module

    safe: list[Any] = [
        list, tuple, dict, set, frozenset, str, bytes, bytearray, int, float, bool, complex,
        slice, range, collections.OrderedDict, torch.device, torch.Size,
        _rebuild_tensor, _rebuild_strided, _rebuild_parameter, _rebuild_sparse,
        messages.WorkerInfo, rref._rebuild, rref._Failed, remote_module._remote_module_receiver,
    ]  # fmt: skip
    safe += [f for f in vars(remote_module._GeneratedMethods).values() if callable(f)]
    safe += _internal_calls().values()
    table = {(getattr(f, "__module__", "builtins"), f.__qualname__): f for f in safe}
    table[("builtins", "getattr")] = _restricted_getattr
    # How torch pickles a torch.layout: a lookup of torch's layouts by name.
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    table[("torch._C", "_VariableFunctionsClass")] = torch._C._VariableFunctionsClass  # type: ignore[attr-defined]
    for name, value in vars(builtins).items():
        if isinstance(value, type) and issubclass(value, BaseException):
            table[("builtins", name)] = value
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            table[("torch", name)] = value
    return table


def _restricted_global(module: str, name: str) -> Any:
    from rrpc.functions import is_exposed

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


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _safe_globals.get((module, name))
        return found if found is not None else _restricted_global(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError("restricted mode refuses persistent ids in a pickle")


# A memo index a pickle may name. CPython 3.11's unpickler grows its memo to
# twice the largest index PUT / LONG_BINPUT names and clears every slot while
# holding the GIL: a 9-byte pickle naming index 2**28 took 8.9 s and 4 GiB
# here. rrpc's own pickles (protocol 5) use MEMOIZE, which only appends.
MAX_MEMO_INDEX = 1 << 20
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _check_memo_indices(data: Any) -> None:
    """Refuse a pickle that names a memo index above ``MAX_MEMO_INDEX``
    (restricted mode walks every pickle's opcodes for it, before unpickling)."""
    try:
        for opcode, argument, _ in pickletools.genops(bytes(data)):
            if opcode.name in _MEMO_PUTS and int(argument or 0) > MAX_MEMO_INDEX:
                raise RefusedGlobalError(
                    f"restricted mode refuses a pickle that names memo index {argument} "
                    f"(above {MAX_MEMO_INDEX}): unpickling it would allocate its memo"
                )
    except (ValueError, TypeError):  # malformed opcodes: the unpickler says why
        return


def _restricted_loads(data: Any, *, buffers: Any = None) -> Any:
    _check_memo_indices(data)
    return _RestrictedUnpickler(io.BytesIO(data), buffers=buffers).load()


_unpickle: Callable[..., Any] = pickle.loads  # what loads() unpickles with


def set_restricted(on: bool) -> None:
    """Unpickle every message from now on with (or without) restrictions."""
    global _unpickle
    if on and not _safe_globals:
        _safe_globals.update(_build_safe_globals())
    _unpickle = _restricted_loads if on else pickle.loads


def unpickle(data: bytes) -> Any:
    """Unpickle bytes a peer sent inside a message (an error reply's exception),
    with the restrictions messages have."""
    return _unpickle(data)


def _declared_size(envelope: Envelope) -> int:
    """The bytes a frame's envelope announces: stream and shared-memory buffers."""
    shared = sum(buffer.size for buffer in envelope.shared_buffers.values())
    return envelope.payload_size + sum(envelope.buffer_sizes) + shared


class _GrowingBuffer:
    """A received buffer declared larger than ``GROW_FROM``, filled as its
    bytes arrive: anonymous memory that starts small and doubles (``mremap``
    moves pages, it copies nothing) until it holds the declared size. What
    was announced but never sent costs neither memory nor address space
    (beyond the first ``_FIRST`` bytes)."""

    __slots__ = ("size", "_map")
    _FIRST = 4 << 20

    def __init__(self, size: int):
        self.size = size
        self._map: mmap.mmap | None = None

    def __len__(self) -> int:
        return self.size

    def write(self, start: int, data: memoryview) -> None:
        end = start + len(data)
        memory = self._map
        capacity = len(memory) if memory is not None else 0
        if end > capacity:
            capacity = min(self.size, max(end, 2 * capacity, self._FIRST))
            if memory is None:
                memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                self._map = memory
            else:
                memory.resize(capacity)
            if _HUGE_PAGES is not None:  # as numpy does for large arrays: fewer page faults
                memory.madvise(_HUGE_PAGES)
        assert memory is not None
        memory[start:end] = data

    def array(self) -> np.ndarray:
        """The filled buffer, for the tensor to be built over (no copy)."""
        assert self._map is not None and len(self._map) == self.size
        return np.frombuffer(self._map, dtype=np.uint8)


_HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)


class FrameReader:
    """Reassembles frames from a stream's packets, whatever their cut.

    ``feed(packet)`` returns the frames the packet completes. Each out-of-band
    buffer is copied once, from the packets into a tensor allocated for it;
    memory is taken as the bytes arrive (see the rules at the top).
    """

    def __init__(
        self,
        max_message_size: int = 0,
        attach: Callable[[SharedBuffer], torch.Tensor] | None = None,
    ):
        self.max_message_size = max_message_size
        self._attach = attach  # builds a tensor over a shared-memory descriptor
        self._head = bytearray()  # bytes of an incomplete header+envelope
        self._envelope: Envelope | None = None
        self._payload = bytearray()
        self._buffers: list[np.ndarray | torch.Tensor] = []
        self._target: np.ndarray | _GrowingBuffer | None = None  # the buffer being filled
        self._filled = 0

    def close(self) -> None:
        """The stream ended: drop the frame being read, and its memory."""
        self._head = bytearray()
        self._envelope, self._target, self._buffers = None, None, []
        self._payload = bytearray()

    def feed(self, packet: bytes) -> list[Frame]:
        return list(self.frames_in(packet))

    def frames_in(self, packet: bytes) -> Iterator[Frame]:
        """The frames ``packet`` completes, each read only when asked for: a
        reader that stops asking (its peer has too many requests waiting)
        holds the packet's bytes, not thousands of decoded frames."""
        view = memoryview(packet)
        position, end = 0, len(packet)
        while True:
            if self._envelope is None:
                if position == end:
                    return
                if not self._head:
                    whole = self._read_whole_frame(view, position)
                    if whole is not None:
                        position = whole[1]
                        yield whole[0]
                        continue
                position = self._read_envelope(view, position)
                continue
            self._open_next_buffer()
            if self._complete():
                yield self._take()
            elif position == end:
                return
            else:
                position = self._read_body(view, position)

    def _read_whole_frame(self, view: memoryview, position: int) -> tuple[Frame, int] | None:
        """The common case, a frame wholly inside this packet, without the
        state machine; None leaves it to the general path."""
        end = len(view)
        if end - position < HEADER.size:
            return None
        (head_size,) = HEADER.unpack_from(view, position)
        body = position + HEADER.size + head_size
        if head_size > MAX_ENVELOPE_SIZE or body > end:
            return None
        envelope = Envelope()
        try:
            envelope.ParseFromString(view[position + HEADER.size : body])
        except Exception as exc:
            raise ProtocolError(f"unparseable envelope: {exc}") from exc
        sizes = list(envelope.buffer_sizes)
        payload_end = body + envelope.payload_size
        frame_end = payload_end + sum(sizes)
        if frame_end > end or envelope.shared_buffers or len(sizes) > MAX_BUFFERS:
            return None  # also checks the limits, counting shared buffers
        if self.max_message_size and frame_end - body > self.max_message_size:
            return None  # the general path raises the error
        buffers: list[np.ndarray | torch.Tensor] = []
        offset = payload_end
        for size in sizes:
            buffer = np.empty(size, dtype=np.uint8)
            buffer[:] = np.frombuffer(view, dtype=np.uint8, count=size, offset=offset)
            buffers.append(buffer)
            offset += size
        return Frame(envelope, bytes(view[body:payload_end]), buffers), frame_end

    def _read_envelope(self, view: memoryview, position: int) -> int:
        needed = HEADER.size - len(self._head)
        if needed > 0:
            take = min(needed, len(view) - position)
            self._head += view[position : position + take]
            position += take
            if len(self._head) < HEADER.size:
                return position
        (head_size,) = HEADER.unpack_from(self._head)
        if head_size > MAX_ENVELOPE_SIZE:
            raise ProtocolError(f"envelope of {head_size} bytes (limit {MAX_ENVELOPE_SIZE})")
        needed = HEADER.size + head_size - len(self._head)
        take = min(needed, len(view) - position)
        self._head += view[position : position + take]
        position += take
        if take < needed:
            return position
        envelope = Envelope()
        try:
            envelope.ParseFromString(bytes(self._head[HEADER.size :]))
        except Exception as exc:
            raise ProtocolError(f"unparseable envelope: {exc}") from exc
        size = _declared_size(envelope)
        if self.max_message_size and size > self.max_message_size:
            raise MessageTooLargeError(
                f"incoming message of {size} bytes exceeds max_message_size={self.max_message_size}"
            )
        if len(envelope.buffer_sizes) > MAX_BUFFERS:
            raise ProtocolError(
                f"incoming message of {len(envelope.buffer_sizes)} tensor buffers exceeds the "
                f"limit of {MAX_BUFFERS}"
            )
        self._head.clear()
        self._envelope = envelope
        self._payload = bytearray()
        self._buffers = []
        self._target, self._filled = None, 0
        return position

    # The body is the payload, then each buffer in turn. _target is the buffer
    # being filled and _filled how much of it is.
    def _payload_missing(self) -> int:
        assert self._envelope is not None
        return self._envelope.payload_size - len(self._payload)

    def _open_next_buffer(self) -> None:
        """Once the payload is in, allocate buffers as the previous one fills
        (zero-sized ones complete at once)."""
        envelope = self._envelope
        assert envelope is not None
        sizes = envelope.buffer_sizes
        while (
            not self._payload_missing()
            and len(self._buffers) < len(sizes)
            and (self._target is None or self._filled == len(self._target))
        ):
            index = len(self._buffers)
            if envelope.shared_buffers and index in envelope.shared_buffers:
                if self._attach is None:
                    raise ProtocolError(
                        "shared-memory buffer on a stream that does not accept them"
                    )
                if sizes[index]:  # its bytes would be read as the next buffer or frame
                    raise ProtocolError(
                        f"shared-memory buffer {index} also has {sizes[index]} bytes in the stream"
                    )
                try:
                    tensor = self._attach(envelope.shared_buffers[index])
                except Exception as exc:  # refused, or nothing to map there
                    raise ProtocolError(f"bad shared-memory descriptor: {exc}") from exc
                self._buffers.append(tensor)
                self._target = None
                continue
            size = sizes[index]
            buffer = np.empty(size, dtype=np.uint8) if size <= GROW_FROM else _GrowingBuffer(size)
            self._buffers.append(buffer)  # type: ignore[arg-type]  # a _GrowingBuffer until full
            self._target, self._filled = buffer, 0

    def _complete(self) -> bool:
        return (
            not self._payload_missing()
            and len(self._buffers) == len(self._envelope.buffer_sizes)  # type: ignore[union-attr]
            and (self._target is None or self._filled == len(self._target))
        )

    def _read_body(self, view: memoryview, position: int) -> int:
        available = len(view) - position
        missing = self._payload_missing()
        if missing:
            take = min(missing, available)
            self._payload += view[position : position + take]
            return position + take
        target = self._target
        assert target is not None
        take = min(len(target) - self._filled, available)
        if isinstance(target, _GrowingBuffer):
            target.write(self._filled, view[position : position + take])
            if self._filled + take == len(target):
                self._buffers[-1] = target.array()
        else:
            target[self._filled : self._filled + take] = np.frombuffer(
                view, dtype=np.uint8, count=take, offset=position
            )
        self._filled += take
        return position + take

    def _take(self) -> Frame:
        envelope = self._envelope
        assert envelope is not None
        frame = Frame(envelope, bytes(self._payload), self._buffers)
        self._envelope, self._target, self._buffers = None, None, []
        return frame


def packets(pieces: Iterator[Any], packet_size: int) -> Iterator[bytes]:
    """Cut a sequence of frame pieces into packets of at most ``packet_size`` bytes.

    Small pieces are joined (batching several frames into one packet); a large
    buffer is sliced (a memoryview slice, copied once by ``join``).
    """
    batch: list[Any] = []
    batched = 0
    for piece in pieces:
        length = len(piece)
        offset = 0
        while offset < length:
            take = min(packet_size - batched, length - offset)
            batch.append(piece if take == length else memoryview(piece)[offset : offset + take])
            batched += take
            offset += take
            if batched == packet_size:
                yield b"".join(batch)
                batch, batched = [], 0
    if batch:
        yield b"".join(batch)


# -- Errors that travel ---------------------------------------------------------
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
    return blob, name, str(exc), text, where


def rebuild_remote_exception(payload: tuple) -> BaseException:
    blob, name, message, text, where = payload
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = unpickle(blob)  # restricted mode: only safe classes
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(name, message, text)
    if getattr(exc, "remote_origin", None) is not None:
        return exc  # passed on by the peer: it has its origin's traceback and note already
    exc.remote_traceback = text  # type: ignore[attr-defined]
    exc.remote_origin = where  # type: ignore[attr-defined]
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"\nRemote traceback (on {where}):\n{text.rstrip()}")
    return exc


# -- The auth handshake ----------------------------------------------------------
MAX_HANDSHAKE_ENVELOPE = 256  # a handshake envelope is ~75 bytes


def handshake_frame(nonce: bytes, proof: bytes) -> bytes:
    """The frame that opens one direction of an authenticated stream (``auth.py``)."""
    envelope = Envelope(kind=HANDSHAKE)
    envelope.handshake.nonce = nonce
    envelope.handshake.proof = proof
    head = envelope.SerializeToString()
    return HEADER.pack(len(head)) + head


def read_handshake(packet: bytes) -> tuple[Handshake, bytes]:
    """The handshake frame a stream's first packet must open with, and the
    bytes after it (frames to read once the peer is trusted).

    Strict, and reads nothing of the peer's but that small envelope: anything
    else (another kind, a payload, buffers, a frame cut across packets) is a
    ``ProtocolError``."""
    if len(packet) < HEADER.size:
        raise ProtocolError(f"{len(packet)} bytes where an auth handshake was expected")
    (head_size,) = HEADER.unpack_from(packet)
    end = HEADER.size + head_size
    if head_size > MAX_HANDSHAKE_ENVELOPE or end > len(packet):
        raise ProtocolError(f"an envelope of {head_size} bytes is not an auth handshake")
    envelope = Envelope()
    try:
        envelope.ParseFromString(memoryview(packet)[HEADER.size : end])
    except Exception as exc:
        raise ProtocolError(f"unparseable handshake envelope: {exc}") from exc
    if envelope.kind != HANDSHAKE:
        raise ProtocolError(f"a frame of kind {envelope.kind} where an auth handshake was expected")
    if envelope.payload_size or envelope.buffer_sizes or envelope.shared_buffers:
        raise ProtocolError("an auth handshake carries no payload nor buffers")
    return envelope.handshake, packet[end:]
