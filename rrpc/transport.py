"""The gRPC carrier: the streams that carry frames between two workers, and the server.

It carries frames and knows nothing of messages. Theory of operation: every
worker runs one gRPC server. To talk to a peer, a worker opens one
bidirectional stream to the peer's server (``Connection``) and keeps it for
its lifetime: requests flow on the stream's request side, their replies
come back on its response side. The server side of that stream
(``Server._exchange``) hands each incoming frame to the agent together with a
``respond`` function that writes onto the same stream.

What does not depend on gRPC is elsewhere: batching into packets, admission
of a peer's requests, the two readers taking turns and the one state of a
stream in ``streams.py``; both ends of the auth handshake in ``auth.py``; the
caller's end of a stream on gRPC's core API in ``grpc_call.py``. This module is
the gRPC carrier: the stream's threads, metadata, status (its options and
TLS credentials: ``grpc_settings.py``).

Rules:
- The stream's metadata carries the caller's rank. When the cluster has a
  token, both ends prove they know it (``auth.py``: a challenge-response, once
  per stream, the token never sent) before either reads a frame of the other:
  the callee reads no request until the caller proved itself, and the caller
  sends no request, and reads no reply, until the callee did. Each end gives
  the other a bounded time to do so (the agent's scheduler times it).
- A stream that breaks reports once, through ``on_close(connection, reason)``
  (possibly before the constructor returns); the agent opens a new one at the
  next call. Every channel is closed explicitly: one left to the garbage
  collector can hang the interpreter's exit in gRPC's finalizer.
- gRPC refuses a message larger than any rrpc sends (``grpc_settings``) from
  its header, before it holds the bytes.
- A stream may have bulk sockets beside it for its large tensor buffers
  (``bulk.py``): its caller dials them, naming the stream by its metadata's key.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from rrpc import (
    auth,
    bulk,
    bulk_open,
    grpc_call,
    grpc_replies,
    grpc_serve,
    grpc_settings,
    logs,
    streams,
    turns,
    wire,
)
from rrpc.messages import AuthenticationError, PeerUnavailableError, mark_transport_thread
from rrpc.outbox import Outbox
from rrpc.scheduler import Handle, Scheduler
from rrpc.streams import (
    AUTHENTICATE,
    CLOSED,
    END,
    EXPIRE,
    PROVEN,
    START,
    StreamState,
)

SERVICE = "rrpc.Worker"
METHOD = f"/{SERVICE}/Exchange"
SERVER_HANDSHAKE_TIMEOUT = 10.0  # seconds a caller has to prove itself


class Connection:
    """This worker's stream to one peer's server: requests out, replies in.

    ``stream`` is its state (``streams.StreamState``): CLOSED once the stream
    has ended, before ``on_close`` runs, with ``stream.error`` saying why when
    it failed."""

    def __init__(
        self,
        address: str,
        metadata: list[tuple[str, str]],
        on_frame: streams.FrameHandler,
        on_close: Callable[[Connection, BaseException | None], None],
        packet_size: int,
        max_message_size: int,
        peer_name: str,
        scheduler: Scheduler,
        credentials: grpc.ChannelCredentials | None = None,
        attach: Callable[[Any], Any] | None = None,
        peer_timeout: float = 8.0,
        auth_token: str | None = None,
        ranks: tuple[int, int] = (-1, -1),
        bulk_port: int = 0,
        bulk_sockets: int = 1,
    ):
        """``auth_token``: prove it to the peer, and require its proof within
        ``peer_timeout`` seconds (``ranks``: this worker's and the peer's,
        which the proofs cover). ``bulk_port``: the peer's bulk port, dialed
        ``bulk_sockets`` times at the first large frame either way (0: none)."""
        self.peer_name = peer_name
        self.stream = StreamState()
        self._bulk: bulk.Channel | None = None
        self._bulk_broke: BaseException | None = None
        if bulk_port:
            key = bulk_open.new_key()
            token = auth.Token(auth_token) if auth_token is not None else None
            host = address.rsplit(":", 1)[0]  # dial(index, count) names the socket
            self._bulk = bulk.Channel(
                peer_name,
                f"rrpc-bulk-{{}}-{peer_name}",
                max_message_size,
                peer_timeout,
                on_broken=self._bulk_broken,
                dial=functools.partial(bulk_open.dial, host, bulk_port, ranks, token, key),
                sockets=bulk_sockets,
            )
            metadata = [*metadata, (bulk_open.KEY_METADATA, key.hex())]
        # No lingering here (``batch_delay`` is the callee's): the calling
        # threads send, and what queues while a send is in flight goes as one.
        self._outbox = Outbox(packet_size, stream=self.stream)
        options = grpc_settings.options(peer_timeout, packet_size, server=False)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._handshake: auth.CallerHandshake | None = None
        self._timer: Handle | None = None
        if auth_token is not None:
            self._handshake = auth.CallerHandshake(
                auth.Token(auth_token), ranks, address, peer_name
            )
            metadata = [*metadata, (auth.NONCE_KEY, self._handshake.nonce.hex())]
            self.stream.move(AUTHENTICATE)
        else:
            self.stream.move(START)
        self._call = grpc_call.Call(self._channel, METHOD, metadata, packet_size)
        self._sender_name = f"rrpc-send-{peer_name}"
        if self._handshake is None:
            self._push()
        else:  # the requests wait for the peer's proof (``_authenticated``)
            self._timer = scheduler.call_later(peer_timeout, self._expire, peer_timeout)
        self._on_frame = on_frame if self._bulk is None else self._bulk.watching(on_frame)
        self._on_close = on_close
        claim = self._bulk.claim if self._bulk is not None else None
        reader = wire.FrameReader(max_message_size, attach, claim)
        self._reader = reader
        # Who reads the replies: a caller waiting for its own, or rrpc-recv.
        self._replies = grpc_replies.Replies(
            self._call, reader, self._on_frame, self._outbox, scheduler.call_at
        )
        self.lead = self._replies.lead
        self.need_reader = self._replies.need_reader
        self.interrupt = self._replies.interrupt
        self._thread = threading.Thread(
            target=self._receive, name=f"rrpc-recv-{peer_name}", daemon=True
        )
        self._thread.start()

    def send(self, pieces: list[Any]) -> None:
        if self._bulk is None:
            self._outbox.put(pieces)
        else:
            self._bulk.send(pieces, self._outbox.put)

    def _bulk_broken(self, error: BaseException) -> None:
        """The bulk socket failed: the stream ends with it."""
        self._bulk_broke = PeerUnavailableError(f"stream to {self.peer_name} broke: {error}")
        self._call.cancel()

    def _push(self) -> None:
        """Requests go out from the threads that queue them (``outbox.Outbox.push``)."""
        self._outbox.push(self._call.send, self._sent_all, self._sender_name)

    def _sent_all(self, error: BaseException | None) -> None:
        """The request side ended: half-close the stream, or (an error) cancel it."""
        if error is None:
            self._call.close_sending()
        else:
            self._call.cancel(f"the request side failed: {error}")

    def _authenticated(self) -> bytes:
        """Once the peer proved itself (raises AuthenticationError): the bytes
        that came after its proof; our proof goes, then the requests queued meanwhile."""
        assert self._handshake is not None
        rest = self._handshake.check(next(self._call.packets(), None))
        if not self.stream.move(PROVEN):  # the time was up first: it is being cancelled
            raise self.stream.error or PeerUnavailableError(f"stream to {self.peer_name} ended")
        assert self._handshake.proof is not None
        self._call.send(self._handshake.proof)
        self._push()
        return rest

    def _expire(self, timeout: float) -> None:
        """On the scheduler's thread: the peer did not prove itself in time."""
        assert self._handshake is not None
        if self.stream.move(EXPIRE, self._handshake.timed_out(timeout)):
            self._call.cancel()

    def _receive(self) -> None:
        mark_transport_thread()
        error: BaseException | None = None
        try:
            self._replies.read(self._authenticated() if self._handshake is not None else b"")
        except AuthenticationError as exc:  # the peer did not prove itself
            error = exc
            self._call.cancel()
        except grpc_call.StreamEnded as exc:
            # Closed already if the handshake timed out (and cancelled the call).
            error = self.stream.error or self._bulk_broke or _stream_error(exc, self.peer_name)
        except Exception as exc:  # a malformed frame from the peer
            error = PeerUnavailableError(f"stream from {self.peer_name} broke: {exc}")
            self._call.cancel()
        finally:
            self._call.drain()  # what the stream still owes, once cancelled
            self._reader.close()
            if self._timer is not None:
                self._timer.cancel()
            if self._bulk is not None:
                self._bulk.close()
        self.stream.move(END, error)  # lets the request side end if it never began
        self._on_close(self, self.stream.error)  # may run before __init__ returned: pass self

    def close(self, timeout: float = 5.0) -> None:
        """End the request side, let the peer finish the response side (for
        ``timeout`` seconds at most), close. A stream the peer did not finish
        in time (frozen, partitioned) is cancelled: its reader ends on its own
        as gRPC delivers the cancellation, not waited for here."""
        self._outbox.end()
        self.need_reader()  # someone takes the end's events
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._call.cancel()
        self._channel.close()

    def release(self) -> None:
        """Free the channel of a stream that has ended (from any thread, its own included)."""
        self._outbox.end()
        self._channel.close()

    def abort(self) -> None:
        self._call.cancel()
        self.need_reader()
        self._outbox.end()
        self._channel.close()


def _abort(served: grpc_serve.Served, code: grpc.StatusCode, details: str) -> None:
    """End a stream refused before its readers started."""
    served.finish(code, details)
    served.drain()


def bracket(host: str) -> str:
    """``host`` as the host part of an address (an IPv6 one in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _end_for_bulk(served: grpc_serve.Served, outbox: Outbox, error: BaseException) -> None:
    """The callee's bulk socket broke: the stream ends with a status that says
    so (a cancel would tell the caller only "cancelled", and the caller's own
    end of the socket may see the break later than the status arrives)."""
    broke = f"the bulk socket beside the stream broke: {error}"
    served.status = (grpc.StatusCode.UNAVAILABLE, broke)
    outbox.end()


def _stream_error(ended: grpc_call.StreamEnded, peer_name: str) -> BaseException:
    code, details = ended.code(), ended.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{peer_name} rejected this worker: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return PeerUnavailableError(f"stream to {peer_name} was cancelled")
    return PeerUnavailableError(f"{peer_name} is unreachable ({code.name}: {details})")


class Server:
    """The gRPC server of this worker: one ``Exchange`` stream per calling peer.

    ``on_frame(frame, peer_rank, respond, inline)`` is called on a reader
    thread of the stream for every request frame, with ``inline`` True when
    that thread may run the request itself (see ``turns.TakeTurns``);
    ``respond(pieces)`` queues a reply frame on the same stream;
    ``attach(peer_rank, descriptor)`` builds a tensor over a shared-memory
    slot that the caller of rank ``peer_rank`` named. ``admission`` bounds
    each calling peer's requests in flight, across all its streams.
    """

    def __init__(
        self,
        host: str,
        on_frame: Callable[[wire.Frame, int, Callable[[list[Any]], None], bool], None],
        auth_token: str | None,
        packet_size: int,
        max_message_size: int,
        scheduler: Scheduler,
        credentials: grpc.ServerCredentials | None = None,
        port: int = 0,
        attach: Callable[[int, Any], Any] | None = None,
        batch_delay: float = 0.0,
        batch_min_open: int = 0,
        rank: int = -1,
        bulk_channel: bool = False,
        peer_timeout: float = 8.0,
        unread_replies: streams.UnreadReplies | None = None,
        lend: Callable[..., Any] | None = None,
        spin: float = 0.0,
    ):
        """``bulk_channel``: accept bulk sockets beside the streams (``bulk_port``);
        ``unread_replies``: see ``streams.admit_with``; ``lend``: ``Outbox.push``'s;
        ``spin``: seconds a stream's reader looks for the next request before it
        sleeps (``spin.Spin``)."""
        self._on_frame = on_frame
        self._lend = lend
        self._attach = attach
        self._unread = unread_replies
        self._token = auth.Token(auth_token) if auth_token is not None else None
        self._scheduler = scheduler
        self._rank = rank
        self._packet_size = packet_size
        self._max_message_size = max_message_size
        self._batching = (batch_delay, batch_min_open)
        self._outboxes: set[Outbox] = set()
        self.admission = streams.Admission(streams.PEER_IN_FLIGHT)
        target = f"{host}:{port}"
        # A thread of its own sets each incoming stream up (``_exchange``).
        self._server = grpc_serve.Listener(
            target,
            METHOD,
            grpc_settings.options(peer_timeout, packet_size, server=True),
            credentials,
            self._exchange,
            packet_size,
            str(rank),
            spin,
        )
        self.port = self._server.port
        if not self.port:
            raise OSError(f"cannot listen on {target}")
        # What peers dial, and what the auth proofs cover.
        self.address = f"{bracket(host)}:{self.port}"
        self._peer_timeout = peer_timeout
        # The bulk sockets' port, and the served streams they may bind to, by key.
        self._bulk_streams: dict[bytes, tuple[int, bulk.Channel]] = {}
        self._bulk_changed = threading.Condition()
        self._bulk_listener: bulk_open.Listener | None = None
        if bulk_channel and credentials is None:  # a bulk socket is not encrypted
            self._bulk_listener = bulk_open.Listener(host, rank, self._token, self._bulk_stream)
        self.bulk_port = self._bulk_listener.port if self._bulk_listener is not None else 0
        self._server.start()

    def _bulk_stream(self, rank: int, key: bytes) -> bulk.Channel | None:
        """The served stream of ``rank`` that ``key`` names. A caller may dial
        as soon as it opened the stream: wait a little for this end to see it."""
        with self._bulk_changed:
            self._bulk_changed.wait_for(lambda: key in self._bulk_streams, bulk_open.FIND_WAIT)
            found = self._bulk_streams.get(key)
        return found[1] if found is not None and found[0] == rank else None

    def _exchange(self, served: grpc_serve.Served) -> None:
        """Serve one caller's stream: the handshake (with a token), then its
        two readers, which take the stream's events from then on (``grpc_serve``).
        A reply goes out from the thread that made it (``outbox.Outbox.push``)."""
        metadata = served.metadata
        try:
            peer_rank = int(metadata.get("rrpc-rank", "-1"))
            if not -1 <= peer_rank < 1 << 63:  # the auth proofs carry it as an int64
                raise ValueError(peer_rank)
        except ValueError:
            self._refuse(served, "refused:rank", "rrpc-rank is not a rank")
            _abort(served, grpc.StatusCode.INVALID_ARGUMENT, "rrpc-rank is not a rank")
            return
        stream = StreamState()
        requests: Iterator[bytes] = served.packets()
        if self._token is not None:
            stream.move(AUTHENTICATE)
            checked = self._authenticate(served, peer_rank, stream)
            if checked is None:
                stream.move(END)
                return  # refused, or the caller went away before it proved itself
            requests = checked
        elif auth.NONCE_KEY in metadata:
            self._refuse(
                served, "refused:no-token", "it requires an auth token, this worker has none"
            )
            _abort(
                served,
                grpc.StatusCode.UNAUTHENTICATED,
                "the callee has no auth token, and the caller requires one",
            )
            return
        else:
            stream.move(START)
        outbox = Outbox(self._packet_size, *self._batching, track_backlog=True, stream=stream)
        in_flight = self.admission.of(peer_rank)
        channel, key = self._bulk_channel(metadata, peer_rank, served, outbox)

        def stream_over() -> None:
            stream.move(END)
            in_flight.wake()
            if self._unread is not None:
                self._unread.forget(peer_rank)
            outbox.end()
            if channel is not None:
                self._bulk_streams.pop(key, None)
                channel.close()

        def finish(error: BaseException | None) -> None:
            """The outbox ended: the stream's status goes (an error: a malformed frame)."""
            self._outboxes.discard(outbox)
            if error is not None:
                self._refuse(
                    served, f"bad-frame:{type(error).__name__}", f"malformed frame: {error}"
                )
                served.status = (grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {error}")
            served.finish(*served.status)

        # A caller that half-closed is no longer read: if it goes away, only this ends it.
        served.on_over(stream_over)
        self._outboxes.add(outbox)
        outbox.push(served.send, finish, f"rrpc-send-{self._rank}<-{peer_rank}", self._lend)
        attach = functools.partial(self._attach, peer_rank) if self._attach else None
        reader = wire.FrameReader(
            self._max_message_size, attach, channel.claim if channel is not None else None
        )
        respond: Callable[[list[Any]], Any] = outbox.put
        if channel is not None:
            respond = functools.partial(channel.send, put=outbox.put)

        def on_frame(frame: wire.Frame, inline: bool) -> None:
            weight = streams.weight(frame)  # taken by the reader (admit, below)
            frame.on_consumed = (
                in_flight.give if weight == 1 else functools.partial(in_flight.give, weight)
            )
            self._on_frame(frame, peer_rank, respond, inline)

        readers = turns.TakeTurns(
            requests,
            reader,
            on_frame,
            streams.admit_with(
                in_flight,
                outbox.wait_for_room,
                lambda: stream.state is CLOSED,
                None if self._unread is None else functools.partial(self._unread.wait, peer_rank),
            ),
            outbox,
        )
        for turn in range(2):
            threading.Thread(
                target=readers.run, name=f"rrpc-serve-{peer_rank}-{turn}", daemon=True
            ).start()

    def _bulk_channel(
        self,
        metadata: dict[str, Any],
        peer_rank: int,
        served: grpc_serve.Served,
        outbox: Outbox,
    ) -> tuple[bulk.Channel | None, bytes]:
        """The bulk end of a stream whose caller may dial one (its key in the
        metadata), registered for ``bulk_open.Listener`` to bind; (None, b"") if not."""
        if self._bulk_listener is None:
            return None, b""
        try:
            key = bytes.fromhex(metadata.get(bulk_open.KEY_METADATA, ""))
        except ValueError:
            return None, b""
        if len(key) != bulk_open.KEY_SIZE or key in self._bulk_streams:
            return None, b""
        channel = bulk.Channel(
            f"rank {peer_rank}",
            f"rrpc-bulk-{{}}-{self._rank}<-{peer_rank}",
            self._max_message_size,
            self._peer_timeout,
            on_broken=functools.partial(_end_for_bulk, served, outbox),
            backlog=outbox,
        )
        with self._bulk_changed:
            self._bulk_streams[key] = (peer_rank, channel)
            self._bulk_changed.notify_all()
        return channel, key

    def _authenticate(
        self, served: grpc_serve.Served, peer_rank: int, stream: StreamState
    ) -> Iterator[bytes] | None:
        """The callee's side of the handshake (``auth.py``): sends this
        worker's handshake packet, returns the requests once the caller proved
        itself; None if it went away first or failed (the stream then ends,
        before any frame is read)."""
        assert self._token is not None
        try:
            handshake = auth.CalleeHandshake(
                self._token,
                peer_rank,
                self._rank,
                self.address,
                served.metadata.get(auth.NONCE_KEY, ""),
            )
        except auth.Refused as refused:
            self._refuse(served, refused.kind, str(refused))
            _abort(served, grpc.StatusCode.UNAUTHENTICATED, auth.REFUSED)
            return None
        requests = served.packets()
        served.send(handshake.frame)
        # A caller that never answers holds this thread no longer than this.
        timeout = SERVER_HANDSHAKE_TIMEOUT
        timer = self._scheduler.call_later(timeout, self._expire, stream, served, timeout)
        try:
            first = next(requests)
        except Exception:  # the caller went away (or the timer cancelled the stream)
            return None
        finally:
            timer.cancel()
        try:
            rest = handshake.check(first)
        except auth.Refused as refused:
            self._refuse(served, refused.kind, str(refused))
            _abort(served, grpc.StatusCode.UNAUTHENTICATED, auth.REFUSED)
            return None
        del first
        if not stream.move(PROVEN):  # the time was up first: the timer cancelled the stream
            served.drain()
            return None
        return itertools.chain((rest,), requests) if rest else requests

    def _expire(self, stream: StreamState, served: grpc_serve.Served, timeout: float) -> None:
        """On the scheduler's thread: a caller did not prove itself in time."""
        if stream.move(EXPIRE):
            # Logged before the cancel, which the caller sees at once.
            self._refuse(served, "refused:timeout", f"no auth handshake within {timeout:g} s")
            served.cancel()

    def _refuse(self, served: grpc_serve.Served, kind: str, reason: str) -> None:
        """Log a stream this worker refused or ended (``logs.event``: one line
        per kind of event and peer host per interval, never one per stream;
        ``kind`` tells reasons apart, so a flood of one hides no other)."""
        peer = served.peer()  # e.g. "ipv4:127.0.0.1:54321"
        host = peer.rsplit(":", 1)[0]  # each stream comes from a new port
        logs.event(
            kind, host, "%s: stream from %s (claims rank %s) ended: %s",
            self.address, peer, served.metadata.get("rrpc-rank", "?"), reason,
        )  # fmt: skip

    def stop(self, grace: float | None = 1.0) -> None:
        if self._bulk_listener is not None:
            self._bulk_listener.stop()
        for outbox in list(self._outboxes):
            outbox.stream.move(END)
            outbox.end()
        self._server.stop(grace)
