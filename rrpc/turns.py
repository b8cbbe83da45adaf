"""Serving one incoming stream: two threads take turns reading it; requests run on their reader.

Nothing here knows gRPC or sockets: a carrier (``transport.py``'s gRPC
server, ``lane_listener.py``'s lane) hands in the packets it receives as an
iterator, and ``on_frame`` takes each request away.

Theory of operation. Handing a request from the thread that read it to a
pool thread costs a wake-up, tens of microseconds on a small VM; so does
handing the *reading* to another thread. A sequential caller (``rpc_sync``
in a loop) sends one request at a time, and the cheapest way to serve it is
for its reader to run it and go back to reading, waking nobody. But a
request may run long, or block on something that only a later request of
the same caller can give (an RPC back to the caller that must be read
here): then reading must go on without it. So:

- One thread at a time holds the **read role** (``_role``): it reads a
  packet and hands on its requests in order. It runs each itself
  (``on_frame(frame, inline=True)``) while keeping the role: it **lends**
  it to the request (``_lent_at``), and when the request is done it hands
  on the next one. A sequential caller's requests, and a batch of small
  ones, run without a thread being woken.
- The partner waits for the role. While the role is lent, it takes it over
  once the request has run for ``HANDOFF_AFTER`` and there is something to
  read (``_input_waits``: bytes of the packet not handed on yet, or, from a
  carrier that can tell, ``readable``, bytes waiting on the stream), or at
  once when the request waits for an RPC of its own (``futures.blocking``
  calls the ``thread_state.hand_off`` this module sets while it runs a
  request). The runner, done, finds the role taken and becomes the partner.
  With nothing to read, a takeover would only move the caller's next
  request to another thread: away from its warm caches and from the
  OpenMP team torch keeps for each thread that runs an operator, whose
  workers then wake cold (a parameter server's updates of 1 ms ran
  15-20 % slower, on 4 threads instead of 2). The partner
  cannot be told that a lend began without waking it, so it looks again
  every ``STANDBY_WAIT`` seconds while another thread reads: a request
  that runs long is relieved within ``STANDBY_WAIT + HANDOFF_AFTER``; one
  that blocks on an RPC, at once.
- A reader runs a request inline only while no other thread runs one;
  otherwise (the partner took the role over from a request still running)
  requests go to the pool. So one thread is always free to read, and a
  request that blocks stalls nothing but itself.

``admit(frame)`` runs before each request is handed on, by the reader
(role held), so requests start in the order they came: it may block (the
peer is at its bound of requests in flight, which stops reading) and
returns False if the stream ended meanwhile.

``packets`` ends (StopIteration) when the peer half-closed its side, and
raises (``StreamBroken``, or the carrier's own error) when it went away.
The readers read while the stream is OPEN: ``outbox``'s state, if given
(its received frames are counted, and it ends with the stream), else an
open state of their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from rrpc import wire
from rrpc.messages import mark_transport_thread, thread_state
from rrpc.outbox import Outbox
from rrpc.streams import END, HALF_CLOSE, OPEN, StreamState

# A request run inline for this long while the role is lent gets its reading
# taken over by the partner (seconds).
HANDOFF_AFTER = 0.002
# How often a partner looks whether the role was lent long enough (seconds):
# what a long inline request may delay the next request of its caller by,
# and one wake-up of an idle partner per period.
STANDBY_WAIT = 0.02


def _next_frame(frames: Iterator[wire.Frame]) -> tuple[wire.Frame | None, Exception | None]:
    """The next frame of a packet (None at its end), or why it is malformed."""
    try:
        return next(frames, None), None
    except Exception as exc:
        return None, exc


class TakeTurns:
    """Two threads read one incoming stream, each running ``run`` (see the module doc)."""

    def __init__(
        self,
        packets: Iterator[bytes],
        reader: wire.FrameReader,
        on_frame: Callable[[wire.Frame, bool], None],
        admit: Callable[[wire.Frame], bool] | None = None,
        outbox: Outbox | None = None,
        readable: Callable[[], bool] | None = None,
    ):
        self._packets = packets
        self._reader = reader
        self._on_frame = on_frame
        self._admit = admit or (lambda frame: True)
        self._outbox = outbox
        self._readable = readable  # whether bytes wait on the stream (None: cannot tell)
        self.stream = outbox.stream if outbox is not None else StreamState(OPEN)
        # The role, under _changed: who reads (a thread ident, None: nobody),
        # since when it is lent to a request its reader runs (0.0: not lent),
        # and how many threads run a request inline (0 or 1).
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # ``with self._lock``: no Python frame
        self._role: int | None = None
        self._lent_at = 0.0
        self._running = 0
        # The frames of the packet being read: whoever holds the role hands
        # them on, in order, and a partner that takes the role over goes on
        # with them before it reads the next packet.
        self._frames: Iterator[wire.Frame] | None = None

    def run(self) -> None:
        mark_transport_thread()
        me = threading.get_ident()
        stream, outbox = self.stream, self._outbox
        thread_state.serving = stream  # its replies it may send itself (``outbox.Outbox``)
        reading = False  # whether this thread holds the role
        while True:
            if not reading:
                self._take_role(me)
                reading = True
            if self._frames is None:  # the packet is done: read the next one
                if stream.state is not OPEN:  # half-closed or ended: nothing more to read
                    self._reader.close()
                    return self._give_up_role()
                try:
                    packet = next(self._packets)
                except StopIteration:  # the peer half-closed: answer what it sent, then end
                    stream.move(HALF_CLOSE)
                    self._reader.close()
                    if outbox is not None:
                        outbox.end_if_answered()
                    return self._give_up_role()
                except Exception:  # the peer went away; its side reports it
                    return self._end(None)
                # Frames are decoded one at a time, as they are handed on.
                self._frames = self._reader.frames_in(packet)
                del packet
            frame, error = _next_frame(self._frames)
            if frame is None:
                self._frames = None
                if error is not None:  # a malformed frame: end this stream, keep serving others
                    return self._end(error)
                continue
            if outbox is not None:
                outbox.received += 1
            if not self._admit(frame):
                return self._end(None)  # the peer went away while we waited
            reading = self._hand_on(me, frame)
            # Nothing stays referenced while waiting: a received tensor's
            # shared-memory slot is freed with its last reference.
            del frame

    def _hand_on(self, me: int, frame: wire.Frame) -> bool:
        """Hand on a request: run it here, the role lent, if no other
        thread runs one; else to the pool. Whether this thread still holds
        the role (a partner that took it over reads on from this packet)."""
        with self._lock:
            inline = self._running == 0
            if inline:
                self._running = 1
                self._lent_at = time.monotonic()
        if not inline:
            self._on_frame(frame, False)
            return True
        # The request runs as on any thread that runs requests: its reading
        # is lent (another thread reads when it waits), so user code here
        # is not on a thread the transport needs, and a callback added to a
        # future already done runs at once (as in torch), not on the pool.
        previous, thread_state.hand_off = thread_state.hand_off, self._hand_off
        thread_state.transport = False
        try:
            self._on_frame(frame, True)
        finally:
            thread_state.hand_off = previous
            thread_state.transport = True
            with self._lock:
                self._running = 0
                kept = self._role == me
                if kept:
                    self._lent_at = 0.0
        return kept

    def _hand_off(self) -> None:
        """The request run inline on this thread waits for an RPC: the partner reads meanwhile."""
        with self._lock:
            if self._role == threading.get_ident() and self._lent_at:
                self._role, self._lent_at = None, 0.0
                self._changed.notify()

    def _take_role(self, me: int) -> None:
        with self._lock:
            while self._role is not None:
                lent_at = self._lent_at
                if not lent_at:
                    self._changed.wait(STANDBY_WAIT)
                    continue
                left = lent_at + HANDOFF_AFTER - time.monotonic()
                if left <= 0:
                    if self._input_waits():
                        break  # the request it was lent to runs long: read on without it
                    left = HANDOFF_AFTER  # nothing to read yet: look again then
                self._changed.wait(left)
            self._role, self._lent_at = me, 0.0

    def _input_waits(self) -> bool:
        """Whether a takeover would find something to read now."""
        return bool(self._reader.unread) or self._readable is None or self._readable()

    def _give_up_role(self) -> None:
        with self._lock:
            self._role, self._lent_at = None, 0.0
            self._changed.notify_all()

    def _end(self, error: BaseException | None) -> None:
        self._frames = None  # what is left of the packet is not handed on: nobody answers it
        self.stream.move(END, error)
        self._reader.close()
        if self._outbox is not None:
            self._outbox.end(error)
        self._give_up_role()
