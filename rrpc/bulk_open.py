"""Opening a bulk socket (``bulk.py``): the port that proves each dialer, and the dial.

A stream's caller dials the callee's bulk port (``dial``) ``count`` times;
on each socket both ends prove the cluster token as a lane's do
(``lane_io.open_as_caller``/``open_as_callee``, bound to the listening
address: ``where``), then the caller names its stream by the random key it
sent in the stream's gRPC metadata (``KEY_METADATA``, ``new_key``) and the
socket's index and count, and the callee hands the socket to that stream's
``bulk.Channel`` (``find``). The port is on the network and a dialer holds a
thread until it proved itself (``HANDSHAKE_TIMEOUT`` at most, for the whole
exchange): at most ``Listener.OPENING`` are proved at once, and one more is
closed unheard. A dial that fails leaves the stream's frames whole.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from rrpc import auth, logs
from rrpc.bulk import MAX_SOCKETS, Channel
from rrpc.lane_io import (
    ACCEPTED,
    HANDSHAKE_TIMEOUT,
    REFUSED,
    open_as_callee,
    open_as_caller,
    recv_exactly,
    shut,
)
from rrpc.messages import AuthenticationError

MAGIC = b"rrpcblk2"
KEY_METADATA = "rrpc-bulk-key"  # the stream's key, in hex, in its gRPC metadata
KEY_SIZE = 16
_NAMING = struct.Struct("<BB")  # after the key: this socket's index, and the count
FIND_WAIT = 5.0  # seconds a dialer's stream has to reach the callee (it dials at once)


def new_key() -> bytes:
    return os.urandom(KEY_SIZE)


def where(host: str, port: int) -> str:
    """A listener's address, as its proofs cover it."""
    return f"bulk:{host}:{port}"


class Listener:
    """This worker's bulk port: proves each dialer, then binds its socket to
    the stream it names (``find(key)``: the ``Channel`` of a stream this
    worker serves, or None). At most ``OPENING`` dialers are proved at once
    (see the module doc)."""

    OPENING = 64

    def __init__(
        self,
        host: str,
        rank: int,
        token: auth.Token | None,
        find: Callable[[int, bytes], Channel | None],
    ):
        self._rank = rank
        self._token = token
        self._find = find
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host.strip("[]"), 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self.where = where(host, self.port)
        self._stopped = False
        self._opening = threading.BoundedSemaphore(self.OPENING)
        self._thread = threading.Thread(
            target=self._accept, name=f"rrpc-bulk-accept-{rank}", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            if not self._opening.acquire(blocking=False):
                logs.event("bulk-refused", "busy", "%s: bulk dialer refused: busy", self._rank)
                sock.close()
                continue
            threading.Thread(
                target=self._open, args=(sock,), name=f"rrpc-bulk-open-{self._rank}", daemon=True
            ).start()

    def _open(self, sock: socket.socket) -> None:
        try:
            self._prove_and_bind(sock)
        finally:
            self._opening.release()

    def _prove_and_bind(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            caller = open_as_callee(sock, MAGIC, self._rank, self.where, self._token)
            naming = recv_exactly(sock, KEY_SIZE + _NAMING.size, int(HANDSHAKE_TIMEOUT * 1000))
            index, count = _NAMING.unpack_from(naming, KEY_SIZE)
            channel = self._find(caller, bytes(naming[:KEY_SIZE]))
            sock.setblocking(True)
            if channel is None:
                sock.sendall(REFUSED)
                raise AuthenticationError(f"rank {caller} named no stream it has open here")
            if not 0 <= index < count <= MAX_SOCKETS:
                sock.sendall(REFUSED)
                raise AuthenticationError(f"rank {caller} named socket {index} of {count}")
            sock.sendall(ACCEPTED)
        except (AuthenticationError, OSError, ConnectionError, struct.error) as exc:
            logs.event("bulk-refused", "bulk", "%s: bulk socket refused: %s", self._rank, exc)
            shut(sock)
            sock.close()
            return
        if not channel.bind(sock, index, count):
            shut(sock)
            sock.close()

    def stop(self) -> None:
        self._stopped = True
        shut(self._sock)
        self._sock.close()


def dial(
    host: str,
    port: int,
    ranks: tuple[int, int],
    token: auth.Token | None,
    key: bytes,
    index: int = 0,
    count: int = 1,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> socket.socket:
    """Dial a peer's bulk port, prove each other the token, name the stream
    (``key``) and which of its ``count`` sockets this is; the socket, bound
    to it on the other end. Raises AuthenticationError or OSError."""
    sock = socket.create_connection((host.strip("[]"), port), timeout=timeout)
    try:
        start = time.monotonic()
        open_as_caller(sock, MAGIC, ranks, where(host, port), token, timeout)
        sock.setblocking(True)
        sock.settimeout(max(0.1, timeout - (time.monotonic() - start)))
        sock.sendall(key + _NAMING.pack(index, count))
        if sock.recv(1) != ACCEPTED:
            raise AuthenticationError(f"rank {ranks[1]}'s bulk port refused the stream")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


__all__ = ["KEY_METADATA", "Listener", "dial", "new_key"]
