"""Who reads a gRPC stream's replies: the caller that waits for its own, or the reader thread.

A reply read by the stream's reader thread reaches the thread that waits for
it through a wake-up: on a small VM, tens of microseconds of a small call's
time between hosts. So, as on a lane (``lane.py``), a thread that sends a
call and blocks for its reply (``rpc_sync``) reads the stream itself while
no one else does (``lead``): it takes the stream's events
(``grpc_call.Call.take``) until its reply is in, handing every other reply it
meets to its call. The read turn (``_turn``) is held by one thread at a time,
so replies are cut from the byte stream in order.

The reader thread (``read``, on ``rrpc-recv-<peer>``) takes the turn

- when a reply is awaited that no caller reads itself (``need_reader``: an
  ``rpc_async``, a leader that left with calls still open, a sender waiting
  for room), and reads while replies are awaited or a send is in flight;
- and when nobody led for ``IDLE`` seconds: then it waits for whatever comes
  next, so that a stream that ends while no call is open ends at once for
  the worker, as before. A caller that finds it reading waits for its reply
  like any other; the reader lets go of the turn once nothing is awaited.

A leader's wait is bounded although gRPC's ``next_event`` takes no timeout:
its deadline (one scheduler entry, moved only when a lead ends earlier than
it: ``_watch``), and a call that ends without its reply (its own deadline:
``interrupt``), wake the thread waiting for the stream's events with an
empty batch of operations (``Call.wake``), which gRPC completes at once. A
signal's exception in a leader (Ctrl-C, in the main thread) ends the stream
(``Call.abandon``): it may have cut the count of the call's events short. A leader that meets the
stream's end, or a frame it cannot read, leaves the rest to the reader
thread, which ends the stream as it always did (``transport.Connection``).

Rules (ARCHITECTURE.md): user code never runs on a thread while it holds the
read turn (a leader is a transport thread while it reads); requests from one
caller start in order (one stream); the reader thread does not wait for
room for anything, nor run user code.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from rrpc import streams, wire
from rrpc.grpc_call import Call, StreamEnded
from rrpc.messages import thread_state
from rrpc.outbox import Outbox

# Seconds after the last leader left before the reader thread waits for the
# stream's next event anyway (the end of a stream no call is open on).
IDLE = 0.1


class Replies:
    """The reading of ``call``'s replies: their frames cut by ``reader`` and
    handed to ``on_frame``, counted as received in ``outbox`` (whose open
    exchanges are the calls still awaiting theirs)."""

    def __init__(
        self,
        call: Call,
        reader: wire.FrameReader,
        on_frame: streams.FrameHandler,
        outbox: Outbox,
        call_at: Callable[..., Any],
    ):
        self._call = call
        self._call_at = call_at  # the run's scheduler's: (monotonic time, fn)
        self._reader = reader
        self._on_frame = on_frame
        self._outbox = outbox
        self._turn = threading.Lock()  # held by the thread taking the stream's events
        self._wanted = threading.Condition(threading.Lock())
        self._reading_wanted = True  # the reader thread reads at once when it starts
        self._ready = False  # the reader thread took over from the handshake
        self._leading = False  # a caller holds the turn
        self._last_lead = 0.0
        # The leader's deadline, and when the scheduler looks at it next (inf:
        # it does not). Moved only when a lead ends earlier than that: for
        # calls of one timeout, one scheduler entry per timeout, not per call.
        self._lead_deadline = math.inf
        self._watch_at = math.inf
        # What a leader met and left to the reader thread: the stream's end,
        # or an error reading it (raised there, where the stream ends).
        self._failure: BaseException | None = None
        call.want_reader = self.need_reader

    def lead(self, done: Callable[[], bool], deadline: float) -> bool:
        """Read replies on the calling thread until ``done()`` or the
        ``deadline`` (``time.monotonic()``; inf: none), if nobody else reads;
        False at once if somebody does (the caller then waits for its reply
        like any other)."""
        if not self._ready or self._failure is not None:
            return False
        if not self._turn.acquire(blocking=False):
            return False
        self._lead_deadline = deadline
        self._leading = True  # before done() is asked: see interrupt()
        state = thread_state
        was_transport, state.transport = state.transport, True
        try:
            while not done() and time.monotonic() < deadline:
                if deadline < self._watch_at:  # (again: _watch may have just run)
                    self._watch_at = deadline
                    self._call_at(deadline, self._watch)
                self._read_once()
        except Exception as exc:  # the stream's end, or a reply we cannot read
            self._failure = exc
        except BaseException as exc:
            # A signal's exception (Ctrl-C) may have cut the taking of an event
            # short, its count with it: the call is not polled again.
            reason = f"{type(exc).__name__} in the thread reading it"
            self._call.abandon(reason)
            self._failure = StreamEnded(grpc.StatusCode.CANCELLED, reason)
            raise
        finally:
            self._leading = False
            self._last_lead = time.monotonic()
            state.transport = was_transport
            self._turn.release()
            # Not for a send still in flight (its completion may come after
            # the reply): whoever sends next takes it, or waits for room and
            # calls for the reader (``Call.want_reader``).
            if self._failure is not None or self._outbox.open_exchanges() > 0:
                self.need_reader()
        return True

    def interrupt(self) -> None:
        """A call ended without its reply (its deadline passed): a caller
        waiting in the stream for its reply looks again."""
        if self._leading:
            self._call.wake()

    def _watch(self) -> None:
        """On the scheduler's thread: wake a leader past its deadline."""
        self._watch_at = math.inf
        if not self._leading:
            return  # the next lead schedules its own
        deadline = self._lead_deadline
        if deadline <= time.monotonic():
            self._call.wake()
        elif deadline < self._watch_at:
            self._watch_at = deadline
            self._call_at(deadline, self._watch)

    def need_reader(self) -> None:
        """A reply is awaited, or a send's completion, that no caller will take
        itself: make sure the reader thread reads."""
        with self._wanted:
            self._reading_wanted = True
            self._wanted.notify()

    def read(self, first: bytes = b"") -> None:
        """The reader thread's part, after the stream's handshake (``first``:
        bytes that came with it). Returns when the stream ended with OK;
        raises ``StreamEnded`` when it ended otherwise, or what reading a
        reply raised (a malformed frame)."""
        if first:
            self._deliver(first)
        self._ready = True
        wanted = self._wanted
        while True:
            with wanted:
                if not self._reading_wanted:
                    wanted.wait(IDLE)
                asked, self._reading_wanted = self._reading_wanted, False
            failure = self._failure
            if failure is not None:  # a leader met the stream's end, or a bad frame
                if isinstance(failure, StopIteration):
                    return
                raise failure
            if self._leading or (not asked and time.monotonic() - self._last_lead < IDLE):
                continue  # a caller reads, or did lately and may again
            if not self._turn.acquire(blocking=False):
                continue  # a leader took it since: it calls for us as it leaves
            try:
                self._read_once()  # whatever comes first: a reply, the stream's end
                while self._awaited():
                    self._read_once()
            except StopIteration:
                return
            finally:
                self._turn.release()

    def _awaited(self) -> bool:
        """Whether a reply is awaited, or a send's completion."""
        return self._outbox.open_exchanges() > 0 or self._call.busy()

    def _read_once(self) -> None:
        packet = self._call.take()
        if packet is not None:
            self._deliver(packet)

    def _deliver(self, packet: bytes) -> None:
        streams.hand_frames(packet, self._reader, self._on_frame, self._outbox)
