"""Bytes on a lane's Unix socket: the opening exchange, reads, and ordered writes.

Both ends of a lane (``lane.py``, the caller's; ``lane_listener.py``, the
callee's) use these; a bulk socket (``bulk.py``) opens with the same
exchange. The socket is non-blocking; a thread that must wait
for it waits in ``poll``, so that a reader can re-check its own reply (its
deadline, a break) while no byte comes, and a writer never blocks while it
holds the write lock.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from rrpc import auth, wire
from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import ERROR, AuthenticationError
from rrpc.spin import Spin

RECV_SIZE = 256 << 10  # bytes asked of the socket per read
IOV_MAX = 512  # pieces per sendmsg (Linux allows 1024)
POLL_SLICE_MS = 100  # a leader re-checks its own reply (deadline, break) this often
HANDSHAKE_TIMEOUT = 10.0  # seconds either end has to finish the handshake

# The opening exchange, before any frame (sizes fixed; all integers little-endian):
#
#   caller -> callee   MAGIC (8) | caller rank (q) | caller nonce (32)
#   callee -> caller   callee rank (q) | callee nonce (32) | callee proof (32)
#   caller -> callee   caller proof (32)
#   callee -> caller   ACCEPTED (1 byte), or REFUSED and the socket closes
#
# Without a token the proofs are 32 zero bytes and are not checked: the lane
# then trusts what the socket's directory lets in (this user's processes).
# The proofs cover both ranks, both nonces and where the callee listens
# (``auth.Binding``); MAGIC says what the socket is for.
MAGIC = b"rrpclan1"
# After the opening exchange only frames cross (``wire``). A frame with request
# id 0 is the callee's last word: its payload is why it closes the lane (UTF-8
# text, not a pickle), e.g. a request over its ``max_message_size``.
GOODBYE_ID = 0
ACCEPTED, REFUSED = b"\x01", b"\x00"
HELLO = struct.Struct(f"<8sq{auth.NONCE_SIZE}s")
ANSWER = struct.Struct(f"<q{auth.NONCE_SIZE}s{auth.PROOF_SIZE}s")
NO_PROOF = bytes(auth.PROOF_SIZE)


def lane_key() -> str:
    """Equal on two workers that may open a lane: same boot, pid namespace,
    user and network namespace (as TensorPipe checks before its shm transport)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
        net_ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot_id}/{pid_ns}/{net_ns}/{os.getuid()}"


class LaneBroken(ConnectionError):
    """The lane's socket ended or failed (the calls open on it then fail with
    ``PeerUnavailableError``, naming the peer)."""


class LaneClosed(LaneBroken):
    """The peer closed its end of the lane."""


# -- Bytes on a non-blocking socket --------------------------------------------
def wait(sock: socket.socket, events: int, timeout_ms: int) -> None:
    fd = sock.fileno()
    if fd < 0:  # closed by another thread (the lane broke): the caller's next try says so
        return
    poller = select.poll()
    poller.register(fd, events)
    poller.poll(timeout_ms)


class Reader:
    """The reading side of a lane's socket, for whichever thread holds its
    read turn (one at a time: the poll object is not shared by two waits).

    ``spin``: seconds a read that finds no byte keeps looking (``poll``
    without a timeout, in a loop) before it sleeps in ``poll``, while its
    recent waits were that short (``spin.Spin``).
    """

    def __init__(self, sock: socket.socket, spin: float = 0.0):
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self.spin = Spin(spin)

    def recv(self, timeout_ms: int = -1, wait_first: bool = False) -> bytes | None:
        """Bytes from the socket; None if none came within ``timeout_ms``
        (-1: no limit). ``wait_first``: none can be there yet (a reply to a
        request just written), so wait before reading. Raises LaneBroken at
        the end of the stream or on a socket error."""
        if wait_first:
            self._wait(timeout_ms)
        for _ in range(2):
            try:
                data = self._sock.recv(RECV_SIZE)
            except BlockingIOError:
                self._wait(timeout_ms)
                continue
            except OSError as exc:
                raise LaneBroken(f"lane read failed: {exc}") from exc
            if not data:
                raise LaneClosed("lane closed by its peer")
            return data
        return None

    def _wait(self, timeout_ms: int) -> None:
        """Until the socket can be read (bytes, its end, an error) or
        ``timeout_ms`` passed; spinning first while waits have been short."""
        poll = self._poller.poll
        self.spin.wait(poll, 0, poll, timeout_ms)


def open_as_caller(
    sock: socket.socket,
    magic: bytes,
    ranks: tuple[int, int],
    where: str,
    token: auth.Token | None,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> None:
    """The caller's side of the opening exchange on a connected socket, left
    non-blocking; ``where`` is the callee's listening address, which the proofs
    cover. One limit for the whole exchange. Raises AuthenticationError or OSError."""
    deadline = time.monotonic() + timeout

    def left_ms() -> int:
        return max(1, int((deadline - time.monotonic()) * 1000))

    caller_nonce = auth.new_nonce()
    sock.settimeout(timeout)
    sock.sendall(HELLO.pack(magic, ranks[0], caller_nonce))
    sock.setblocking(False)
    callee_rank, callee_nonce, callee_proof = ANSWER.unpack(
        recv_exactly(sock, ANSWER.size, left_ms())
    )
    if callee_rank != ranks[1]:
        raise AuthenticationError(f"{where} belongs to rank {callee_rank}, not rank {ranks[1]}")
    binding = auth.Binding(ranks[0], ranks[1], where, caller_nonce, callee_nonce)
    proof = NO_PROOF
    if token is not None:
        if not token.verify(auth.CALLEE, binding, callee_proof):
            raise AuthenticationError(f"rank {ranks[1]} at {where} did not prove the cluster token")
        proof = token.proof(auth.CALLER, binding)
    sock.settimeout(left_ms() / 1000)
    sock.sendall(proof)
    sock.setblocking(False)
    if recv_exactly(sock, 1, left_ms()) != ACCEPTED:
        raise AuthenticationError(f"rank {ranks[1]} at {where} refused this worker")


def open_as_callee(
    sock: socket.socket, magic: bytes, rank: int, where: str, token: auth.Token | None
) -> int:
    """The callee's side of the opening exchange on a non-blocking socket: the
    caller's rank, once it proved the token (``where``: this end's listening
    address), within one limit for the whole exchange (a peer that has not
    proved itself holds this thread that long at most). Raises
    AuthenticationError, LaneBroken, OSError or struct.error."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT

    def left_ms() -> int:
        return max(1, int((deadline - time.monotonic()) * 1000))

    found, caller_rank, caller_nonce = HELLO.unpack(recv_exactly(sock, HELLO.size, left_ms()))
    if found != magic:
        raise AuthenticationError(f"not an rrpc hello for {where}")
    callee_nonce = auth.new_nonce()
    binding = auth.Binding(caller_rank, rank, where, caller_nonce, callee_nonce)
    proof = token.proof(auth.CALLEE, binding) if token else NO_PROOF
    sock.settimeout(left_ms() / 1000)
    sock.sendall(ANSWER.pack(rank, callee_nonce, proof))
    sock.setblocking(False)
    caller_proof = recv_exactly(sock, auth.PROOF_SIZE, left_ms())
    if token is not None and not token.verify(auth.CALLER, binding, caller_proof):
        sock.setblocking(True)
        sock.sendall(REFUSED)
        raise AuthenticationError(f"rank {caller_rank} did not prove the cluster token")
    sock.setblocking(True)
    sock.sendall(ACCEPTED)
    sock.setblocking(False)
    return caller_rank


def recv_exactly(sock: socket.socket, size: int, timeout_ms: int) -> bytes:
    """Exactly ``size`` bytes of the opening exchange, within ``timeout_ms`` in
    all (however the peer cuts them); raises AuthenticationError past it."""
    deadline = time.monotonic() + timeout_ms / 1000
    data = b""
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except BlockingIOError:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise AuthenticationError("lane handshake timed out") from None
            wait(sock, select.POLLIN, int(left_ms) + 1)
            continue
        except OSError as exc:
            raise LaneBroken(f"lane read failed: {exc}") from exc
        if not chunk:
            raise LaneBroken("lane closed by its peer")
        data += chunk
    return data


class Writer:
    """One direction of a lane's socket: frames written in order, by any thread.

    ``write`` sends what the socket takes at once, from the calling thread;
    the rest (the socket's buffer is full: a large frame, or a peer that reads
    slowly) waits in ``backlog`` for the lane's sender thread, and every later
    frame queues behind it, so frames never interleave. ``wait_for_room``
    blocks while more than ``limit`` bytes wait (the callee's readers call it
    before reading another request).

    Writers combine: a thread that finds another one sending leaves its
    frame in ``_queued`` and goes on, and the sending thread sends it with
    its own (in one ``sendmsg`` when they fit) before it lets go of the
    socket. Sixty-four threads calling over one lane would otherwise queue
    on the socket's lock while its holder, between the ``sendmsg`` that let
    go of the GIL and its return, waits to get the GIL back: a convoy in
    which a caller waited longer for the lock than for its reply.
    ``_combining`` is set while a thread sends that way, under the lock: a
    thread that finds the lock held by anyone else (the sender thread, a
    reader waiting for room) waits for it as before, so no frame is ever
    left queued with nobody about to send it (``_send_queued``)."""

    def __init__(self, sock: socket.socket, name: str, limit: int):
        self._sock = sock
        self._name = name
        self._limit = limit
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queued: collections.deque[list[Any]] = collections.deque()
        self._combining = False
        self._backlog: collections.deque[memoryview] = collections.deque()
        self.backlog_bytes = 0
        self._sender: threading.Thread | None = None
        self.error: BaseException | None = None

    def write(self, pieces: list[Any]) -> None:
        """Send one frame's ``pieces``, or leave them to the thread sending now.
        Raises LaneBroken if the lane broke (then its frames are dropped)."""
        self._queued.append(pieces)
        self._send_queued()

    def _send_queued(self) -> None:
        """Send the queued frames unless a combining thread will. Its own
        frame queued, a thread leaves only when the queue is empty or when it
        saw ``_combining`` set, after the frame was queued: that thread then
        looks at the queue again after it let go of the lock."""
        queued, lock = self._queued, self._lock
        while queued:
            if not lock.acquire(blocking=False):
                if self._combining:
                    return  # the sending thread sends ours with its own
                lock.acquire()
            self._combining = True
            try:
                self._take_queued()
            finally:
                self._combining = False
                lock.release()

    def _take_queued(self) -> None:
        """With the lock held: the queued frames to the socket, in order, what
        it does not take to the backlog."""
        queued = self._queued
        if self.error is not None:
            queued.clear()
            raise LaneBroken(str(self.error))
        while queued:
            pieces = queued.popleft()
            while queued and len(pieces) < IOV_MAX:
                pieces = pieces + queued.popleft()
            if not self._backlog:
                pieces = self._send_now(pieces)
                if not pieces:
                    continue
            for piece in pieces:
                view = memoryview(piece).cast("B")
                if view.nbytes:  # an empty one would never leave the queue (0 bytes sent)
                    self._backlog.append(view)
                    self.backlog_bytes += view.nbytes
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_backlog, name=f"rrpc-lane-send-{self._name}", daemon=True
                )
                self._sender.start()
            self._changed.notify_all()

    def _send_now(self, pieces: list[Any]) -> list[Any]:
        """Send what the socket takes without waiting; the pieces left over."""
        while pieces:
            try:
                sent = self._sock.sendmsg(pieces[:IOV_MAX])
            except BlockingIOError:
                return pieces
            except OSError as exc:
                self.error = LaneBroken(f"lane write failed: {exc}")
                raise self.error from exc
            if len(pieces) == 1 and type(pieces[0]) is bytes and sent == len(pieces[0]):
                return []  # the common small frame, all of it sent
            pieces = advance(pieces, sent)
        return pieces

    def _send_backlog(self) -> None:
        with self._lock:
            while self.error is None:
                if not self._backlog:
                    self._changed.wait()
                    continue
                pieces = list(self._backlog)[:IOV_MAX]
                try:
                    sent = self._sock.sendmsg(pieces)
                except BlockingIOError:
                    self._lock.release()
                    try:
                        wait(self._sock, select.POLLOUT, POLL_SLICE_MS)
                    finally:
                        self._lock.acquire()
                    continue
                except OSError as exc:
                    self.error = LaneBroken(f"lane write failed: {exc}")
                    break
                self.backlog_bytes -= sent
                while sent:
                    head = self._backlog[0]
                    if len(head) <= sent:
                        sent -= len(head)
                        self._backlog.popleft()
                    else:
                        self._backlog[0] = head[sent:]
                        sent = 0
                self._changed.notify_all()
            self._backlog.clear()
            self.backlog_bytes = 0
            self._changed.notify_all()

    def wait_for_room(self) -> bool:
        """Wait while more than ``limit`` bytes wait to go; False if the lane broke."""
        if self.backlog_bytes <= self._limit:
            return self.error is None
        with self._lock:
            while self.backlog_bytes > self._limit and self.error is None:
                self._changed.wait()
            return self.error is None

    def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every frame written went to the socket."""
        with self._lock:
            self._changed.wait_for(lambda: not self._backlog or self.error is not None, timeout)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._changed.notify_all()


def advance(pieces: list[Any], sent: int) -> list[Any]:
    """``pieces`` without their first ``sent`` bytes."""
    index = 0
    while index < len(pieces):
        length = memoryview(pieces[index]).nbytes
        if sent < length:
            if sent:
                return [memoryview(pieces[index]).cast("B")[sent:], *pieces[index + 1 :]]
            return pieces[index:]
        sent -= length
        index += 1
    return []


def shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def goodbye(reason: str) -> list[bytes]:
    """The frame a callee sends before it closes a lane because of ``reason``."""
    text = reason.encode()
    head = Envelope(kind=ERROR, request_id=GOODBYE_ID, payload_size=len(text)).SerializeToString()
    return [wire.HEADER.pack(len(head)) + head + text]


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket (as the kernel
    recorded it when the socket connected: it cannot be forged)."""
    pid, _, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(pid)


def unresponsive(pid: int) -> str | None:
    """Why process ``pid`` of this host cannot answer (stopped, a zombie, gone),
    or None if it is running. A lane's liveness check: on one host, the
    kernel says at once what a keepalive ping would find out after a timeout."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"process {pid} is gone"
    if state in (b"T", b"t"):
        return f"process {pid} is stopped"
    if state in (b"Z", b"X"):
        return f"process {pid} has exited"
    return None
