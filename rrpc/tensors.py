"""Tensors ⇄ out-of-band buffers: how a tensor is taken apart for pickling, and rebuilt.

``codec.py`` pickles messages and calls ``reduce_tensor`` for every tensor it
meets; the rebuild functions here are what the pickles name (registered with
``restricted``: each checks what it builds).

Rules:

- A dense CPU tensor is an out-of-band ``PickleBuffer`` over its own memory
  (never copied through pickle), its dtype as a small int, its shape, and
  whether it requires grad. A view of a larger storage sends only the bytes
  it views; a non-contiguous view keeps its strides over the storage between
  its first and last element when that is small (``_storage_span``).
- **Storages are shared within a message, as in torch.** Tensors that view
  one storage (``(a, a[2:])``, a model's parameters over one flat buffer)
  arrive as views of one received storage: an in-place change to one shows in
  the others, and the bytes they overlap travel once. The codec notes each
  tensor's storage as it pickles (``Storages``); when two tensors of one
  message viewed one storage, it pickles the message again, with each such
  storage's bytes from its first viewed byte to its last sent once (a
  ``_Span``) and each tensor a view into it. As in torch, a tensor that views
  less than half of a storage of 8 KiB or more shares nothing: torch copies
  it before sending, rrpc sends its own bytes. So a span is never much
  larger than what its tensors view. The same tensor object twice is one
  object anyway (pickle's memo). A storage is one torch storage (its
  ``StorageImpl``, ``_cdata``, as torch's own picklers key storages), not an
  address: two storages over one memory (numpy arrays made tensors, a prefix
  and the whole) are two, and travel apart, as in torch.
- A sparse tensor (COO, CSR, CSC, BSR, BSC) travels as its parts (indices and
  values, each such a buffer) with its size, layout and COO coalesced flag;
  it is rebuilt with its invariants checked, and requires grad as it did.
  Other layouts and quantized tensors go in band, through torch's pickling.
- A received tensor is built over the buffer the frame reader allocated for
  it, with no copy; a buffer that came through shared memory (``shm.py``) is
  a tensor over the peer's slot already.
- A tensor that requires grad is handed, as it is rebuilt, to the hook the
  decoding thread set (``receiving.hook``: distributed autograd's recv node).
- A message that knows where its tensors are (distributed autograd's
  gradients) may take a dense one apart itself (``take_apart``): plain parts
  the pickler writes without calling back into Python, which the handler
  puts together (``put_together``) where it uses the tensor.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rrpc import restricted

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


class _Receiving(threading.local):
    # Sees each tensor that required grad, as the message that carries it is unpickled.
    hook: Callable[[torch.Tensor], torch.Tensor] | None = None


receiving = _Receiving()


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
    hook = receiving.hook
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
    span = _last_element(tensor.shape, tensor.stride()) + 1
    if span * tensor.element_size() > max(_SPAN_FACTOR * tensor.nbytes, _SMALL_SPAN):
        return None
    return tensor.detach().as_strided((span,), (1,))


@restricted.allow
def _rebuild_parameter(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    return _as_sent(_rebuild_tensor(buffer, dtype_index, shape, False), requires_grad, True)


def _as_sent(tensor: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A rebuilt tensor as it was sent: a parameter stays one, but in a
    distributed autograd context, where one that requires grad is a tensor
    like any other (as in torch): its gradient goes back."""
    if parameter and not (requires_grad and receiving.hook is not None):
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return _with_grad(tensor, requires_grad)


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
    return _as_sent(tensor, requires_grad, parameter)


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


def reduce_tensor(pickler: Any, obj: Any) -> Any:
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
    elif obj.numel():
        storages = pickler.storages
        if storages is None:  # the message's first tensor
            storages = pickler.storages = Storages()
        span = storages.note(obj)
        if span is not None:  # a second pickling: this storage's span goes once
            return _reduce_view(pickler, obj, span, dtype_index)
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


# -- Plain parts, for a message that knows where its tensors are ----------------
def take_apart(tensor: torch.Tensor) -> Any:
    """A dense CPU tensor as plain parts (its dtype's index, shape, whether it
    is one element expanded, its bytes), which ``put_together`` undoes; any
    other tensor as it is, for the codec to pickle.

    For a message that knows where its tensors are (distributed autograd's
    gradients): the C pickler writes a tuple and a ``PickleBuffer`` without
    calling back into Python, and the receiver rebuilds the tensor where it
    uses it, not inside ``loads`` (in a running step here, the message's
    encode and decode ~90 µs less, the handler's rebuild ~30 µs more). A
    sum's gradient (one element expanded) travels as that element, as
    through ``reduce_tensor``; gradients that share a storage travel apart."""
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return tensor
    dtype_index = DTYPE_INDEX.get(tensor.dtype)
    if (
        dtype_index is None
        or NUMPY_DTYPES[dtype_index] is None
        or not tensor.is_cpu
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return tensor
    if tensor.is_contiguous():
        return dtype_index, tuple(tensor.shape), False, pickle.PickleBuffer(tensor.numpy())  # type: ignore[arg-type]
    if tensor.numel() and not any(tensor.stride()):
        element = tensor.as_strided((1,), (1,)).numpy()
        return dtype_index, tuple(tensor.shape), True, pickle.PickleBuffer(element)  # type: ignore[arg-type]
    return tensor


def put_together(parts: Any) -> torch.Tensor:
    """The tensor ``take_apart`` took apart (over the received buffer, no
    copy; an expanded element a view). Raises ValueError or TypeError for
    parts that describe no such tensor."""
    if isinstance(parts, torch.Tensor):
        return parts
    if not isinstance(parts, tuple) or len(parts) != 4:
        raise TypeError(f"not the parts of a tensor: {type(parts).__name__}")
    dtype_index, shape, expanded, buffer = parts
    if not isinstance(shape, tuple) or not all(type(size) is int and size >= 0 for size in shape):
        raise ValueError(f"not a tensor's shape: {shape!r}")
    try:
        if not expanded:
            return _rebuild_tensor(buffer, dtype_index, shape, False)
        element = _rebuild_tensor(buffer, dtype_index, (1,), False)
        return element.expand(shape) if shape else element.reshape(())
    except (RuntimeError, IndexError, TypeError) as exc:  # bytes that do not fit the shape
        raise ValueError(f"the parts of a tensor do not fit together: {exc}") from exc


# -- Storages shared within one message ------------------------------------------
_SPAN_ALIGN = 16  # a span starts this aligned in its storage: any dtype's view lines up
# See ``_shares``: rrpc sends such a tensor's own bytes apart.
_COPIED_FROM = 8 << 10


class _Span:
    """A storage's bytes that one message's tensors view, sent once: pickled
    once (pickle's memo), each tensor over it a ``_rebuild_view``."""

    __slots__ = ("bytes", "start")

    def __init__(self, view: torch.Tensor, start: int):
        self.bytes = view  # uint8, 1-D: the storage from ``start`` (an address) on
        self.start = start

    def __reduce__(self) -> Any:
        return _rebuild_span, (_tensor_bytes(self.bytes),)


class Storages:
    """The storages one message's tensors view, as it is pickled (made at
    its first tensor: a message without one costs nothing here).

    First pickling: ``note`` records each dense CPU tensor under its
    storage, and, if one was met twice (``repeated``), ``shared()`` gives the
    spans to send once (two tensors or more that share a storage). Second
    pickling, made with those spans: ``note`` gives the span a tensor is a
    view into, or None."""

    def __init__(self, spans: dict[int, _Span] | None = None):
        # By storage (``_cdata``), not by address: a storage made over another
        # one's memory starts where it does, but may be shorter, and a span
        # built over it would not hold the other's views. (The tensors noted
        # keep their storages alive while the message is pickled: no other
        # storage takes a ``_cdata`` meanwhile.)
        self._seen: dict[int, list[torch.Tensor]] = {}
        self._spans = spans
        self.repeated = False  # a storage was met twice: ``shared()`` may find spans

    def note(self, tensor: torch.Tensor) -> _Span | None:
        key = tensor.untyped_storage()._cdata
        if self._spans is None:  # the first pickling: only what each storage holds
            views = self._seen.get(key)
            if views is None:
                self._seen[key] = [tensor]
            else:
                views.append(tensor)
                self.repeated = True
            return None
        span = self._spans.get(key)
        if span is None or not _shares(tensor) or tensor.is_conj() or tensor.is_neg():
            return None
        return span

    def shared(self) -> dict[int, _Span]:
        """The spans of storages that two tensors or more view and share."""
        spans = {}
        for key, seen in self._seen.items():
            views = [view for view in seen if _shares(view)] if len(seen) > 1 else ()
            if len(views) < 2:
                continue
            storage = views[0].untyped_storage()
            base = storage.data_ptr()
            first = min(view.data_ptr() for view in views)
            first -= (first - base) % _SPAN_ALIGN
            end = max(view.data_ptr() + _extent(view) for view in views)
            whole = torch.empty(0, dtype=torch.uint8)
            whole.set_(storage, first - base, (end - first,), (1,))
            spans[key] = _Span(whole, first)
        return spans


def _shares(tensor: torch.Tensor) -> bool:
    """Torch's rule: a tensor that views at most half of a storage of 8 KiB
    or more is copied before it is sent, and shares nothing."""
    size = tensor.untyped_storage().nbytes()
    return size < _COPIED_FROM or size < 2 * tensor.nbytes


def _last_element(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Where a strided tensor's last element is, in elements from its first (numel > 0)."""
    return sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))


def _extent(tensor: torch.Tensor) -> int:
    """The bytes from a tensor's first element to the end of its last (numel > 0)."""
    return (_last_element(tensor.shape, tensor.stride()) + 1) * tensor.element_size()


def _reduce_view(pickler: Any, tensor: torch.Tensor, span: _Span, dtype_index: int) -> Any:
    requires_grad = tensor.requires_grad
    if requires_grad and pickler.grad_tensors is not None:
        pickler.grad_tensors.append(tensor)
    offset = tensor.data_ptr() - span.start
    parameter = type(tensor) is torch.nn.Parameter
    shape, strides = tuple(tensor.shape), tensor.stride()
    return _rebuild_view, (span, offset, dtype_index, shape, strides, requires_grad, parameter)


@restricted.allow
def _rebuild_span(buffer: Any) -> torch.Tensor:
    return _rebuild_tensor(buffer, DTYPE_INDEX[torch.uint8], (-1,), False)


@restricted.allow
def _rebuild_view(
    span: Any,
    offset: int,
    dtype_index: int,
    shape: tuple,
    strides: tuple,
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    """A tensor over a span of a shared storage (``offset`` bytes into it)."""
    if not isinstance(span, torch.Tensor) or span.dtype is not torch.uint8 or span.dim() != 1:
        raise ValueError("a view's storage is not a received span")
    dtype = DTYPES[dtype_index]
    if len(shape) != len(strides) or min(shape, default=1) < 1 or min(strides, default=0) < 0:
        raise ValueError(f"a view of shape {shape} and strides {strides} cannot be rebuilt")
    extent = (_last_element(shape, strides) + 1) * dtype.itemsize
    if offset < 0 or offset % dtype.itemsize or offset + extent > span.numel():
        raise ValueError(
            f"a view of {extent} bytes at byte {offset} lies outside its span of {span.numel()}"
        )
    tensor = span[offset : offset + extent].view(dtype).as_strided(shape, strides)
    return _as_sent(tensor, requires_grad, parameter)
