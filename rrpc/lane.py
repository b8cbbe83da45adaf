"""The same-host lane, caller's end: calls to a worker of this host over a Unix socket.

Theory of operation. gRPC's Python API costs a small call two thread
hand-offs per side (its sender thread, then the reader that wakes the
caller), ~80 µs each on a small VM; a Unix socket round trip on which the
calling thread writes its request and reads its own reply costs ~8 µs. So
two workers that share a host (same boot, pid and network namespace, and
user: ``lane_key``) carry their calls over a lane:

- The callee listens on ``<dir>/lane.sock`` in a directory only its user may
  enter (``mkdtemp``: mode 0700), and advertises the path beside its gRPC
  address. The caller dials it at its first call, and both ends run the
  cluster token's challenge-response on the socket (``auth.py``, the same
  proofs as on a gRPC stream, bound to the socket's path) before either
  reads a frame of the other.
- The bytes on the socket are the frames of a gRPC stream (``wire``): the
  same ``FrameReader`` cuts them, with the same limits.
- **Caller.** The calling thread encodes and writes its request itself
  (``Writer``: a direct non-blocking ``sendmsg`` of the frame's pieces; what
  the socket does not take waits in order for the lane's sender thread).
  Then, if no one is reading the lane, it takes the read turn and reads until
  its own reply is in, handing every other reply it meets to its call
  (``lead``): the sequential ``rpc_sync`` never wakes another thread. A
  caller that finds the turn taken waits for its reply like any other. When
  replies are awaited and nobody leads (``rpc_async``, or a leader that got
  its reply while other callers' calls are still open), the lane's own
  reader thread reads. A reply that only rrpc's bookkeeping awaits (an
  RRef's creation, a delete, an autograd context's release: ``Agent`` knows
  the kinds) does not wake it at once, as it is sent or as a leader leaves:
  the next caller that leads reads it with its own (``remote()`` then
  ``to_here()`` wakes no other thread), and the reader thread only if none
  has within ``READ_SOON``.
- **Neither end sleeps at once.** Whoever waits on the socket (a leader, the
  reader thread, the callee's reader) looks for bytes without sleeping for up
  to ``lane_spin`` first, while its recent waits were that short
  (``lane_io.Reader``, yielding the CPU at each look past the first 50 µs):
  a wake-up is what a round trip here would cost most.
- **Callee.** Two threads take turns reading the lane (``turns.TakeTurns``,
  as on a gRPC stream): the one that read a lone request runs it itself,
  lending it the read role, and reads the next one when it is done (its
  partner takes over if the request waits for an RPC or runs long); the
  reply goes straight to the socket from whichever thread produced it. A
  sequential caller's round trip wakes no thread on either side.
- Calls end as on gRPC: by their reply, their deadline, or the lane breaking
  (EOF, a reset, a malformed frame), which fails every call open on it at once
  with ``PeerUnavailableError`` naming the peer. The agent then sends the next
  call over gRPC while the lane is reopened. A frozen peer keeps its socket
  open: the gRPC stream beside the lane keeps sending keepalive pings, and
  when it fails the agent breaks the lane too (``peer_timeout``).

Rules:
- User code never runs on a thread while it holds a lane's read turn: a leader
  is marked a transport thread while it reads, so user callbacks of the futures
  it completes go to the callback pool.
- Requests from one caller start in the order they were written: one socket
  per caller and callee, read by one thread at a time.
- The callee's memory is bounded as on gRPC: a calling peer's requests waiting
  for a worker thread (``PEER_IN_FLIGHT``), and replies waiting unsent
  (``REPLY_BACKLOG``: past it, the lane's requests are not read).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from rrpc import auth, logs, streams, wire
from rrpc.lane_io import (
    GOODBYE_ID,
    HANDSHAKE_TIMEOUT,
    MAGIC,
    POLL_SLICE_MS,
    LaneBroken,
    Reader,
    Writer,
    lane_key,
    open_as_caller,
    peer_pid,
    shut,
    unresponsive,
)
from rrpc.messages import (
    AuthenticationError,
    PeerUnavailableError,
    thread_state,
    transport_thread,
)

# A reply nobody waits for at once is read by the next thread that leads, or
# by the lane's reader thread this many seconds after it was asked for (``read_soon``).
READ_SOON = 0.002


# -- The caller's end ------------------------------------------------------------
class Lane:
    """The caller's end of a lane to one peer: requests out, replies in.

    ``on_frame(frame)`` receives each reply (on whichever thread reads) and
    says whether it ended a call still open; ``on_close(lane, error)``
    reports once that the lane ended."""

    def __init__(
        self,
        sock: socket.socket,
        peer_name: str,
        on_frame: Callable[[wire.Frame], bool],
        on_close: Callable[[Lane, BaseException | None], None],
        reader: wire.FrameReader,
        call_later: Callable[..., Any],
        peer_timeout: float = 8.0,
        spin: float = 0.0,
    ):
        self.stream = streams.StreamState(streams.OPEN)
        # Liveness: a peer that sent nothing for half of ``peer_timeout`` while
        # calls wait is looked up in /proc (lane_io.unresponsive).
        self._peer_pid = peer_pid(sock)
        self._quiet_limit = peer_timeout / 2
        self._heard = time.monotonic()
        self._sock = sock
        self._bytes = Reader(sock, spin)
        self.peer_name = peer_name
        self._on_frame = on_frame
        self._on_close = on_close
        self._reader = reader
        self._writer = Writer(sock, peer_name, limit=1 << 62)
        self._turn = threading.Lock()  # held by the thread reading replies
        self._open = 0  # calls sent on this lane and not ended (``ended``)
        # Those of them whose replies only rrpc's bookkeeping awaits, by request id,
        # and of these the calls past their deadline (``expired``).
        self._bookkeeping: set[int] = set()
        self._late: set[int] = set()
        self._open_lock = threading.Lock()
        self._wanted_lock = threading.Lock()
        self._wanted = threading.Condition(self._wanted_lock)
        self._reading_wanted = False
        self._soon = False  # a read_soon check is scheduled
        self._call_later = call_later  # the run's scheduler's
        self.closed = False
        self.error: BaseException | None = None
        self._closed_once = threading.Lock()
        self._thread = threading.Thread(
            target=self._read_in_background, name=f"rrpc-lane-recv-{peer_name}", daemon=True
        )
        self._thread.start()

    # Sending
    def expect(self, request_id: int, bookkeeping: bool = False) -> None:
        """A call on this lane awaits its reply (counted open until ``ended``);
        ``bookkeeping``: only rrpc's bookkeeping awaits it (see ``read_soon``)."""
        with self._open_lock:
            self._open += 1
            if bookkeeping:
                self._bookkeeping.add(request_id)

    def send(self, pieces: list[Any]) -> None:
        """Write one frame (a request: ``expect`` its reply first)."""
        try:
            self._writer.write(pieces)
        except LaneBroken as exc:
            self._break(exc)

    def ended(self, request_id: int) -> None:
        """One call sent on this lane ended (its reply, its deadline)."""
        with self._open_lock:
            self._open -= 1
            self._bookkeeping.discard(request_id)
            self._late.discard(request_id)

    def expired(self, request_id: int) -> None:
        """A call's deadline passed: its caller waits no more, but its reply is
        read all the same, as bookkeeping (``read_soon``), and ends the call.
        Unread, it would wait in the socket for the next call to this peer,
        and an RRef in it would not be counted, nor let go, until then."""
        with self._open_lock:
            self._bookkeeping.add(request_id)
            self._late.add(request_id)
        self.read_soon()

    def read_soon(self) -> None:
        """A reply is awaited that nobody waits for at once (the bookkeeping of
        an RRef's creation or deletion): a thread that leads reads it with its
        own (``remote().to_here()`` wakes no other thread); if none has within
        ``READ_SOON`` seconds, the lane's reader thread does."""
        if not self._soon:
            self._soon = True
            self._call_later(READ_SOON, self._read_if_awaited)

    def _read_if_awaited(self) -> None:
        self._soon = False
        if self._open > 0 and not self.closed:
            self.need_reader()

    def need_reader(self) -> None:
        """A reply is awaited that no caller will read itself: make sure someone reads."""
        if self._turn.locked():
            return
        with self._wanted_lock:
            self._reading_wanted = True
            self._wanted.notify()

    # Reading
    def lead(self, done: Callable[[], bool], deadline: float) -> bool:
        """Read replies on the calling thread until ``done()`` or the
        ``deadline`` (``time.monotonic()``; inf: none), if nobody else is
        reading; False at once if somebody is (the caller then waits for its
        reply like any other). A leader that leaves while replies are still
        awaited hands reading to the lane's reader thread, at once if a caller
        awaits one, else (bookkeeping only) as ``read_soon`` does: woken now,
        the reader would hold the turn when this thread's next call wants to
        lead, and hand it its reply (a wake-up, ~0.4 ms here)."""
        if not self._turn.acquire(blocking=False):
            return False
        # A transport thread while it reads (as ``messages.transport_thread()``,
        # without a generator's cost on the per-call path).
        state = thread_state
        was_transport, state.transport = state.transport, True
        try:
            first = True  # its request was just written: no reply can be in yet
            while not done() and not self.closed:
                left_ms = (deadline - time.monotonic()) * 1000
                if left_ms <= 0:
                    break
                self._read_once(int(min(POLL_SLICE_MS, left_ms)) + 1, first)
                first = False
        finally:
            state.transport = was_transport
            self._turn.release()
            if not self.closed:
                if self._open > len(self._bookkeeping):  # a caller awaits one
                    self.need_reader()
                elif self._open > 0:  # only bookkeeping: the next leader reads it, or soon
                    self.read_soon()
        return True

    def _read_once(self, timeout_ms: int, wait_first: bool = False) -> None:
        try:
            data = self._bytes.recv(timeout_ms, wait_first)
        except LaneBroken as exc:
            self._break(exc)
            return
        if data is None:
            if time.monotonic() - self._heard > self._quiet_limit:
                self._heard = time.monotonic()  # looked again after as long
                why = unresponsive(self._peer_pid)
                if why is not None:
                    self._break(LaneBroken(f"{self.peer_name} does not answer: {why}"))
            return
        self._heard = time.monotonic()
        try:
            frames = self._reader.frames_in(data)
            del data
            for frame in frames:
                if frame.envelope.request_id == GOODBYE_ID:
                    reason = bytes(frame.payload).decode(errors="replace")
                    self._break(LaneBroken(f"{self.peer_name} closed it: {reason}"))
                    return
                request_id = frame.envelope.request_id
                if self._on_frame(frame) or request_id in self._late:
                    self.ended(request_id)
                del frame
        except Exception as exc:  # a malformed reply: the lane cannot be trusted further
            self._break(LaneBroken(f"malformed frame from {self.peer_name}: {exc}"))

    def _read_in_background(self) -> None:
        with transport_thread():
            while not self.closed:
                with self._wanted_lock:
                    while not self._reading_wanted and not self.closed:
                        self._wanted.wait()
                    self._reading_wanted = False
                while not self.closed and self._open > 0 and self._turn.acquire(blocking=False):
                    try:
                        while self._open > 0 and not self.closed:
                            self._read_once(POLL_SLICE_MS)
                    finally:
                        self._turn.release()

    # Ending
    def fail(self, error: BaseException) -> None:
        """End the lane from outside (its peer is known gone): open calls fail."""
        self._break(error)

    def _break(self, error: BaseException) -> None:
        if not self._closed_once.acquire(blocking=False):
            return
        if isinstance(error, LaneBroken):  # the calls open on it fail with this
            error = PeerUnavailableError(f"lane to {self.peer_name} broke: {error}")
        self.error = error
        self.closed = True
        self.stream.move(streams.END, error)
        self._writer.fail(error)
        shut(self._sock)
        with self._wanted_lock:
            self._wanted.notify_all()
        self._on_close(self, error)

    def close(self, timeout: float = 0.0) -> None:
        """End the lane; calls still open on it fail (the agent waited for them)."""
        if not self._closed_once.acquire(blocking=False):
            return
        self.closed = True
        self.stream.move(streams.END)
        self._writer.fail(LaneBroken("lane closed"))
        shut(self._sock)
        with self._wanted_lock:
            self._wanted.notify_all()
        self._on_close(self, None)

    abort = close

    def release(self) -> None:
        self._sock.close()


class Lanes:
    """The caller's lanes, one per peer that may have one (``peers.Peer.lane_path``):
    opened at the first call to it, reopened at the next call after a break.
    A lane that cannot open is not tried again for ``RETRY_AFTER`` seconds:
    meanwhile the calls go over gRPC (the fallback), and ``on_failed(rank)``
    hears of it (the agent then suspects the peer: see ``routes``' rules).

    A lane opens on the thread of the call that needs it, so its opening
    exchange spends that call's time: it is limited by the call's timeout as
    well as ``CONNECT_TIMEOUT``, and a peer found stopped or gone as soon as
    the socket connects fails it at once (``connect``). A peer frozen before
    the first call to it (SIGSTOP) still accepts: the kernel's listen backlog
    takes the connection, and the handshake would wait out its whole limit."""

    RETRY_AFTER = 5.0
    CONNECT_TIMEOUT = 2.0  # seconds for the whole opening exchange

    def __init__(
        self,
        rank: int,
        token: auth.Token | None,
        new_lane: Callable[[socket.socket, Any], Lane],
        on_failed: Callable[[int], None],
    ):
        self._rank = rank
        self._token = token
        self._new_lane = new_lane
        self._on_failed = on_failed
        self.open: dict[int, Lane] = {}
        self._retry_at: dict[int, float] = {}
        self._opening: set[int] = set()  # peers whose lane a thread is opening
        self._lock = threading.Lock()
        self._stopped = False

    def to(self, peer: Any, path: str, timeout: float = 0.0) -> Lane | None:
        """The lane to ``peer`` (a WorkerInfo) at ``path``, opened if need be
        within ``timeout`` seconds (the calling call's; 0: none, only
        ``CONNECT_TIMEOUT``); None if it has none or it cannot open now (the
        call goes over gRPC).

        One thread opens a peer's lane, without the lock: calls to that peer
        made meanwhile, and to every other peer, do not wait for it."""
        with self._lock:
            found = self.open.get(peer.id)
            if found is not None or self._stopped:
                return found
            if peer.id in self._opening or time.monotonic() < self._retry_at.get(peer.id, 0.0):
                return None
            self._opening.add(peer.id)
        limit = min(timeout, self.CONNECT_TIMEOUT) if timeout > 0 else self.CONNECT_TIMEOUT
        try:
            sock = connect(path, (self._rank, peer.id), self._token, timeout=limit)
        except (OSError, AuthenticationError, struct.error) as exc:
            with self._lock:
                self._opening.discard(peer.id)
                self._retry_at[peer.id] = time.monotonic() + self.RETRY_AFTER
            self._on_failed(peer.id)
            logs.event(
                "lane-unavailable",
                peer.name,
                "lane to %s at %s could not open (%s): calls go over gRPC",
                peer.name,
                path,
                exc,
            )
            return None
        with self._lock:
            self._opening.discard(peer.id)
            if self._stopped:
                sock.close()
                return None
            opened = self.open[peer.id] = self._new_lane(sock, peer)
        return opened

    def forget(self, peer_rank: int, closed: Lane) -> None:
        """``closed`` ended: the next call to its peer opens a new lane."""
        with self._lock:
            if self.open.get(peer_rank) is closed:
                del self.open[peer_rank]

    def break_to(self, peer_rank: int, error: BaseException) -> None:
        """The peer stopped answering (its gRPC stream failed): end its lane too."""
        found = self.open.get(peer_rank)
        if found is not None:
            found.fail(error)

    def stop(self) -> list[Lane]:
        """No lane opens from now on; the lanes still open, forgotten."""
        with self._lock:
            self._stopped = True
            lanes, self.open = list(self.open.values()), {}
        return lanes


def connect(
    path: str,
    ranks: tuple[int, int],
    token: auth.Token | None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> socket.socket:
    """Dial a peer's lane and prove each other the token, all within
    ``timeout`` seconds; the open socket (non-blocking). Raises
    AuthenticationError or OSError (LaneBroken: the peer's process is
    stopped or gone, which the kernel says at once; the handshake would
    spend all of ``timeout`` on it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        deadline = time.monotonic() + timeout  # one limit for the whole exchange
        sock.connect(path)
        why = unresponsive(peer_pid(sock))
        if why is not None:
            raise LaneBroken(f"{path}: {why}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{path}: lane handshake timed out")
        open_as_caller(sock, MAGIC, ranks, path, token, left)
        return sock
    except BaseException:
        sock.close()
        raise


__all__ = ["Lane", "LaneBroken", "Lanes", "connect", "lane_key"]
