"""Bulk bytes between hosts: a gRPC stream's large tensor buffers on TCP sockets of their own.

Theory of operation. grpcio's Python API moves ``bytes`` objects: a tensor
sent on a gRPC stream is joined into packets, copied into gRPC's buffers,
handed to the reader as new ``bytes`` and copied into the received tensor,
four passes over memory between the two sockets, each one costing about as
much as the link. A TCP socket of its own sends from the tensor's memory and
receives into the new tensor's (``sendmsg``, ``recv_into``): the kernel's
copies only. So a gRPC stream may have a *bulk socket* beside it, as
TensorPipe's tensors travel on channels beside its transport:

- Every worker listens on a TCP port of its gRPC host and advertises it. A
  stream's caller dials it the first time a frame with ``BULK_MIN`` bytes of
  buffers or more goes either way on the stream (that frame still travels in
  the stream): ``count`` sockets, the caller's ``bulk_sockets`` (at most
  ``MAX_SOCKETS``), each proved with the cluster token and bound to its
  stream on the other end (``bulk_open.py``: the port, the dial). The
  channel is bound once all ``count`` are. Never with TLS (the sockets are not
  encrypted), nor when either end turned bulk sockets off (``bulk_channel``).
- Once bound, a frame with ``BULK_MIN`` bytes of buffers or more, either
  way, travels in two parts: its envelope and payload in the stream, in the
  stream's order, with ``bulk`` set to a transfer id; its buffers' bytes on
  the bulk sockets, each socket carrying its share (``stripe``: the bytes,
  taken as one run across the buffers, cut in ``count`` equal parts) behind
  a header of the id and the sizes (``Channel.send`` queues the transfer on
  every socket and the frame under one lock, so transfers go in the order of
  their frames on each). One thread per socket writes (``rrpc-bulk-send``),
  one reads (``rrpc-bulk-recv``): the first reader to meet a transfer
  allocates its buffers, each fills its share, the last one done hands them
  on; the stream's frame reader takes them when it reaches the frame
  (``Channel.claim``), and the tensors are built over them, with no copy.
  Several, as TensorPipe's ``mpt_uv`` lanes: one TCP stream is slower than the
  link (a 16 MiB echo between two network namespaces: 15–20 ms on one, 8.4–11.7 on two).
- Bound, the sockets belong to their stream: when any ends, the stream and
  the others end too, and its calls fail as on a broken stream (a dial that
  fails before then leaves the frames whole). A claim waits while bytes
  arrive; if none arrive for ``peer_timeout`` (a frozen peer), it fails.

Rules:
- A transfer's sizes are checked against ``max_message_size`` before
  anything is allocated, and must be the frame's (``ProtocolError``
  otherwise: the stream ends).
- Transfers allocated and not yet claimed hold at most ``BACKLOG`` bytes
  (one larger transfer alone may exceed it): past it, a reader meeting a new
  transfer stops reading and TCP pushes back on the sender. Every reader
  meets the transfers in the order they were queued, so they are allocated
  in that order, and claims come in that order: the oldest one held is
  always the next one wanted, and its readers, past allocation, never wait
  for room (nor one that finds it allocated while it waited). The bound
  cannot deadlock.
- A buffer of ``RECYCLE_MIN`` bytes or more is received into memory that an
  earlier one of its size used, once every tensor over that one is gone
  (``Recycled``): new memory costs a page fault per 4 KiB (a 128 MiB buffer
  ~27 ms here, a fifth of its echo over the veth link), and glibc returns
  buffers this large to the OS when they are freed (smaller ones it keeps
  in its heap: ``shm.tune_allocator``). At most ``RECYCLE_BYTES`` of freed
  buffers are kept.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from rrpc import logs, wire
from rrpc.lane_io import HANDSHAKE_TIMEOUT, IOV_MAX, advance, shut
from rrpc.messages import AuthenticationError, ProtocolError
from rrpc.options import MAX_BULK_SOCKETS

BULK_MIN = 1 << 20  # a frame whose stream buffers sum to this many bytes uses the bulk socket
BACKLOG = 256 << 20  # bytes of transfers read and not yet claimed, at most (see the rules)
MAX_SOCKETS = MAX_BULK_SOCKETS  # bulk sockets of one stream, at most (``bulk_sockets``)
_TRANSFER = struct.Struct("<QI")  # a transfer: id, buffer count; each size; their bytes
_SIZE = struct.Struct("<Q")
_RECV_SLICE = 4 << 20  # bytes per recv_into, so that a claim sees progress
RECYCLE_MIN = 32 << 20  # a received buffer this large reuses freed memory (see the rules)
RECYCLE_BYTES = 512 << 20  # freed receive buffers kept for reuse, in bytes, at most


class Recycled:
    """Memory for received buffers, reused once every tensor over it is gone.

    ``take(size)`` is a uint8 array of ``size`` bytes over anonymous memory
    that a buffer of that size used before, if one was freed, else new. Every
    numpy array or tensor built from it keeps it alive (numpy makes their
    ``base`` this array, which does not own its memory), so its memory comes
    back here only when the last of them is freed; the freed ones are kept
    up to ``limit`` bytes, the oldest dropped first."""

    def __init__(self, limit: int):
        self._limit = limit
        self._free: collections.OrderedDict[int, list[mmap.mmap]] = collections.OrderedDict()
        self._bytes = 0  # freed and kept
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            kept = self._free.get(size)
            memory = kept.pop() if kept else None
            if memory is not None:
                self._bytes -= size
                if not kept:
                    del self._free[size]
        if memory is None:
            memory = mmap.mmap(-1, size)
        array = np.frombuffer(memory, dtype=np.uint8)
        weakref.finalize(array, self._give_back, memory)
        return array

    def _give_back(self, memory: mmap.mmap) -> None:
        size = len(memory)
        if size > self._limit:
            return
        with self._lock:
            while self._bytes + size > self._limit:  # drop the oldest kept
                oldest, kept = next(iter(self._free.items()))
                kept.pop(0)
                self._bytes -= oldest
                if not kept:
                    del self._free[oldest]
            self._free.setdefault(size, []).append(memory)
            self._free.move_to_end(size)
            self._bytes += size

    def kept(self) -> int:
        """Bytes of freed buffers kept for reuse."""
        with self._lock:
            return self._bytes


recycled = Recycled(RECYCLE_BYTES)  # every bulk socket's received buffers, in this process


def stripe(buffers: list[Any], index: int, count: int) -> list[memoryview]:
    """The bytes socket ``index`` of ``count`` carries of ``buffers``: the
    ``index``-th of ``count`` equal parts of their bytes taken as one run
    (a part may span buffers, or lie inside one), as views, empty ones left out."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    total = sum(len(view) for view in views)
    low, high = total * index // count, total * (index + 1) // count
    part, start = [], 0
    for view in views:
        end = start + len(view)
        if end > max(start, low) and start < high:
            part.append(view[max(low - start, 0) : min(high, end) - start])
        start = end
    return part


class _Incoming:
    """A transfer being read: its buffers, and how many sockets' parts are not in yet."""

    __slots__ = ("buffers", "sizes", "left")

    def __init__(self, buffers: list[np.ndarray], sizes: list[int], left: int):
        self.buffers, self.sizes, self.left = buffers, sizes, left


class Channel:
    """One end of a stream's bulk sockets (either end): transfers out, transfers in.

    Unbound until ``bind(sock, index, count)`` has bound all ``count``; until
    then ``send`` leaves every frame whole, in the stream. ``on_broken(error)``
    is told once if a socket fails while bound (the stream's owner ends the
    stream). At the caller's end, ``dial(index, count)`` returns socket
    ``index`` of ``sockets``: they are dialed once, on a thread of their own,
    at the first large frame either way. ``threads`` names the threads, its
    ``{}`` the role.
    """

    def __init__(
        self,
        name: str,
        threads: str,
        max_message_size: int,
        peer_timeout: float,
        on_broken: Callable[[BaseException], None] | None = None,
        dial: Callable[[int, int], socket.socket] | None = None,
        backlog: Any = None,
        sockets: int = 1,
    ):
        """``backlog``: the stream's ``outbox.Outbox`` whose bound of bytes
        waiting to go counts the transfers queued here too (the callee's).
        ``sockets``: how many the caller's end dials."""
        self.name = name  # the peer, for errors
        self._backlog = backlog
        self._threads = threads
        self._dial = dial
        self._dial_count = sockets
        self._max_message_size = max_message_size
        self._peer_timeout = peer_timeout
        self._on_broken = on_broken
        self._socks: list[socket.socket | None] = []  # by index, once the count is known
        self.bound = False
        self.error: BaseException | None = None
        self._ids = itertools.count(1)
        self._order = threading.Lock()  # a frame and its transfer are queued together
        self._lock = threading.Condition(threading.Lock())
        self._outgoing: list[collections.deque[tuple[int, list[Any]]]] = []  # by socket
        self._incoming: dict[int, _Incoming] = {}
        self._arrived: dict[int, list[np.ndarray]] = {}
        self._held = 0  # bytes allocated for transfers not claimed yet
        self._progress = time.monotonic()  # when a reader last got bytes

    # -- Sending --------------------------------------------------------------
    def send(self, pieces: list[Any], put: Callable[[list[Any]], None]) -> bool:
        """Put a frame on the stream with ``put``: its buffers on the sockets
        (and the frame marked so) when they are bound and the buffers large.
        Whether they went there. One that names shared-memory buffers too
        goes whole (a bulk frame cannot; its others are under the slots' size)."""
        large = len(pieces) > 1 and sum(len(buffer) for buffer in pieces[1:]) >= BULK_MIN
        if not large or wire.names_shared_buffers(pieces[0]):
            put(pieces)
            return False
        if not self.bound:
            put(pieces)
            self.want()
            return False
        buffers = pieces[1:]
        with self._order:
            transfer = next(self._ids)
            with self._lock:
                if self.error is not None:  # broken meanwhile: the stream is ending too
                    put(pieces)
                    return False
                for outgoing in self._outgoing:
                    outgoing.append((transfer, buffers))
                self._lock.notify_all()
            if self._backlog is not None:
                self._backlog.hold(sum(len(buffer) for buffer in buffers))
            put([wire.with_bulk(pieces[0], transfer)])
        return True

    def _write(self, sock: socket.socket, index: int) -> None:
        outgoing, count = self._outgoing[index], len(self._outgoing)
        while True:
            with self._lock:
                self._lock.wait_for(lambda: outgoing or self.error is not None)
                if self.error is not None:
                    return
                transfer, buffers = outgoing.popleft()
            header = _TRANSFER.pack(transfer, len(buffers)) + b"".join(
                _SIZE.pack(len(buffer)) for buffer in buffers
            )
            pieces: list[Any] = [header, *stripe(buffers, index, count)]
            size = sum(len(piece) for piece in pieces) - len(header)
            del buffers
            try:
                while pieces:
                    sent = sock.sendmsg(pieces[:IOV_MAX])
                    pieces = advance(pieces, sent)
            except OSError as exc:
                self._break(ProtocolError(f"bulk socket to {self.name} failed: {exc}"))
                return
            finally:
                if self._backlog is not None:
                    self._backlog.release(size)

    # -- Receiving ------------------------------------------------------------
    def claim(self, transfer: int, sizes: list[int]) -> list[np.ndarray]:
        """The buffers of ``transfer``, once they are in; ``sizes`` are what its
        frame announced. Raises ProtocolError if a socket broke, the sizes
        differ, or no byte came for ``peer_timeout`` seconds."""
        unbound_until = time.monotonic() + HANDSHAKE_TIMEOUT
        with self._lock:
            while transfer not in self._arrived:
                if self.error is not None:
                    raise ProtocolError(f"bulk socket from {self.name} ended: {self.error}")
                now = time.monotonic()
                if not self.bound:  # the peer binds its end first: ours is being bound
                    if now > unbound_until:
                        raise ProtocolError(f"a bulk frame from {self.name}, and no bulk socket")
                elif now - self._progress > self._peer_timeout:
                    error = ProtocolError(
                        f"bulk bytes from {self.name} stopped for {self._peer_timeout:g} s"
                    )
                    self._break_locked(error)
                    raise error
                self._lock.wait(min(1.0, self._peer_timeout / 4))
            buffers = self._arrived.pop(transfer)
            self._held -= sum(len(buffer) for buffer in buffers)
            self._lock.notify_all()
        if [len(buffer) for buffer in buffers] != sizes:
            raise ProtocolError(
                f"bulk transfer {transfer} from {self.name} has buffers of "
                f"{[len(b) for b in buffers]} bytes, its frame announced {sizes}"
            )
        return buffers

    def _read(self, sock: socket.socket, index: int, count: int) -> None:
        head = bytearray(_TRANSFER.size)
        try:
            while True:
                if not self._fill(sock, memoryview(head), eof_ok=True):
                    self._break(ProtocolError(f"bulk socket closed by {self.name}"))
                    return
                transfer, buffer_count = _TRANSFER.unpack(head)
                if buffer_count > wire.MAX_BUFFERS:
                    raise ProtocolError(f"bulk transfer of {buffer_count} buffers")
                sizes_bytes = bytearray(_SIZE.size * buffer_count)
                self._fill(sock, memoryview(sizes_bytes))
                sizes = [size for (size,) in _SIZE.iter_unpack(sizes_bytes)]
                incoming = self._incoming_for(transfer, sizes, count)
                if incoming is None:
                    return
                for view in stripe(incoming.buffers, index, count):
                    self._fill(sock, view)
                view = None  # type: ignore[assignment]  # else it holds a buffer until the next transfer
                with self._lock:
                    incoming.left -= 1
                    if incoming.left == 0 and self._incoming.pop(transfer, None) is incoming:
                        self._arrived[transfer] = incoming.buffers
                        self._lock.notify_all()
                del incoming  # the claim's now: freed with its tensors (Recycled)
        except (OSError, ProtocolError) as exc:
            self._break(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))

    def _incoming_for(self, transfer: int, sizes: list[int], count: int) -> _Incoming | None:
        """The transfer a reader met: allocated by the first of its readers,
        once there is room (see the rules); None if the channel broke."""
        total = sum(sizes)
        if self._max_message_size and total > self._max_message_size:
            raise ProtocolError(
                f"bulk transfer of {total} bytes exceeds max_message_size={self._max_message_size}"
            )
        with self._lock:
            while True:  # another of its readers may allocate it meanwhile
                incoming = self._incoming.get(transfer)
                if incoming is not None:
                    if incoming.sizes != sizes:
                        raise ProtocolError(
                            f"bulk transfer {transfer} from {self.name} announced buffers of "
                            f"{incoming.sizes} and {sizes} bytes on two of its sockets"
                        )
                    return incoming
                if self.error is not None:
                    return None
                if not (self._arrived or self._incoming) or self._held + total <= BACKLOG:
                    break
                self._lock.wait()
            buffers = [
                recycled.take(size) if size >= RECYCLE_MIN else np.empty(size, dtype=np.uint8)
                for size in sizes
            ]
            incoming = _Incoming(buffers, sizes, count)
            self._incoming[transfer] = incoming
            self._held += total
            return incoming

    def _fill(self, sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
        """Fill ``view`` from the socket; False at a clean end before its first byte."""
        got = 0
        while got < len(view):
            read = sock.recv_into(view[got : got + _RECV_SLICE])
            if read == 0:
                if eof_ok and got == 0:
                    return False
                raise ProtocolError(f"bulk socket from {self.name} ended mid-transfer")
            got += read
            self._progress = time.monotonic()
        return True

    def watching(self, on_frame: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``on_frame``, which also wants the sockets at the first large frame received."""

        def watched(frame: Any) -> Any:
            if not self.bound and frame.buffers and frame.tensor_bytes() >= BULK_MIN:
                self.want()
            return on_frame(frame)

        return watched

    # -- Life -----------------------------------------------------------------
    def want(self) -> None:
        """Dial the sockets (once, in the background), if this end dials."""
        dial, self._dial = self._dial, None
        if dial is None:
            return
        count = self._dial_count

        def dialing() -> None:
            for index in range(count):
                try:
                    sock = dial(index, count)
                except (OSError, AuthenticationError) as exc:
                    logs.event("bulk-dial", self.name, "no bulk socket to %s: %s", self.name, exc)
                    self.fail(exc)
                    return
                if not self.bind(sock, index, count):
                    sock.close()
                    return

        threading.Thread(target=dialing, name=self._threads.format("dial"), daemon=True).start()

    def bind(self, sock: socket.socket, index: int = 0, count: int = 1) -> bool:
        """Carry socket ``index`` of this stream's ``count`` bulk sockets on
        ``sock`` (blocking, connected and proven); False if the channel has
        ended, the socket is bound already or does not fit the count."""
        with self._lock:
            if self.error is not None or not 0 <= index < count <= MAX_SOCKETS:
                return False
            if not self._socks:
                self._socks = [None] * count
                self._outgoing = [collections.deque() for _ in range(count)]
            if count != len(self._socks) or self._socks[index] is not None:
                return False
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[index] = sock
            self.bound = all(bound is not None for bound in self._socks)
            self._progress = time.monotonic()
            self._lock.notify_all()
        # The socket is passed on: ``close`` may take it off the channel before they run.
        for target, role, args in (
            (self._read, "recv", (sock, index, count)),
            (self._write, "send", (sock, index)),
        ):
            threading.Thread(
                target=target, args=args, name=self._threads.format(role), daemon=True
            ).start()
        return True

    def _break(self, error: BaseException) -> None:
        """A socket failed. The stream ends with it if the channel was bound
        (it may carry transfers); else (a dial after the first failed) frames
        stay whole, as if it had never been dialed."""
        with self._lock:
            first = self._break_locked(error)
            bound = self.bound
        if first and bound and self._on_broken is not None:
            self._on_broken(error)

    def _break_locked(self, error: BaseException) -> bool:
        if self.error is not None:
            return False
        self.error = error
        self._incoming.clear()
        self._arrived.clear()
        self._held = 0
        for outgoing in self._outgoing:
            outgoing.clear()
        self._lock.notify_all()
        for sock in self._socks:
            if sock is not None:
                shut(sock)
        return True

    def fail(self, error: BaseException) -> None:
        """It could not be bound (a dial failed): frames stay whole, and a
        bulk frame from the peer ends the stream."""
        with self._lock:
            if not self.bound:
                self._break_locked(error)

    def close(self) -> None:
        """The stream ended: end the sockets (quietly) and free what they hold."""
        with self._lock:
            self._break_locked(ProtocolError(f"stream to {self.name} ended"))
            socks, self._socks = self._socks, []
        for sock in socks:
            if sock is not None:
                sock.close()


__all__ = ["BULK_MIN", "MAX_SOCKETS", "Channel"]
