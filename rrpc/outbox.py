"""One direction of a stream: the frames that wait to go, sent by the threads that queue them.

Nothing here knows gRPC or sockets: a carrier gives the outbox its ``send``
(``push``). Theory of operation:

- Each direction of a stream is a byte stream of frames cut into packets
  (``wire.packets``). Whoever sends (the thread that queued a frame while no
  other was sending, or the outbox's sender thread for one that may not)
  takes everything queued at that moment and sends it as one packet, so
  small messages batch themselves under load and a large one flows in
  bounded chunks under the carrier's flow control.
- Under load the sender lingers before it cuts a packet (``batch_delay``):
  one gRPC message then carries many frames.
- The outbox counts the exchanges open on its stream (requests without
  their reply yet) and, on the callee's reply side, the bytes that wait to
  go (``backlog``, bounded by ``streams.REPLY_BACKLOG``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rrpc import wire
from rrpc.messages import thread_state
from rrpc.streams import CLOSED, END, HALF_CLOSED, OPEN, REPLY_BACKLOG, StreamState

# Bytes to send from which a thread sending in a pushed outbox lends its task's
# worker permit (``push``'s ``lend``) for the rest of its turn: a send waits in
# flow control until the peer reads, and a caller frozen while its 64 MiB reply
# went out held the permit (with num_worker_threads=1, every other peer's calls
# waited) until ``peer_timeout``. A frozen gRPC caller took ~3.9 MiB of replies
# before a send blocked: a smaller turn blocks only behind ~60 unread ones.
LEND_AT = 64 << 10

_CLOSE = object()  # queued to end a stream's sending side


class Outbox:
    """One direction of a stream: the frames waiting to go, and how many
    exchanges are open on it (requests without their reply yet).

    The carrier takes the frames through ``push``: the thread that
    queues a frame sends it itself through the carrier's ``send``, with
    every frame queued by others while it sends, and no thread is woken;
    only a thread that serves another stream (``thread_state.transport``,
    not this stream's reader) does not, lest a slow peer here stall a stream
    there: it wakes the outbox's own sender thread instead. One with
    ``LEND_AT`` bytes to send lends its worker permit as it sends them.

    ``backlog`` (bytes put and not yet handed to the carrier) is kept only
    when ``track_backlog``: the callee's reply side, whose readers wait in
    ``wait_for_room`` while it is over ``REPLY_BACKLOG``.

    Under load the sender lingers ``batch_delay`` seconds before cutting a
    packet, so that one gRPC message carries many frames: gRPC's per-message
    cost in Python (~100 µs per side here) would otherwise dominate. It
    lingers only while at least ``batch_min_open`` exchanges are open — a
    lone call never waits. The counts are advisory: they steer batching only.

    ``stream`` is the state of the stream it sends on (an open one of its
    own if not given): once it is HALF_CLOSED, the last reply ends it.
    """

    def __init__(
        self,
        packet_size: int,
        batch_delay: float = 0.0,
        batch_min_open: int = 0,
        track_backlog: bool = False,
        stream: StreamState | None = None,
    ):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.packet_size = packet_size
        self.batch_delay = batch_delay
        self.batch_min_open = batch_min_open
        self.stream = stream if stream is not None else StreamState(OPEN)
        self.sleep = time.sleep  # tests replace it to act during the linger
        # Every frame is half an exchange (a request or its reply), so the
        # open exchanges are the difference between frames sent and received.
        # Frames are sent from many threads (an atomic itertools.count) and
        # received by the stream's reader alone.
        self._sends = itertools.count(1)
        self._sent = 0
        self.received = 0
        self.backlog = 0
        self._track = track_backlog
        # One lock (``with self._lock``: no Python frame) for the backlog and
        # the pushing state: readers wait on _room while the backlog is over
        # its bound (_room_waiters of them), the sender thread on _pushing.
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._room_waiters = 0
        self._pushing = threading.Condition(self._lock)
        # Pushed (see ``push``): the carrier's two ends, and under _lock
        # whether a thread is sending, whether the sender thread is wanted,
        # whether the end was sent.
        self._send: Callable[[bytes], Any] | None = None
        self._finish: Callable[[BaseException | None], Any] = lambda error: None
        self._lend: Callable[..., Any] | None = None
        self._sending = False
        self._wanted = False
        self._sender: threading.Thread | None = None
        self._sender_name = "rrpc-send"
        self._finished = False

    def open_exchanges(self) -> int:
        return abs(self._sent - self.received)

    def put(self, pieces: list[Any]) -> None:
        """Queue one frame's pieces, from any thread."""
        self._sent = next(self._sends)
        if self._track:
            size = sum(map(len, pieces))
            with self._lock:
                self.backlog += size
        self.queue.put(pieces)
        if self._send is not None:
            self._flush()
        if self.stream.state is HALF_CLOSED:
            self.end_if_answered()

    def end_if_answered(self) -> None:
        """End the stream if it is HALF_CLOSED and every exchange open on it
        is answered (a caller that half-closed its side still gets the
        replies to what it sent)."""
        stream = self.stream
        # move() lets one thread through, should several see the last answer.
        if stream.state is HALF_CLOSED and self.open_exchanges() == 0 and stream.move(END):
            self._queue_end(_CLOSE)

    def end(self, error: BaseException | None = None) -> None:
        """End this direction after what is queued; with ``error``, end it failed."""
        self._queue_end(_CLOSE if error is None else error)
        if self._track:
            with self._lock:
                self._room.notify_all()  # readers waiting for room look at the state again

    def _queue_end(self, end: Any) -> None:
        if end is not _CLOSE:
            self.queue.put(end)
        self.queue.put(_CLOSE)
        if self._send is not None:
            self._flush()

    def wait_for_room(self) -> bool:
        """Wait while more than ``REPLY_BACKLOG`` bytes wait to go; False if
        the stream ended (CLOSED) meanwhile."""
        if not self._track or self.backlog <= REPLY_BACKLOG:
            return self.stream.state is not CLOSED
        with self._lock:
            while self.backlog > REPLY_BACKLOG and self.stream.state is not CLOSED:
                self._room_waiters += 1
                self._room.wait()
                self._room_waiters -= 1
            return self.stream.state is not CLOSED

    def hold(self, size: int) -> None:
        """``size`` bytes of a frame wait to go elsewhere (its buffers on a
        bulk socket): they count in ``backlog`` until ``release``."""
        if self._track:
            with self._lock:
                self.backlog += size

    def release(self, size: int) -> None:
        if self._track:
            self._sent_bytes(size)

    def _sent_bytes(self, size: int) -> None:
        with self._lock:
            self.backlog -= size
            if self._room_waiters and self.backlog <= REPLY_BACKLOG:
                self._room.notify_all()

    # -- pushed: the threads that queue frames send them
    def push(
        self,
        send: Callable[[bytes], Any],
        finish: Callable[[BaseException | None], Any],
        name: str = "rrpc-send",
        lend: Callable[..., Any] | None = None,
    ) -> None:
        """From now on, frames go out through ``send(packet)`` (which returns
        once the carrier took the packet), from the threads that queue them
        (see the class doc); at the end, ``finish(error)`` runs once, with the
        error the outbox ended with (None: cleanly). Frames queued before go
        now. ``name``: the sender thread's, should one be needed. ``lend(fn,
        *args)`` runs a turn once ``LEND_AT`` bytes wait (``pool.lending``)."""
        self._finish = finish
        self._sender_name = name
        self._lend = lend
        self._send = send
        self._flush()

    def _flush(self) -> None:
        """Send what is queued, unless a thread sends already (it will)."""
        with self._lock:
            if self._sending or self._finished:
                return
            if thread_state.transport and thread_state.serving is not self.stream:
                if self.queue.empty():
                    return  # nothing to send (whoever queues next flushes)
                self._wanted = True  # a thread that serves another stream: not here
                if self._sender is None:
                    self._sender = threading.Thread(
                        target=self._send_when_wanted, name=self._sender_name, daemon=True
                    )
                    self._sender.start()
                self._pushing.notify()
                return
            self._sending = True
        self._send_queued()

    def _send_when_wanted(self) -> None:
        """The sender thread: sends for threads that may not (see ``_flush``)."""
        pushing = self._pushing
        while True:
            with self._lock:
                while not self._wanted and not self._finished:
                    pushing.wait()
                if self._finished:
                    return
                self._wanted = False
                if self._sending:
                    continue  # the thread sending will send it
                self._sending = True
            self._send_queued()

    def _send_queued(self, lent: bool = False) -> None:
        """With the sending turn: send until nothing is queued, then give it up."""
        while True:
            if not lent and self.backlog >= LEND_AT and self._lend is not None:
                return self._lend(self._send_queued, True)
            batch, end = self._take()
            try:
                for packet in self._cut(batch):
                    self._send(packet)  # type: ignore[misc]
            except Exception as exc:  # the carrier failed: the stream ends with it
                end = exc
            with self._lock:
                if end is not None:
                    self._finished = True
                    self._pushing.notify_all()
                elif not self.queue.empty():
                    continue
                self._sending = False
            if end is not None:
                self._finish(end if isinstance(end, BaseException) else None)
            return

    def _take(self) -> tuple[list[list[Any]], Any]:
        """The frames queued now, lingering under load for more, and the end
        marker met (None: none)."""
        batch: list[list[Any]] = []
        end = self._drain(batch)
        if (
            batch
            and end is None
            and self.batch_delay
            and self.open_exchanges() >= self.batch_min_open
        ):
            self.sleep(self.batch_delay)  # asleep, not waiting: puts wake nobody
            end = self._drain(batch)
        return batch, end

    def _cut(self, batch: list[list[Any]]) -> Iterator[bytes]:
        """The packets of ``batch``; each one leaves the backlog once the
        carrier took it (flow control let it go)."""
        if not batch:
            return
        if len(batch) == 1:  # a lone frame (most sends): one packet if it fits
            pieces = batch[0]
            size = sum(map(len, pieces))
            if size <= self.packet_size:
                yield b"".join(pieces)
                if self._track:
                    self._sent_bytes(size)
                return
        packets = wire.packets(itertools.chain.from_iterable(batch), self.packet_size)
        if not self._track:
            yield from packets
            return
        for packet in packets:
            yield packet
            self._sent_bytes(len(packet))

    def _drain(self, batch: list) -> Any:
        """Move queued frames into ``batch`` up to an end marker, which it
        returns (None: no end yet). Only the thread sending takes from the
        queue: what it finds there stays."""
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is _CLOSE or isinstance(item, BaseException):
                return item
            batch.append(item)
        return None
