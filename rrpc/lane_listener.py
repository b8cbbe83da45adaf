"""The same-host lane, callee's end: this worker's lane socket and the threads serving it.

See ``lane.py`` for the lane's theory of operation. A caller is served
exactly as on a gRPC stream (``transport.Server``): it proves the cluster
token first (the opening exchange in ``lane_io``), then two threads take
turns reading its requests (``turns.TakeTurns``), its requests count
against its bound of requests in flight (``streams.Admission``, shared
with its gRPC streams), and its replies go straight to the socket from the
thread that produced them (``lane_io.Writer``), whose backlog bounds the
replies waiting unsent (``streams.REPLY_BACKLOG``).
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rrpc import auth, logs, streams, turns, wire
from rrpc.lane_io import (
    MAGIC,
    LaneBroken,
    LaneClosed,
    Reader,
    Writer,
    goodbye,
    open_as_callee,
    shut,
)
from rrpc.messages import AuthenticationError

# -- The callee's end -------------------------------------------------------------
RequestHandler = Callable[[wire.Frame, int, Callable[[list[Any]], None], bool], None]


class Listener:
    """This worker's lane socket: accepts callers, and serves each with two
    threads taking turns (as a gRPC stream is served).

    ``on_request(frame, caller_rank, respond, inline)`` is the agent's."""

    def __init__(
        self,
        rank: int,
        on_request: RequestHandler,
        token: auth.Token | None,
        reader: Callable[[int], wire.FrameReader],
        admission: Callable[[int], streams.InFlight],
        unread_replies: streams.UnreadReplies | None = None,
        spin: float = 0.0,
    ):
        self.rank = rank
        self._spin = spin  # lane_io.Reader's, for each caller's socket
        self._on_request = on_request
        self._token = token
        self._new_reader = reader
        self._admission = admission
        self._unread = unread_replies  # see streams.admit_with
        base = os.environ.get("XDG_RUNTIME_DIR") or None
        self.directory = tempfile.mkdtemp(prefix="rrpc-lane-", dir=base)  # mode 0700
        self.path = os.path.join(self.directory, "lane.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(128)
        self._stopped = False
        self._served: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._accept, name=f"rrpc-lane-accept-{rank}", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._stopped:
                    sock.close()
                    return
                self._served.add(sock)
            threading.Thread(
                target=self._serve, args=(sock,), name=f"rrpc-lane-serve-{self.rank}", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            caller_rank = open_as_callee(sock, MAGIC, self.rank, self.path, self._token)
        except (AuthenticationError, LaneBroken, OSError, struct.error) as exc:
            logs.event("lane-refused", "lane", "%s: lane caller refused: %s", self.rank, exc)
            self._drop(sock)
            return
        writer = Writer(sock, f"{self.rank}<-{caller_rank}", limit=streams.REPLY_BACKLOG)

        def respond(pieces: list[Any]) -> None:
            try:
                writer.write(pieces)
            except LaneBroken:
                pass  # the caller is gone; its end reports it

        in_flight = self._admission(caller_rank)

        def on_frame(frame: wire.Frame, inline: bool) -> None:
            weight = streams.weight(frame)  # taken by the reader (admit, below)
            frame.on_consumed = (
                in_flight.give if weight == 1 else functools.partial(in_flight.give, weight)
            )
            self._on_request(frame, caller_rank, respond, inline)

        readers = turns.TakeTurns(
            _packets(sock, writer, self._spin),
            self._new_reader(caller_rank),
            on_frame,
            readable=functools.partial(_readable, sock),
            admit=streams.admit_with(
                in_flight,
                writer.wait_for_room,
                lambda: writer.error,
                None if self._unread is None else functools.partial(self._unread.wait, caller_rank),
            ),
        )
        ended = threading.Lock()  # taken by the reader that ends the lane for its error

        def take_turns() -> None:
            """One of the two readers; the first to find the stream ended by a
            malformed frame (a request over ``max_message_size``) tells the
            caller why and shuts the socket at once. The other reader may be
            running a request inline, for as long as it runs: the caller's
            calls fail now, not after it, and its reply is dropped (as on gRPC)."""
            readers.run()
            error = readers.stream.error
            if error is not None and ended.acquire(blocking=False):
                respond(goodbye(f"{type(error).__name__}: {error}"))
                writer.drain(1.0)
                shut(sock)

        partner = threading.Thread(
            target=take_turns, name=f"rrpc-lane-serve-{self.rank}", daemon=True
        )
        try:
            partner.start()
            take_turns()
            partner.join()
        finally:  # whatever ended it: the caller's calls on it fail now, not at their timeout
            in_flight.wake()
            if self._unread is not None:
                self._unread.forget(caller_rank)
            writer.fail(LaneBroken("lane ended"))
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._served.discard(sock)
        shut(sock)
        sock.close()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            served = list(self._served)
        shut(self._sock)
        self._sock.close()
        for sock in served:
            shut(sock)
        shutil.rmtree(self.directory, ignore_errors=True)


def _readable(sock: socket.socket) -> bool:
    """Whether bytes (or its end) wait on the socket, without reading them."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
    except (ValueError, OSError):  # closed: a reader finds out why
        return True
    return bool(poller.poll(0))


def _packets(sock: socket.socket, writer: Writer, spin: float) -> Iterator[bytes]:
    """The bytes a caller sends, until it closes its end (then StopIteration)."""
    reader = Reader(sock, spin)
    while True:
        try:
            data = reader.recv()
        except LaneClosed:
            return
        except LaneBroken as exc:
            raise streams.StreamBroken(str(exc)) from exc
        if data is not None:
            yield data
