"""A stream's mechanics, whatever carries it: its state, admission, reading in turns.

Nothing here knows gRPC or sockets. A carrier (``transport.py``: a gRPC
stream; a same-host lane) hands in the packets it receives as an iterator
and gives an ``outbox.Outbox`` its ``send`` (or writes its own way); the
rest is here.

Theory of operation:

- **Sending** (``rrpc/outbox.py``): each direction of a stream is a byte
  stream of frames cut into packets, sent by the threads that queue them.
- **Serving** (``turns.TakeTurns``, which builds on this module): two
  threads take turns reading an incoming stream; a lone request runs on the
  thread that read it.
- **Admission** (``InFlight``): one calling peer cannot starve the others.
  Its requests read and waiting to be run are bounded (``PEER_IN_FLIGHT``,
  across all its streams); at the bound its streams' readers stop reading,
  the carrier's flow control fills and the peer's sends wait, while other
  peers' requests go on. Replies waiting unsent count too
  (``REPLY_BACKLOG``): past it, the stream's requests are not read.

The state of a stream (``StreamState``) is one field, moved only by
``StreamState.move`` through one table::

    state            event          next state       when
    ---------------  -------------  ---------------  -----------------------------------------
    OPENING          AUTHENTICATE   AUTHENTICATING   it opened with a token: the handshake runs
    OPENING          START          OPEN             it opened without one
    AUTHENTICATING   PROVEN         OPEN             the peer proved it knows the token
    AUTHENTICATING   EXPIRE         CLOSED           it did not, in time (the stream is cancelled)
    OPEN             HALF_CLOSE     HALF_CLOSED      the peer sent its last frame: what is open
                                                     is answered, then the stream ends
    OPEN             EXPIRE         OPEN             the handshake's timer went off as the proof
    HALF_CLOSED      EXPIRE         HALF_CLOSED        came in: nothing to do
    all but CLOSED   END            CLOSED           it ended: answered, broken, refused, stopped
    CLOSED           any            CLOSED           an end that another thread learns late

Any other event is a bug in rrpc: ``move`` raises ``StreamStateError``
naming the state and the event (a START or a HALF_CLOSE while
AUTHENTICATING would read frames of a peer that never proved itself).

Rules:
- Frames are read only while the stream is OPEN: with a token, neither end
  reads a frame of the other before the handshake (``auth.py``) is over.
- ``move`` is the only writer of ``StreamState.state``; any thread may read
  it without a lock (one attribute). A move wakes whoever waits on the state.
- A stream that ends drops its reader's partial frame at once, and no frame
  stays referenced while the next packet is awaited: a received tensor may
  hold a peer's shared-memory slot until its last reference goes.
- The one copy on the way out is the ``join`` that builds a packet, straight
  from the tensors' memory (gRPC sends only ``bytes``).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from rrpc import wire

# Requests of one calling peer that this worker may hold read and not yet
# decoded (queued for the worker pool). Another peer's request waits behind
# at most this many of a flooder's: during a flood of 200,000 tiny calls,
# another caller's calls took at most 12-40 ms here with 64, 74-100 ms with
# 256. A pool decodes 64 in a few milliseconds, so a caller with more calls
# in flight than that is not slowed (64 calls in flight: 18-24k calls/s
# with 64, 16-17k with 256, same runs).
PEER_IN_FLIGHT = 64
# A frame weighs one request more per this many tensor buffers: each buffer
# costs the receiver an object for as little as one byte on the wire.
BUFFERS_PER_REQUEST = 256
# Reply bytes a stream may hold unsent (its caller reads slower than this
# worker answers, or not at all) before the stream's requests stop being
# read. What is admitted already still runs and answers, so a stream holds at
# most this plus the replies of the requests in flight; a caller that reads
# gets every reply.
REPLY_BACKLOG = 64 << 20

FrameHandler = Callable[[wire.Frame], object]  # what it returns is not used


# -- The state of one stream --------------------------------------------------------
class State(enum.Enum):
    OPENING = "opening"
    AUTHENTICATING = "authenticating"
    OPEN = "open"
    HALF_CLOSED = "half-closed"
    CLOSED = "closed"


class Event(enum.Enum):
    AUTHENTICATE = "authenticate"
    START = "start"
    PROVEN = "proven"
    EXPIRE = "expire"
    HALF_CLOSE = "half-close"
    END = "end"


OPENING, AUTHENTICATING, OPEN, HALF_CLOSED, CLOSED = State
AUTHENTICATE, START, PROVEN, EXPIRE, HALF_CLOSE, END = Event

# The table of the module docstring: state -> {event: next state}.
_TRANSITIONS: dict[State, dict[Event, State]] = {
    OPENING: {AUTHENTICATE: AUTHENTICATING, START: OPEN, END: CLOSED},
    AUTHENTICATING: {PROVEN: OPEN, EXPIRE: CLOSED, END: CLOSED},
    OPEN: {HALF_CLOSE: HALF_CLOSED, EXPIRE: OPEN, END: CLOSED},
    HALF_CLOSED: {EXPIRE: HALF_CLOSED, END: CLOSED},
    CLOSED: {event: CLOSED for event in Event},
}


class StreamStateError(RuntimeError):
    """An event arrived in a state that does not allow it: a bug in rrpc."""


class StreamBroken(ConnectionError):
    """What a carrier's packet iterator raises when its peer went away."""


class StreamState:
    """The state of one stream (see the table at the top), and why it ended.

    ``error`` is the error of the move that closed the stream (None: it
    ended cleanly, or is not closed)."""

    def __init__(self, state: State = OPENING):
        self.state = state
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # ``with self._lock``: no Python frame

    def move(self, event: Event, error: BaseException | None = None) -> bool:
        """Apply ``event``; True if it changed the state (False: the event
        changes nothing here, e.g. the stream was closed meanwhile)."""
        with self._lock:
            state = self.state
            following = _TRANSITIONS[state].get(event)
            if following is None:
                raise StreamStateError(f"stream event {event.value!r} in state {state.value!r}")
            if following is state:
                return False
            if following is CLOSED:
                self.error = error  # before the state: readers of CLOSED see it
            self.state = following
            self._changed.notify_all()
            return True

    def wait_while(self, *states: State) -> State:
        """Wait until the stream is in none of ``states``; the state it is in."""
        with self._lock:
            while self.state in states:
                self._changed.wait()
            return self.state

    def __repr__(self) -> str:
        return f"StreamState({self.state.value})"


# -- Admission: a calling peer's requests in flight ----------------------------------
def weight(frame: wire.Frame) -> int:
    """What a request counts against its peer's bound (``PEER_IN_FLIGHT``)."""
    return 1 + len(frame.buffers) // BUFFERS_PER_REQUEST


class InFlight:
    """The requests of one calling peer waiting to be run on this worker:
    from the moment its stream's reader hands one on until a pool thread has
    decoded it (``Frame.on_consumed``), i.e. its frame waits in the pool's
    queue. Requests that run are bounded by the pool; one that waits for an
    RPC of its own does not count here either (nor for the pool), so nested
    calls from one peer never wait on each other here.

    The reader takes a frame's weight before it hands the request on, and
    waits while the peer is at ``limit``: reading stops, the carrier's flow
    control pushes back on the peer, and what it has already sent is served.
    A frame heavier than the limit goes through alone, once nothing else of
    the peer's is waiting."""

    def __init__(self, limit: int = PEER_IN_FLIGHT, admission: Admission | None = None):
        self.limit = limit
        self._admission = admission  # whose ``wait_open`` gates every request
        self.count = 0
        self._waiting = 0  # readers waiting in ``take``: ``give`` wakes them only
        # Reentrant: a frame may be freed by a garbage collection that runs
        # while this thread holds the lock.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    def take(self, weight: int, ended: Callable[[], Any]) -> bool:
        """Take ``weight``, waiting for requests to be taken up if need be;
        False if the stream ``ended`` meanwhile (nobody is left to answer)."""
        if self._admission is not None and self._admission.wait_open():
            self._admission = None  # waited once: not asked again, per request
        with self._lock:
            while self.count and self.count + weight > self.limit:
                if ended():
                    return False
                self._waiting += 1
                try:
                    self._changed.wait()
                finally:
                    self._waiting -= 1
            self.count += weight
        return True

    def give(self, weight: int = 1) -> None:
        with self._lock:
            self.count -= weight
            if self._waiting:
                self._changed.notify_all()

    def wake(self) -> None:
        """A stream ended: its reader may be waiting in ``take``."""
        with self._lock:
            self._changed.notify_all()


class Admission:
    """The ``InFlight`` of each calling peer, by rank: one per peer, whatever
    stream (or carrier) its requests come on; and the gate they all pass
    (``gate``)."""

    def __init__(self, limit: int = PEER_IN_FLIGHT):
        self._limit = limit
        self._peers: dict[int, InFlight] = {}
        self._lock = threading.Lock()
        self._opened: threading.Event | None = None
        self._open_wait = 0.0

    def gate(self, opened: threading.Event, wait: float) -> None:
        """Hand no request on before ``opened`` is set (at most ``wait``
        seconds): the worker's ``init_rpc`` is done. A peer that finished
        its own first may call already; its requests wait here, in its
        stream's reader with the reading, so they start in the order they
        came. (Handed on first, each would wait wherever it was to run, and
        a later one could start first.)"""
        self._opened, self._open_wait = opened, wait

    def wait_open(self) -> bool:
        """Wait for the gate; True once it need not be asked again (it was
        opened, or waited for as long as ``gate`` said), False before ``gate``."""
        opened = self._opened
        if opened is None:
            return False
        if not opened.is_set():
            opened.wait(self._open_wait)
        return True

    def of(self, rank: int) -> InFlight:
        with self._lock:
            in_flight = self._peers.get(rank)
            if in_flight is None:
                in_flight = self._peers[rank] = InFlight(self._limit, self)
            return in_flight


class Exchanges(Protocol):
    """What counts a stream's received frames (``outbox.Outbox``)."""

    received: int


class UnreadReplies(Protocol):
    """Replies a peer has not read that are not in any stream's backlog
    (``peers.UnreadReplies``: those in shared memory), by the peer's rank."""

    def wait(self, rank: int, ended: Callable[[], Any]) -> bool: ...

    def forget(self, rank: int) -> None: ...


def admit_with(
    in_flight: InFlight,
    wait_for_room: Callable[[], bool],
    ended: Callable[[], Any],
    replies_unread: Callable[[Callable[[], Any]], bool] | None = None,
) -> Callable[[wire.Frame], bool]:
    """``turns.TakeTurns``'s ``admit`` for a stream whose unsent replies wait in
    ``wait_for_room`` and whose peer's requests count in ``in_flight``;
    ``ended()`` is true once the stream ended. ``replies_unread(ended)``
    waits while the peer has not read too many bytes of replies sent to it
    in shared memory (``shm.Unseen``); False if the stream ended meanwhile."""

    def admit(frame: wire.Frame) -> bool:
        return (
            wait_for_room()
            and (replies_unread is None or replies_unread(ended))
            and in_flight.take(weight(frame), ended)
        )

    return admit


# -- Receiving -----------------------------------------------------------------------
def hand_frames(
    packet: bytes, reader: wire.FrameReader, on_frame: FrameHandler, outbox: Exchanges
) -> None:
    """Hand every frame that ``packet`` completes to ``on_frame``, in order,
    each counted as received (a caller's replies: see ``grpc_replies``)."""
    # No frame may stay referenced here once this returns: a received
    # tensor's shared-memory slot is freed with its last reference.
    frames = reader.feed(packet)
    del packet
    for frame in _taken(frames):
        outbox.received += 1
        on_frame(frame)
    frame = frames = None  # type: ignore[assignment]


def _taken(frames: list[wire.Frame]) -> Iterator[wire.Frame]:
    """Each frame in order, its slot cleared as it is handed out (linear time;
    ``pop(0)`` made a packet of N frames cost N²), so none stays referenced."""
    for index, frame in enumerate(frames):
        frames[index] = None  # type: ignore[call-overload]
        yield frame
        del frame
