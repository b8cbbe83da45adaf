"""Frames on a stream: their byte layout, their limits, cutting and reassembly.

Bytes only: nothing here pickles or unpickles (``codec.py`` makes a message
into a frame's payload and buffers, and back). One frame (the envelope's
schema and field meanings in ``proto/rrpc.proto``)::

    offset         size                     field
    ------------   ----------------------   ------------------------------------
    0              4                        H: envelope size, u32 little-endian
                                            (bit 31 set: a compact envelope)
    4              H                        Envelope (protobuf): kind, request id,
                                            autograd context, payload_size,
                                            buffer_sizes[], shared_buffers{}
                                            or compact: u32 kind, u64 request id,
                                            u64 autograd context, u64 payload_size,
                                            u64 buffer_sizes[] (little-endian)
    4+H            payload_size             payload (pickle protocol 5)
    4+H+P          buffer_sizes[0]          buffer 0 (a tensor's raw bytes)
    ...            ...                      ...
                   buffer_sizes[n-1]        buffer n-1

Most frames (no shared-memory buffer, no bulk transfer, no handshake) carry
the compact envelope: the same fields in a fixed layout, which costs a few
struct operations where a protobuf message costs microseconds to build,
parse and read on each small call (``Head``). A header word with bit 31
clear is a protobuf ``Envelope``; one with it set cannot be (an envelope is
at most ``MAX_ENVELOPE_SIZE`` bytes).

A buffer sent through same-host shared memory (``shm.py``) has size 0 in
``buffer_sizes`` and a descriptor in ``shared_buffers`` under its index; the
reader builds the tensor over the peer's slot, with no copy. A frame whose
envelope has ``bulk`` set carries no buffer bytes in the stream: they come on
the stream's bulk socket (``bulk.py``), which the reader claims them from
(``claim``), sizes checked. With an auth
token each direction of a stream opens with a HANDSHAKE frame: an envelope
alone (``auth.py``).

Rules:

- Every length is checked before it is trusted: the envelope's size against
  ``MAX_ENVELOPE_SIZE``, the frame's total (shared buffers included) against
  ``max_message_size``, its count of buffers against ``MAX_BUFFERS``; the
  error gives both numbers.
- A received buffer is allocated for its tensor and filled from the packets:
  one copy from the socket's packets, none after.
- Memory is committed as bytes arrive, never as they are announced: a buffer
  declared larger than ``GROW_FROM`` grows (``_GrowingBuffer``: anonymous
  memory enlarged in place by ``mremap``, no copy) as its bytes come in, so a
  frame that declares 16 GiB and sends a few KiB costs a few MiB. A stream
  that ends drops its reader's partial frame (``FrameReader.close``).
- Packets are the transport's cut of the byte stream (``packets``): several
  small frames share one, a large frame spans several; the reader accepts
  any cut.
"""

from __future__ import annotations

import collections
import mmap
import struct
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rrpc._proto.rrpc_pb2 import Envelope, SharedBuffer
from rrpc.messages import MessageTooLargeError, ProtocolError

HEADER = struct.Struct("<I")
MAX_ENVELOPE_SIZE = 1 << 20  # an envelope is tens of bytes; anything near this is garbage
COMPACT = 1 << 31  # in the header word: a compact envelope (``Head``) follows
_HEAD = struct.Struct("<IQQQ")  # a compact envelope's fixed part
_COMPACT_FIRST = struct.Struct("<IIQQQ")  # header word and fixed part, packed at once
_COMPACT_BARE = COMPACT | _HEAD.size  # the header word of a compact frame without buffers
# Tensor buffers in one frame. Each costs the receiver a Python object (~100
# bytes) for as little as one byte on the wire; a message of more tensors than
# this is refused by its sender.
MAX_BUFFERS = 1 << 16
GROW_FROM = 32 << 20  # a received buffer larger than this grows as its bytes arrive


class Head(
    collections.namedtuple(
        "Head", ["kind", "request_id", "autograd_context_id", "payload_size", "buffer_sizes"]
    )
):
    """A compact envelope: the fields of the common frame, read once from a
    fixed layout; an ``Envelope``'s attributes to the code that reads them
    (``buffer_sizes`` a tuple). A tuple, built in C (``_new_head``): no
    Python frame per message."""

    __slots__ = ()
    # What only a protobuf envelope carries: none, in a compact one.
    shared_buffers: Mapping[int, SharedBuffer] = types.MappingProxyType({})
    bulk = 0

    def envelope(self) -> Envelope:
        """The same fields as a protobuf ``Envelope`` (to add what a compact one lacks)."""
        return Envelope(
            kind=self.kind,
            request_id=self.request_id,
            autograd_context_id=self.autograd_context_id,
            payload_size=self.payload_size,
            buffer_sizes=self.buffer_sizes,
        )


def compact_head(
    kind: int, request_id: int, autograd_context_id: int, payload_size: int, sizes: Sequence[int]
) -> bytes:
    """A frame's header word and compact envelope."""
    head_size = _HEAD.size + 8 * len(sizes)
    fixed = _COMPACT_FIRST.pack(
        COMPACT | head_size, kind, request_id, autograd_context_id, payload_size
    )
    return fixed + struct.pack(f"<{len(sizes)}Q", *sizes) if sizes else fixed


def compact_first(
    kind: int, request_id: int, autograd_context_id: int, payload: bytes, sizes: Sequence[int]
) -> bytes:
    """A frame's first piece (header word, compact envelope, payload)."""
    if not sizes:
        fixed = _COMPACT_FIRST.pack(
            _COMPACT_BARE, kind, request_id, autograd_context_id, len(payload)
        )
        return fixed + payload
    return compact_head(kind, request_id, autograd_context_id, len(payload), sizes) + payload


def parse_head(word: int, data: Any) -> Envelope | Head:
    """The envelope of header word ``word`` from ``data`` (its bytes, after the
    word). Raises ProtocolError if they are not one."""
    if not word & COMPACT:
        envelope = Envelope()
        try:
            envelope.ParseFromString(data)
        except Exception as exc:
            raise ProtocolError(f"unparseable envelope: {exc}") from exc
        return envelope
    count, odd = divmod(len(data) - _HEAD.size, 8)
    if count < 0 or odd or count > MAX_BUFFERS:
        raise ProtocolError(f"a compact envelope of {len(data)} bytes")
    sizes = struct.unpack_from(f"<{count}Q", data, _HEAD.size) if count else ()
    return _new_head(Head, (*_HEAD.unpack_from(data), sizes))


_new_head = tuple.__new__


def head_size(word: int) -> int:
    """The envelope's size in bytes, from the frame's header word."""
    return word & ~COMPACT


@dataclass
class Outgoing:
    """An encoded frame: ``pieces`` written in order are the frame's bytes."""

    pieces: list[Any]  # bytes, then one memoryview per tensor buffer sent in the stream
    size: int  # bytes in the stream
    tensor_bytes: int  # bytes of all tensor buffers, in the stream or in shared memory
    # Tensors in the message that require grad, in pickling order (for autograd).
    grad_tensors: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Frame:
    """A received frame, its payload not yet unpickled."""

    envelope: Envelope
    payload: bytes | memoryview
    # One writable 1-D uint8 buffer per out-of-band buffer: a numpy array when
    # it came in the stream, a tensor over the slot when through shared memory.
    buffers: list[np.ndarray | torch.Tensor]
    # Called once, when the payload is unpickled (``codec.loads``) or the frame
    # is dropped undecoded: the transport's count of a peer's requests waiting
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
        claim: Callable[[int, list[int]], list[np.ndarray]] | None = None,
    ):
        self.max_message_size = max_message_size
        self._attach = attach  # builds a tensor over a shared-memory descriptor
        self.claim = claim  # a bulk transfer's buffers, by id and sizes (bulk.Channel.claim)
        self._head = bytearray()  # bytes of an incomplete header+envelope
        self._envelope: Envelope | None = None
        self._payload = bytearray()
        self._buffers: list[np.ndarray | torch.Tensor] = []
        self._target: np.ndarray | _GrowingBuffer | None = None  # the buffer being filled
        self._filled = 0
        self.unread = 0  # bytes of the packet being read that no frame handed out yet covers

    def close(self) -> None:
        """The stream ended: drop the frame being read, and its memory."""
        self.unread = 0
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
                    self.unread = 0
                    return
                if not self._head:
                    whole = self._read_whole_frame(view, position)
                    if whole is not None:
                        position = whole[1]
                        self.unread = end - position
                        yield whole[0]
                        continue
                position = self._read_envelope(view, position)
                continue
            self._open_next_buffer()
            if self._complete():
                self.unread = end - position
                yield self._take()
            elif position == end:
                self.unread = 0
                return
            else:
                position = self._read_body(view, position)

    def _read_whole_frame(self, view: memoryview, position: int) -> tuple[Frame, int] | None:
        """The common case, a frame wholly inside this packet, without the
        state machine; None leaves it to the general path."""
        end = len(view)
        if end - position < HEADER.size:
            return None
        (word,) = HEADER.unpack_from(view, position)
        if word == _COMPACT_BARE and end - position >= _COMPACT_FIRST.size:
            # The commonest frame (a small call, a reply): no tensor buffer.
            fixed = _HEAD.unpack_from(view, position + HEADER.size)
            body = position + _COMPACT_FIRST.size
            frame_end = body + fixed[3]
            if frame_end > end or self.max_message_size and fixed[3] > self.max_message_size:
                return None  # the general path reads on, or raises the error
            frame = Frame(_new_head(Head, (*fixed, ())), bytes(view[body:frame_end]), [])
            return frame, frame_end
        head_size = word & ~COMPACT
        body = position + HEADER.size + head_size
        if head_size > MAX_ENVELOPE_SIZE or body > end:
            return None
        envelope = parse_head(word, view[position + HEADER.size : body])
        sizes: Sequence[int]
        if type(envelope) is Head:  # noqa: E721  (the common case, without protobuf)
            sizes = envelope.buffer_sizes
            bulk = 0
        else:
            sizes = list(envelope.buffer_sizes)
            bulk = envelope.bulk  # its buffers come on the bulk socket, not in the packet
            if envelope.shared_buffers or len(sizes) > MAX_BUFFERS:
                return None  # the general path, which also checks the limits
        payload_end = body + envelope.payload_size
        frame_end = payload_end if bulk else payload_end + sum(sizes)
        if frame_end > end:
            return None
        if self.max_message_size and frame_end - body > self.max_message_size:
            return None  # the general path raises the error
        if bulk:
            if self.max_message_size and _declared_size(envelope) > self.max_message_size:
                return None
            claimed = self._claim(envelope)
            return Frame(envelope, bytes(view[body:payload_end]), claimed), frame_end
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
        (word,) = HEADER.unpack_from(self._head)
        head_size = word & ~COMPACT
        if head_size > MAX_ENVELOPE_SIZE:
            raise ProtocolError(f"envelope of {head_size} bytes (limit {MAX_ENVELOPE_SIZE})")
        needed = HEADER.size + head_size - len(self._head)
        take = min(needed, len(view) - position)
        self._head += view[position : position + take]
        position += take
        if take < needed:
            return position
        envelope = parse_head(word, bytes(self._head[HEADER.size :]))
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
        if envelope.bulk:
            if not self._payload_missing() and len(self._buffers) < len(sizes):
                self._buffers = self._claim(envelope)
                self._target = None
            return
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

    def _claim(self, envelope: Envelope) -> list[np.ndarray | torch.Tensor]:
        """The buffers of a frame sent with ``bulk``: from the bulk socket,
        once they are in (``bulk.Channel.claim`` waits, and checks the sizes)."""
        if self.claim is None:
            raise ProtocolError("a bulk frame on a stream without a bulk socket")
        if envelope.shared_buffers:
            raise ProtocolError("a bulk frame with shared-memory buffers")
        return list(self.claim(envelope.bulk, list(envelope.buffer_sizes)))

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


def names_shared_buffers(first: bytes) -> bool:
    """Whether a frame (its first piece) names shared-memory buffers: only
    a protobuf envelope can (``codec.encode`` writes one for them)."""
    (word,) = HEADER.unpack_from(first)
    if word & COMPACT:
        return False
    envelope = Envelope()
    envelope.ParseFromString(first[HEADER.size : HEADER.size + word])
    return bool(envelope.shared_buffers)


def with_bulk(first: bytes, transfer: int) -> bytes:
    """A frame's first piece (header, envelope, payload) with its envelope's
    ``bulk`` set to ``transfer``: its buffers go on the bulk socket instead."""
    (word,) = HEADER.unpack_from(first)
    end = HEADER.size + (word & ~COMPACT)
    envelope = parse_head(word, first[HEADER.size : end])
    if isinstance(envelope, Head):
        envelope = envelope.envelope()
    envelope.bulk = transfer
    head = envelope.SerializeToString()
    return b"".join((HEADER.pack(len(head)), head, first[end:]))


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
