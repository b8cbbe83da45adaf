"""The callee's end of gRPC streams on grpcio's core API: a stream's readers take its events.

grpcio's server polls one completion queue on one thread of its own, which
hands every packet it receives to the thread reading that stream, and wakes
the thread that sent a packet once the send completes: two thread hand-offs
per request. Here each stream has a completion queue of its own
(``Served``), and whoever reads the stream takes its events:

- **Reading.** ``packets()`` is the stream's requests, for the readers that
  take turns on it (``turns.TakeTurns``, one at a time): the thread that
  asks for the next packet polls the stream's queue itself, so the thread
  that reads a request is the one gRPC's core woke, and it may run the
  request and send its reply without another thread.
- **Sending.** As the caller's end (``grpc_call.Sending``): a send starts on
  the thread that has it, one at a time. A send's completion is taken by
  whoever polls: a reader waiting for the next request; or, when no thread
  polls (the readers run a request, or wait for room), the sending thread,
  for as long as its packets wait (``_progress``). One thread polls at a
  time (``_polling``); a request packet that a sender meets is kept for the
  readers (``_kept``), and reading the next one waits until they took it.
- **The end.** The caller half-closes (``packets()`` ends) or the stream
  breaks (``packets()`` raises ``StreamEnded``); ``finish(code, details)``
  sends the status after the replies that wait. A thread polls what the
  stream still owes after its readers stopped (``rrpc-drain``), and
  ``on_over`` callbacks run once the stream is over.

``Listener`` accepts streams: the port, a thread that takes each new one
(``rrpc-accept``) and hands it on, and the server's stop.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc._cython import cygrpc

from rrpc.grpc_call import _RECEIVE, _SEND, WAITING_LIMIT, Sending, StreamEnded
from rrpc.spin import Spin

_CLOSED, _METADATA, _NEW = "closed", "metadata", "new"
_NO_PACKET = object()
_HALF_CLOSED = object()
POLL_SLICE = 0.05  # seconds a sender polls at a time while its packets wait


class Served(Sending):
    """One incoming stream: its call on gRPC's core and its own completion queue."""

    def __init__(
        self, event: Any, queue: cygrpc.CompletionQueue, message_size: int, spin: float = 0.0
    ):
        super().__init__(message_size)
        self._call = event.call
        self._queue = queue
        self.metadata: dict[str, str] = dict(event.invocation_metadata)
        # The status the stream ends with (``finish(*status)``), unless OK.
        self.status: tuple[grpc.StatusCode, str] = (grpc.StatusCode.OK, "")
        self._polling = threading.Lock()  # one thread polls the queue at a time
        self._kept: Any = _NO_PACKET  # a packet polled by a sender, for the readers
        self._receiving = True  # a receive is started and its packet not taken
        self._callbacks: list[Callable[[], Any]] = []
        self._done = False  # the stream is over and its callbacks ran
        self._spin = Spin(spin)  # a reader waiting for the next request looks before it sleeps
        self._operate((cygrpc.ReceiveCloseOnServerOperation(0),), _CLOSED)
        self._operate((cygrpc.SendInitialMetadataOperation((), 0),), _METADATA)
        self._operate((cygrpc.ReceiveMessageOperation(0),), _RECEIVE)
        self._events = self._packets()

    def peer(self) -> str:
        peer = self._call.peer()
        return peer.decode() if isinstance(peer, bytes) else str(peer)

    def _operate(self, operations: tuple, tag: str) -> bool:
        self._call.start_server_batch(operations, tag)
        self._due += 1
        return True

    # -- sending: whoever sends makes sure someone polls
    def send(self, packet: bytes) -> None:
        super().send(packet)
        if self._sending and self._waiting:
            self._progress()

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> None:
        """End the stream with ``code`` after the replies that wait."""
        status = cygrpc.SendStatusFromServerOperation((), code.value[0], details, 0)
        self.close((status,))
        self._progress()

    def cancel(self) -> None:
        """End the stream now (the caller sees CANCELLED)."""
        with self._lock:
            if not self._over:
                self._call.cancel()

    def on_over(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the stream is over (at once if it is)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    def _stuck(self) -> None:
        """A sender waits for room: it polls if no one does (``_lock`` held)."""
        self._lock.release()
        try:
            self._progress()
        finally:
            self._lock.acquire()
        if self._waiting_bytes >= WAITING_LIMIT and not self._over:
            self._room.wait(POLL_SLICE)

    def _progress(self) -> None:
        """Poll while this stream's packets wait and no other thread polls."""
        while self._sending and (self._waiting or self._closing) and not self._over:
            if not self._polling.acquire(blocking=False):
                return  # the thread polling takes the completions
            try:
                self._poll(POLL_SLICE)
            finally:
                self._polling.release()

    # -- reading
    def packets(self) -> Iterator[bytes]:
        """The caller's packets, in order; ends when it half-closed, raises
        ``StreamEnded`` when the stream broke. One reader at a time."""
        return self._events

    def _packets(self) -> Iterator[bytes]:
        while True:
            with self._polling:
                while self._kept is _NO_PACKET:
                    if not self._receiving:
                        self._kept = _HALF_CLOSED
                        break
                    self._poll(None, spin=True)
                packet, self._kept = self._kept, _NO_PACKET
            if packet is _HALF_CLOSED:
                break
            yield packet
            del packet
            with self._lock:  # the next one, now that this one is handled
                if self._over:
                    break
                self._receiving = True
                self._operate((cygrpc.ReceiveMessageOperation(0),), _RECEIVE)
        self.drain()
        if self._broken or self._cancelled:
            raise StreamEnded(grpc.StatusCode.CANCELLED, "the caller went away")

    def drain(self) -> None:
        """Its readers stopped (or never started): a thread takes the events
        the stream still owes, until it is over."""
        threading.Thread(target=self._drain, name="rrpc-drain", daemon=True).start()

    def _drain(self) -> None:
        """Take the events the stream still owes once its readers stopped."""
        with self._polling:
            while self._due:
                self._poll(None)

    def _poll(self, timeout: float | None, spin: bool = False) -> None:
        """Take one event, or none within ``timeout`` seconds (``_polling``
        held); ``spin``: looking for it a while first (``spin.Spin``)."""
        if not self._due:
            return
        if spin and timeout is None:
            event = self._spin.wait(self._look, 0.0, self._queue.poll, None)
        else:
            deadline = None if timeout is None else time.time() + timeout
            event = self._queue.poll(deadline)
        if event.completion_type != cygrpc.CompletionType.operation_complete:
            return
        over = False
        with self._lock:
            self._due -= 1
        tag = event.tag  # _METADATA: nothing to do
        if tag is _RECEIVE:
            self._receiving = False
            if not event.success:  # the stream broke (a clean half-close is None)
                self._broken = True
            else:
                message = event.batch_operations[0].message()
                if message is not None:
                    self._kept = message
        elif tag is _SEND:
            self._sent()
        elif tag is _CLOSED:
            with self._lock:
                self._cancelled = event.batch_operations[0].cancelled()
                self._end()
                over = True
        if over:
            self._over_now()

    def _look(self, deadline: float) -> Any:
        """An event if one is there by ``deadline``, else None; 0.0 returns at
        once (a deadline of now would wait: gRPC's core rounds it up to the
        next millisecond)."""
        event = self._queue.poll(deadline)
        return None if event.completion_type == cygrpc.CompletionType.queue_timeout else event

    _cancelled = False  # the stream ended cancelled (its end said so)
    _broken = False  # a receive failed: the stream broke

    def _over_now(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
            self._done = True
        for callback in callbacks:
            callback()


class Listener:
    """A gRPC server for one method: every stream opened on it goes to
    ``on_stream(served)`` on a thread of its own (it may block: a handshake)."""

    def __init__(
        self,
        target: str,
        method: str,
        options: list[tuple[str, Any]],
        credentials: grpc.ServerCredentials | None,
        on_stream: Callable[[Served], Any],
        message_size: int,
        name: str,
        spin: float = 0.0,
    ):
        """``spin``: seconds a stream's reader looks for the next request before it sleeps."""
        self._method = method.encode()
        self._spin = spin
        self._on_stream = on_stream
        self._message_size = message_size
        self._name = name
        self._queue = cygrpc.CompletionQueue()
        self._server = cygrpc.Server(tuple(options), False)
        self._server.register_completion_queue(self._queue)
        if credentials is None:
            self.port = self._server.add_http2_port(target.encode())
        else:
            self.port = self._server.add_http2_port(target.encode(), credentials._credentials)
        self._count = itertools.count()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._accept, name=f"rrpc-accept-{name}", daemon=True
        )

    def start(self) -> None:
        self._server.start()
        self._request()
        self._thread.start()

    def _request(self) -> None:
        queue = cygrpc.CompletionQueue()
        self._server.request_call(queue, self._queue, (_NEW, queue))

    def _accept(self) -> None:
        while True:
            event = self._queue.poll()
            if event.completion_type != cygrpc.CompletionType.operation_complete:
                continue
            if event.tag is _CLOSED:  # the server's shutdown completed
                break
            _, queue = event.tag
            if not event.success:  # the server is shutting down
                continue
            if not self._stopped.is_set():
                self._request()
            served = Served(event, queue, self._message_size, self._spin)
            if event.call_details.method != self._method:
                served.finish(grpc.StatusCode.UNIMPLEMENTED, "no such method")
                served.drain()
                continue
            threading.Thread(
                target=self._on_stream,
                args=(served,),
                name=f"rrpc-stream_{next(self._count)}",
                daemon=True,
            ).start()
        self._stopped.set()

    def stop(self, grace: float | None) -> None:
        """Stop taking streams; cancel those still open after ``grace`` seconds."""
        self._stopped.set()
        self._server.shutdown(self._queue, _CLOSED)
        if grace:  # the open streams may finish meanwhile
            self._thread.join(grace)
        self._server.cancel_all_calls()
        self._thread.join(5.0)
