"""One message ⇄ frame bytes. No I/O: bytes in, frames out (and back).

Frame layout (schema and field meanings in ``proto/rrpc.proto``)::

    +-----------+--------------------+------------------+----------+-----+------------+
    | u32 LE  H | Envelope (H bytes) | payload (pickle) | buffer 0 | ... | buffer n-1 |
    +-----------+--------------------+------------------+----------+-----+------------+

Rules:

- The payload is pickle protocol 5. Each CPU tensor in it is reduced to an
  out-of-band ``PickleBuffer`` over the tensor's own memory, so its bytes are
  never copied through pickle; the transport writes those buffers next to the
  payload. A view of a larger storage sends only the bytes it views.
- Code (lambdas, closures, functions of ``__main__``) is pickled by value with
  cloudpickle; everything else goes through the C pickler, which is faster.
- A received tensor is built over a buffer the reader allocated for it: one
  copy from the socket's packets, none after.
- Every length is checked before it is trusted: the envelope's size, and the
  frame's total against ``max_message_size``; the error gives both numbers.
- The pickle hooks of upper layers (RRefs need to know where they travel,
  distributed autograd must see tensors that require grad) read
  ``current_peer()`` and the tensor hook that ``decode`` installs.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import torch

from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import MessageTooLargeError, RpcError, SerializationError

HEADER = struct.Struct("<I")
MAX_ENVELOPE_SIZE = 1 << 20  # an envelope is tens of bytes; anything near this is garbage
PICKLE_PROTOCOL = 5

# Tensors travel with a small int for their dtype, not a pickled torch.dtype.
DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128, torch.complex32,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]  # fmt: skip
DTYPE_INDEX = {dtype: index for index, dtype in enumerate(DTYPES)}


class ProtocolError(RpcError):
    """Bytes on a stream that are not a well-formed frame."""


# -- Per-thread pickling state -------------------------------------------------
class _CodecState(threading.local):
    peer: Any = None  # the worker this thread is encoding for / decoding from
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    grad_tensors: list[torch.Tensor] | None = None


_state = _CodecState()


def current_peer() -> Any:
    """The worker the message being pickled goes to (or being unpickled came from)."""
    return _state.peer


# -- Encoding ------------------------------------------------------------------
@dataclass
class Outgoing:
    """An encoded frame: ``pieces`` written in order are the frame's bytes."""

    pieces: list[Any]  # bytes, then one memoryview per tensor buffer
    size: int
    # Tensors in the message that require grad, in pickling order (for autograd).
    grad_tensors: list[torch.Tensor] = field(default_factory=list)


def _tensor_bytes(tensor: torch.Tensor) -> pickle.PickleBuffer:
    """The bytes a tensor views, without a copy when it is contiguous."""
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return pickle.PickleBuffer(flat.view(torch.uint8).numpy())


def _rebuild_tensor(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    if not isinstance(buffer, torch.Tensor):  # an in-band buffer (e.g. pickled to a file)
        buffer = torch.frombuffer(bytearray(buffer), dtype=torch.uint8)
    tensor = buffer.view(DTYPES[dtype_index]).reshape(shape)
    hook = _state.tensor_hook
    if requires_grad:
        if hook is not None:
            return hook(tensor)
        tensor.requires_grad_(True)
    return tensor


def _rebuild_parameter(buffer: Any, dtype_index: int, shape: tuple, requires_grad: bool):
    tensor = _rebuild_tensor(buffer, dtype_index, shape, False)
    return torch.nn.Parameter(tensor, requires_grad=requires_grad)


def _reduce_tensor(pickler: Any, obj: Any) -> Any:
    kind = type(obj)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return NotImplemented
    if obj.layout != torch.strided or obj.is_quantized or obj.dtype not in DTYPE_INDEX:
        return NotImplemented  # torch's own pickling, in band
    if obj.device.type != "cpu":
        obj = obj.cpu()
    if obj.requires_grad and kind is torch.Tensor and pickler.grad_tensors is not None:
        pickler.grad_tensors.append(obj)
    rebuild = _rebuild_parameter if kind is torch.nn.Parameter else _rebuild_tensor
    return rebuild, (_tensor_bytes(obj), DTYPE_INDEX[obj.dtype], tuple(obj.shape), obj.requires_grad)


class _NeedsCloudpickle(Exception):
    pass


def _pickled_by_value(obj: Any) -> bool:
    return isinstance(obj, types.FunctionType) and (
        obj.__module__ == "__main__" or "<locals>" in obj.__qualname__ or obj.__name__ == "<lambda>"
    )


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


def dumps(obj: Any, peer: Any = None) -> tuple[bytes, list[pickle.PickleBuffer], list]:
    """Pickle ``obj``: (payload, out-of-band buffers, tensors that require grad)."""
    previous_peer, _state.peer = _state.peer, peer
    try:
        for pickler_class in (_FastPickler, _CodePickler):
            out = io.BytesIO()
            buffers: list[pickle.PickleBuffer] = []
            pickler = pickler_class(out, PICKLE_PROTOCOL, buffer_callback=buffers.append)
            pickler.grad_tensors = []
            try:
                pickler.dump(obj)
            except _NeedsCloudpickle:
                continue
            return out.getvalue(), buffers, pickler.grad_tensors
        raise AssertionError("unreachable")
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
        raise SerializationError(f"cannot pickle {_describe(obj)}: {exc}") from exc
    finally:
        _state.peer = previous_peer


def encode(
    kind: int,
    request_id: int,
    obj: Any,
    *,
    autograd_context_id: int = 0,
    peer: Any = None,
    max_message_size: int = 0,
) -> Outgoing:
    """Encode one message into frame pieces. Raises SerializationError or
    MessageTooLargeError without side effects on the stream."""
    payload, buffers, grad_tensors = dumps(obj, peer)
    raw = [buffer.raw() for buffer in buffers]
    envelope = Envelope(
        kind=kind,
        request_id=request_id,
        autograd_context_id=autograd_context_id,
        payload_size=len(payload),
        buffer_sizes=[len(view) for view in raw],
    )
    head = envelope.SerializeToString()
    first = HEADER.pack(len(head)) + head + payload
    size = len(first) + sum(len(view) for view in raw)
    if max_message_size and size > max_message_size:
        raise MessageTooLargeError(
            f"message of {size} bytes to {peer} exceeds max_message_size={max_message_size}"
        )
    return Outgoing([first, *raw], size, grad_tensors)


def _describe(obj: Any) -> str:
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[0]):
        return f"the arguments of {getattr(obj[0], '__qualname__', obj[0])!r}"
    return f"a value of type {type(obj).__name__}"


# -- Decoding ------------------------------------------------------------------
@dataclass
class Frame:
    envelope: Envelope
    payload: bytes | memoryview
    buffers: list[torch.Tensor]  # one writable uint8 tensor per out-of-band buffer


def loads(
    frame: Frame,
    peer: Any = None,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Unpickle a frame's payload; ``tensor_hook`` sees each tensor that required grad."""
    previous = _state.peer, _state.tensor_hook
    _state.peer, _state.tensor_hook = peer, tensor_hook
    try:
        return pickle.loads(frame.payload, buffers=frame.buffers)
    except Exception as exc:
        raise SerializationError(f"cannot unpickle a message from {peer}: {exc!r}") from exc
    finally:
        _state.peer, _state.tensor_hook = previous


class FrameReader:
    """Reassembles frames from a stream's packets, whatever their cut.

    ``feed(packet)`` returns the frames the packet completes. Each out-of-band
    buffer is copied once, from the packets into a tensor allocated for it.
    """

    def __init__(self, max_message_size: int = 0):
        self.max_message_size = max_message_size
        self._head = bytearray()  # bytes of an incomplete header+envelope
        self._envelope: Envelope | None = None
        self._payload = bytearray()
        self._buffers: list[torch.Tensor] = []
        self._target: np.ndarray | None = None  # the buffer being filled
        self._filled = 0

    def feed(self, packet: bytes) -> list[Frame]:
        frames = []
        view = memoryview(packet)
        position, end = 0, len(packet)
        while True:
            if self._envelope is None:
                if position == end:
                    return frames
                position = self._read_envelope(view, position)
                continue
            self._open_next_buffer()
            if self._complete():
                frames.append(self._take())
            elif position == end:
                return frames
            else:
                position = self._read_body(view, position)

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
        size = envelope.payload_size + sum(envelope.buffer_sizes)
        if self.max_message_size and size > self.max_message_size:
            raise MessageTooLargeError(
                f"incoming message of {size} bytes exceeds max_message_size="
                f"{self.max_message_size}"
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
        sizes = self._envelope.buffer_sizes  # type: ignore[union-attr]
        while (
            not self._payload_missing()
            and len(self._buffers) < len(sizes)
            and (self._target is None or self._filled == len(self._target))
        ):
            buffer = torch.empty(sizes[len(self._buffers)], dtype=torch.uint8)
            self._buffers.append(buffer)
            self._target, self._filled = buffer.numpy(), 0

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
        assert self._target is not None
        take = min(len(self._target) - self._filled, available)
        self._target[self._filled : self._filled + take] = np.frombuffer(
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
