"""gRPC streams that move frames between two workers. Knows nothing of messages.

Theory of operation: every worker runs one gRPC server. To talk to a peer, a
worker opens one bidirectional stream to the peer's server (``Connection``)
and keeps it for its lifetime: requests flow on the stream's request side,
their replies come back on its response side. The server side of that stream
(``Server._exchange``) hands each incoming frame to the agent together with a
``respond`` function that writes onto the same stream. Two threads take turns
reading an incoming stream (``_TakeTurns``): the one that read a lone request
passes the turn on and may run the request itself, sparing the hand-off to a
pool thread.

Each direction of a stream is a byte stream of frames cut into packets
(``codec.packets``): a sender thread takes everything queued at the moment it
wakes and sends it as one packet, so small messages batch themselves under
load and a large one flows in bounded chunks under gRPC's flow control. When
many exchanges are open on the stream, the sender also lingers a fraction of a
millisecond before cutting a packet (``Outbox``): each gRPC message costs
~100 µs of Python per side here, so packets of 10-40 frames instead of 2-3
halve the CPU per call under load, while a lone call never waits.

Rules:
- The stream's metadata carries the caller's rank. When the cluster has a
  token, both ends prove they know it (``auth.py``: a challenge-response, once
  per stream, the token never sent) before either reads a frame of the other:
  the callee reads no request until the caller proved itself, and the caller
  sends no request, and reads no reply, until the callee did.
- A stream that breaks reports once, through ``on_close(connection, reason)``
  (possibly before the constructor returns); the agent opens a new one at the
  next call. Every channel is closed explicitly: one left to the garbage
  collector can hang the interpreter's exit in gRPC's finalizer.
- No frame stays referenced while the next packet is awaited: a received
  tensor may hold a peer's shared-memory slot until its last reference goes.
- One calling peer cannot starve the others (``_InFlight``): its requests
  read and waiting to be run are bounded (``PEER_IN_FLIGHT``, across all its
  streams); at the bound its streams' readers stop reading, gRPC's flow
  control fills and the peer's sends wait, while other peers' requests go
  on. A stream that ends drops its reader's partial frame at once.
- grpcio only sends ``bytes``: the one copy on the way out is the ``join``
  that builds a packet, straight from the tensors' memory.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent import futures
from typing import Any

import grpc

from rrpc import auth, codec, logs
from rrpc.futures import mark_transport_thread
from rrpc.messages import AuthenticationError, PeerUnavailableError

SERVICE = "rrpc.Worker"
METHOD = f"/{SERVICE}/Exchange"
_CLOSE = object()  # queued to end a stream's sending side
SERVER_HANDSHAKE_TIMEOUT = 10.0  # seconds a caller has to prove itself
_REFUSED = "wrong or missing auth token"


# The largest gRPC message a worker accepts, whatever its chunk_size below
# this: rrpc cuts frames into packets of chunk_size (2 MiB by default), so a
# bigger message is not rrpc's, and gRPC refuses it from its 5-byte header
# (RESOURCE_EXHAUSTED), before it holds the bytes. A worker with a chunk_size
# above it needs the same chunk_size on its peers.
MIN_PACKET_LIMIT = 64 << 20


def packet_limit(packet_size: int) -> int:
    return max(packet_size, MIN_PACKET_LIMIT)


def _channel_options(peer_timeout: float, packet_size: int) -> list[tuple[str, int]]:
    """A frozen or cut-off peer (its socket still open) is noticed within
    ``peer_timeout`` seconds: a keepalive ping every half of it, and the
    stream fails when a ping goes unanswered for the other half."""
    half_ms = max(500, int(peer_timeout * 500))
    return [
        # Our packets are bounded by chunk_size; gRPC's own limits must not bite.
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", packet_limit(packet_size)),
        ("grpc.keepalive_time_ms", half_ms),
        ("grpc.keepalive_timeout_ms", half_ms),
        ("grpc.http2.ping_timeout_ms", half_ms),  # left at its default, keepalive never fires
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Each Connection gets its own TCP connection, not one shared by all channels.
        ("grpc.use_local_subchannel_pool", 1),
    ]


_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
    # Accept the callers' keepalive pings (as often as every 0.5 s) without a GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]

FrameHandler = Callable[[codec.Frame], None]

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


def _weight(frame: codec.Frame) -> int:
    return 1 + len(frame.buffers) // BUFFERS_PER_REQUEST


class _InFlight:
    """The requests of one calling peer waiting to be run on this worker:
    from the moment its stream's reader hands one on until a pool thread has
    decoded it (``Frame.on_consumed``), i.e. its frame waits in the pool's
    queue. Requests that run are bounded by the pool; one that waits for an
    RPC of its own does not count here either (nor for the pool), so nested
    calls from one peer never wait on each other here.

    The reader takes a frame's weight before it hands the request on, and
    waits while the peer is at ``limit``: reading stops, gRPC's flow control
    pushes back on the peer, and what it has already sent is served. A frame
    heavier than the limit goes through alone, once nothing else of the
    peer's is waiting."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0
        # Reentrant: a frame may be freed by a garbage collection that runs
        # while this thread holds the lock.
        self._changed = threading.Condition(threading.RLock())

    def take(self, weight: int, ended: Callable[[], bool]) -> bool:
        """Take ``weight``, waiting for requests to be taken up if need be;
        False if the stream ``ended`` meanwhile (nobody is left to answer)."""
        with self._changed:
            while self.count and self.count + weight > self.limit:
                if ended():
                    return False
                self._changed.wait()
            self.count += weight
        return True

    def give(self, weight: int = 1) -> None:
        with self._changed:
            self.count -= weight
            self._changed.notify_all()

    def wake(self) -> None:
        """A stream ended: its reader may be waiting in ``take``."""
        with self._changed:
            self._changed.notify_all()


class Outbox:
    """One direction of a stream: the frames waiting to go, and how many
    exchanges are open on it (requests without their reply yet).

    ``backlog`` (bytes put and not yet handed to gRPC) is kept only when
    ``track_backlog``: the server's reply side, whose readers wait in
    ``wait_for_room`` while it is over ``REPLY_BACKLOG``.

    Under load the sender lingers ``batch_delay`` seconds before cutting a
    packet, so that one gRPC message carries many frames: gRPC's per-message
    cost in Python (~100 µs per side here) would otherwise dominate. It
    lingers only while at least ``batch_min_open`` exchanges are open — a
    lone call never waits. The counts are advisory: they steer batching only.
    """

    def __init__(
        self,
        packet_size: int,
        batch_delay: float = 0.0,
        batch_min_open: int = 0,
        track_backlog: bool = False,
    ):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.packet_size = packet_size
        self.batch_delay = batch_delay
        self.batch_min_open = batch_min_open
        self.sleep = time.sleep  # tests replace it to act during the linger
        # Every frame is half an exchange (a request or its reply), so the
        # open exchanges are the difference between frames sent and received.
        # Frames are sent from many threads (an atomic itertools.count) and
        # received by the stream's reader alone.
        self._sends = itertools.count(1)
        self._sent = 0
        self.received = 0
        self._closing = False  # end once every exchange is answered (end_when_answered)
        self._closing_lock = threading.Lock()
        self.backlog = 0
        self._room: threading.Condition | None = threading.Condition() if track_backlog else None
        self._over = False  # the stream ended: nobody waits for room any more

    def open_exchanges(self) -> int:
        return abs(self._sent - self.received)

    def put(self, pieces: list[Any]) -> None:
        """Queue one frame's pieces, from any thread."""
        self._sent = next(self._sends)
        if self._room is not None:
            size = sum(map(len, pieces))
            with self._room:
                self.backlog += size
        self.queue.put(pieces)
        if self._closing:
            self._end_if_answered()

    def end_when_answered(self) -> None:
        """The other side sent its last frame: end the stream once every
        exchange open on it is answered (a caller that half-closed its side
        still gets the replies to what it sent)."""
        self._closing = True
        self._end_if_answered()

    def _end_if_answered(self) -> None:
        with self._closing_lock:
            if self._closing and self.open_exchanges() == 0:
                self._closing = False
                self.queue.put(_CLOSE)

    def end(self, error: BaseException | None = None) -> None:
        """End the stream after what is queued; with ``error``, end it failed."""
        if error is not None:
            self.queue.put(error)
        self.queue.put(_CLOSE)
        if self._room is not None:
            with self._room:
                self._over = True
                self._room.notify_all()

    def wait_for_room(self) -> bool:
        """Wait while more than ``REPLY_BACKLOG`` bytes wait to go; False if
        the stream ended meanwhile."""
        room = self._room
        if room is None or self.backlog <= REPLY_BACKLOG:
            return not self._over
        with room:
            while self.backlog > REPLY_BACKLOG and not self._over:
                room.wait()
            return not self._over

    def _sent_bytes(self, size: int) -> None:
        assert self._room is not None
        with self._room:
            self.backlog -= size
            if self.backlog <= REPLY_BACKLOG:
                self._room.notify_all()

    def packets(self) -> Iterator[bytes]:
        """Packets of the queued frames, until the stream ends."""
        while True:
            batch: list[list[Any]] = []
            end = self._drain(batch, block=True)
            if end is None and self.batch_delay and self.open_exchanges() >= self.batch_min_open:
                self.sleep(self.batch_delay)  # asleep, not waiting: puts wake nobody
                end = self._drain(batch, block=False)
            if batch and self._room is not None:
                for packet in codec.packets(itertools.chain.from_iterable(batch), self.packet_size):
                    yield packet
                    self._sent_bytes(len(packet))  # gRPC took it (flow control let it go)
            elif batch:
                yield from codec.packets(itertools.chain.from_iterable(batch), self.packet_size)
            if isinstance(end, BaseException):
                raise end
            if end is _CLOSE:
                return

    def _drain(self, batch: list, block: bool) -> Any:
        """Move queued frames into ``batch`` (waiting for the first one if
        ``block``) up to an end marker, which it returns (None: no end yet)."""
        while True:
            try:
                item = self.queue.get() if block and not batch else self.queue.get_nowait()
            except queue.Empty:
                return None
            if item is _CLOSE or isinstance(item, BaseException):
                return item
            batch.append(item)


def _read_frames(
    packets: Iterator[bytes], reader: codec.FrameReader, on_frame: FrameHandler, outbox: Outbox
) -> None:
    # No frame may stay referenced here while the next packet is awaited: a
    # received tensor's shared-memory slot is freed with its last reference.
    for packet in packets:
        frames = reader.feed(packet)
        del packet
        for frame in _taken(frames):
            outbox.received += 1
            on_frame(frame)
        frame = frames = None  # type: ignore[assignment]


def _taken(frames: list[codec.Frame]) -> Iterator[codec.Frame]:
    """Each frame in order, its slot cleared as it is handed out (linear time;
    ``pop(0)`` made a packet of N frames cost N²), so none stays referenced."""
    for index, frame in enumerate(frames):
        frames[index] = None  # type: ignore[call-overload]
        yield frame
        del frame


def _next_frame(frames: Iterator[codec.Frame]) -> tuple[codec.Frame | None, Exception | None]:
    """The next frame of a packet (None at its end), or why it is malformed."""
    try:
        return next(frames, None), None
    except Exception as exc:
        return None, exc


class _TakeTurns:
    """Two threads take turns reading one incoming stream.

    The thread that read a request hands the turn to the other, if that one is
    free, and runs the request itself (``inline``): a lone call then goes from
    the socket to its function with no thread hand-off, which is ~50 µs here.
    Other requests (a busy partner, all but the last frame of a packet) go to
    the agent's pool, so reading never waits for a request to finish and a
    request that blocks stalls nothing.

    ``admit(frame)`` runs before each request is handed on, with the turn
    held, so requests start in the order they came: it may block (the peer
    is at its bound of requests in flight, which stops reading) and returns
    False if the stream ended meanwhile.
    """

    def __init__(
        self,
        packets: Iterator[bytes],
        reader: codec.FrameReader,
        outbox: Outbox,
        on_frame: Callable[[codec.Frame, bool], None],
        admit: Callable[[codec.Frame], bool] | None = None,
    ):
        self._packets = packets
        self._reader = reader
        self._outbox = outbox
        self._on_frame = on_frame
        self._admit = admit or (lambda frame: True)
        self._turn = threading.Lock()  # held by the thread that reads
        self._guard = threading.Lock()
        self._waiting = 0  # threads waiting for the turn
        self._ended = False

    def run(self) -> None:
        mark_transport_thread()
        while True:
            with self._guard:
                self._waiting += 1
            self._turn.acquire()
            with self._guard:
                self._waiting -= 1
            if self._ended:
                self._turn.release()
                return
            try:
                packet = next(self._packets)
            except StopIteration:  # the caller half-closed: answer what it sent, then end
                self._ended = True
                self._reader.close()
                self._outbox.end_when_answered()
                self._turn.release()
                return
            except grpc.RpcError:
                return self._end(None)  # the caller went away; its side reports it
            # Frames are decoded one at a time, each looking one ahead (only
            # the packet's last may run inline).
            frames = self._reader.frames_in(packet)
            del packet
            frame, error = _next_frame(frames)
            while frame is not None:
                following, error = _next_frame(frames)
                self._outbox.received += 1
                if not self._admit(frame):
                    return self._end(None)  # the caller went away while we waited
                if following is not None or error is not None:
                    self._on_frame(frame, False)
                    frame = following
                    continue
                with self._guard:
                    inline = self._waiting > 0
                self._turn.release()
                self._on_frame(frame, inline)
                # Nothing stays referenced while waiting: a received tensor's
                # shared-memory slot is freed with its last reference.
                del frame
                break
            else:
                if error is not None:  # a malformed frame: end this stream, keep serving others
                    return self._end(error)
                self._turn.release()

    def _end(self, error: BaseException | None) -> None:
        self._ended = True
        self._reader.close()
        self._outbox.end(error)
        self._turn.release()


class _CallerHandshake:
    """The caller's side of the handshake (``auth.py``) on one stream."""

    def __init__(self, token: auth.Token, ranks: tuple[int, int], address: str, peer_name: str):
        self.nonce = auth.new_nonce()
        self.expired = False  # the peer did not prove itself in time
        self._token = token
        self._ranks = ranks
        self._address = address
        self._peer_name = peer_name
        self._proof: bytes | None = None  # our handshake packet, once the peer proved itself
        self._done = threading.Event()
        self._timer: threading.Timer | None = None
        self._timeout = 0.0

    def requests(self, packets: Iterator[bytes]) -> Iterator[bytes]:
        """The request side: nothing until the peer proved itself, then our
        proof and the requests queued meanwhile."""
        self._done.wait()
        if self._proof is None:
            return  # the peer failed; the stream is being cancelled
        yield self._proof
        yield from packets

    def start_timer(self, timeout: float, cancel: Callable[[], Any]) -> None:
        def expire() -> None:
            if not self._done.is_set():
                self.expired = True
                cancel()

        self._timeout = timeout
        self._timer = threading.Timer(timeout, expire)
        self._timer.daemon = True
        self._timer.start()

    def check(self, packets: Iterator[bytes]) -> Iterator[bytes]:
        """Read the peer's handshake from the response side and check it;
        return the rest of the response side. Raises AuthenticationError."""
        peer = self._peer_name
        first = next(packets, None)
        if first is None:
            raise AuthenticationError(f"{peer} ended the stream before it authenticated")
        try:
            handshake, rest = codec.read_handshake(first)
        except codec.ProtocolError as exc:
            raise AuthenticationError(
                f"{peer} at {self._address} did not authenticate ({exc}): it does not know "
                "the auth token, or it is not the worker of that name"
            ) from None
        if len(handshake.nonce) != auth.NONCE_SIZE:
            raise AuthenticationError(f"{peer} sent an auth handshake without a valid nonce")
        binding = auth.Binding(*self._ranks, self._address, self.nonce, handshake.nonce)
        if not self._token.verify(auth.CALLEE, binding, handshake.proof):
            raise AuthenticationError(
                f"{peer} at {self._address} failed to prove it knows the auth token: its "
                "token differs from this worker's, or it is not the worker of that name"
            )
        self._proof = codec.handshake_frame(b"", self._token.proof(auth.CALLER, binding))
        self.finish()
        return itertools.chain((rest,), packets) if rest else packets

    def timed_out(self) -> AuthenticationError:
        return AuthenticationError(
            f"{self._peer_name} at {self._address} did not authenticate within {self._timeout:g} s"
        )

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._done.set()


class Connection:
    """This worker's stream to one peer's server: requests out, replies in."""

    def __init__(
        self,
        address: str,
        metadata: list[tuple[str, str]],
        on_frame: FrameHandler,
        on_close: Callable[[Connection, BaseException | None], None],
        packet_size: int,
        max_message_size: int,
        peer_name: str,
        credentials: grpc.ChannelCredentials | None = None,
        attach: Callable[[Any], Any] | None = None,
        batch_delay: float = 0.0,
        batch_min_open: int = 0,
        peer_timeout: float = 8.0,
        auth_token: str | None = None,
        ranks: tuple[int, int] = (-1, -1),
    ):
        """``auth_token``: prove it to the peer, and require its proof
        (``ranks``: this worker's and the peer's, which the proofs cover)."""
        self.peer_name = peer_name
        self.closed = False  # set once the stream has ended, before on_close runs
        self.error: BaseException | None = None  # why it ended, when it failed
        self._outbox = Outbox(packet_size, batch_delay, batch_min_open)
        options = _channel_options(peer_timeout, packet_size)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        stream = self._channel.stream_stream(METHOD)
        requests = self._outbox.packets()
        self._auth: _CallerHandshake | None = None
        if auth_token is not None:
            self._auth = _CallerHandshake(auth.Token(auth_token), ranks, address, peer_name)
            metadata = [*metadata, (auth.NONCE_KEY, self._auth.nonce.hex())]
            requests = self._auth.requests(requests)
        self._call = stream(requests, metadata=metadata)
        if self._auth is not None:
            self._auth.start_timer(peer_timeout, self._call.cancel)
        self._on_frame = on_frame
        self._on_close = on_close
        self._reader = codec.FrameReader(max_message_size, attach)
        self._thread = threading.Thread(
            target=self._receive, name=f"rrpc-recv-{peer_name}", daemon=True
        )
        self._thread.start()

    def send(self, pieces: list[Any]) -> None:
        self._outbox.put(pieces)

    def _receive(self) -> None:
        mark_transport_thread()
        error: BaseException | None = None
        try:
            packets: Iterator[bytes] = self._call
            if self._auth is not None:
                packets = self._auth.check(packets)
            _read_frames(packets, self._reader, self._on_frame, self._outbox)
        except AuthenticationError as exc:  # the peer did not prove itself
            error = exc
            self._call.cancel()
        except grpc.RpcError as exc:
            if self._auth is not None and self._auth.expired:
                error = self._auth.timed_out()
            else:
                error = _stream_error(exc, self.peer_name)
        except Exception as exc:  # a malformed frame from the peer
            error = PeerUnavailableError(f"stream from {self.peer_name} broke: {exc}")
            self._call.cancel()
        finally:
            self._reader.close()
            if self._auth is not None:
                self._auth.finish()  # lets the request side end if it never began
        self.error = error
        self.closed = True
        self._on_close(self, error)  # may run before __init__ returned: pass self

    def close(self, timeout: float = 5.0) -> None:
        """End the request side, let the peer finish the response side, close."""
        self._outbox.end()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._call.cancel()
            self._thread.join(timeout)
        self._channel.close()

    def release(self) -> None:
        """Free the channel of a stream that has ended (from any thread, its own included)."""
        self._outbox.end()
        self._channel.close()

    def abort(self) -> None:
        self._call.cancel()
        self._outbox.end()
        self._channel.close()


def bracket(host: str) -> str:
    """``host`` as the host part of an address (an IPv6 one in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _stream_error(exc: grpc.RpcError, peer_name: str) -> BaseException | None:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{peer_name} rejected this worker: {details}")
    if code == grpc.StatusCode.CANCELLED:
        return PeerUnavailableError(f"stream to {peer_name} was cancelled")
    return PeerUnavailableError(
        f"{peer_name} is unreachable ({code.name if code else code}: {details})"
    )


class Server:
    """The gRPC server of this worker: one ``Exchange`` stream per calling peer.

    ``on_frame(frame, peer_rank, respond, inline)`` is called on a reader
    thread of the stream for every request frame, with ``inline`` True when
    that thread may run the request itself (see ``_TakeTurns``);
    ``respond(pieces)`` queues a reply frame on the same stream;
    ``attach(peer_rank, descriptor)`` builds a tensor over a shared-memory
    slot that the caller of rank ``peer_rank`` named.
    """

    def __init__(
        self,
        host: str,
        on_frame: Callable[[codec.Frame, int, Callable[[list[Any]], None], bool], None],
        auth_token: str | None,
        packet_size: int,
        max_message_size: int,
        credentials: grpc.ServerCredentials | None = None,
        port: int = 0,
        attach: Callable[[int, Any], Any] | None = None,
        batch_delay: float = 0.0,
        batch_min_open: int = 0,
        rank: int = -1,
    ):
        self._on_frame = on_frame
        self._attach = attach
        self._token = auth.Token(auth_token) if auth_token is not None else None
        self._rank = rank
        self._packet_size = packet_size
        self._max_message_size = max_message_size
        self._batching = (batch_delay, batch_min_open)
        self._outboxes: set[Outbox] = set()
        self._in_flight: dict[int, _InFlight] = {}  # calling rank -> its requests here
        self._in_flight_lock = threading.Lock()
        # A sync gRPC server holds one thread per open stream for the stream's life.
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4096, thread_name_prefix="rrpc-stream"),
            options=[
                *_SERVER_OPTIONS,
                ("grpc.max_receive_message_length", packet_limit(packet_size)),
            ],
        )
        handler = grpc.stream_stream_rpc_method_handler(self._exchange)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Exchange": handler}),)
        )
        target = f"{host}:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(target)
        else:
            self.port = self._server.add_secure_port(target, credentials)
        if not self.port:
            raise OSError(f"cannot listen on {target}")
        # What peers dial, and what the auth proofs cover.
        self.address = f"{bracket(host)}:{self.port}"
        self._server.start()

    def _exchange(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext):
        metadata = dict(context.invocation_metadata())
        try:
            peer_rank = int(metadata.get("rrpc-rank", "-1"))
        except ValueError:
            self._refuse(context, "refused:rank", "rrpc-rank is not a number")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rrpc-rank is not a number")
        requests: Iterator[bytes] = request_iterator
        if self._token is not None:
            checked = yield from self._authenticate(request_iterator, context, metadata, peer_rank)
            if checked is None:
                return  # the caller went away before it proved itself
            requests = checked
        elif auth.NONCE_KEY in metadata:
            self._refuse(
                context, "refused:no-token", "it requires an auth token, this worker has none"
            )
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the callee has no auth token, and the caller requires one",
            )
        outbox = Outbox(self._packet_size, *self._batching, track_backlog=True)
        with self._in_flight_lock:
            in_flight = self._in_flight.setdefault(peer_rank, _InFlight(PEER_IN_FLIGHT))
        over = threading.Event()

        def stream_over() -> None:
            over.set()
            in_flight.wake()
            outbox.end()

        # A caller that half-closed is no longer read from: if it then goes
        # away with requests unanswered, only this ends the stream (and frees
        # its thread).
        context.add_callback(stream_over)
        self._outboxes.add(outbox)
        attach = functools.partial(self._attach, peer_rank) if self._attach else None
        reader = codec.FrameReader(self._max_message_size, attach)

        respond = outbox.put

        def on_frame(frame: codec.Frame, inline: bool) -> None:
            weight = _weight(frame)  # taken by the reader (admit, below)
            frame.on_consumed = (
                in_flight.give if weight == 1 else functools.partial(in_flight.give, weight)
            )
            self._on_frame(frame, peer_rank, respond, inline)

        readers = _TakeTurns(
            requests,
            reader,
            outbox,
            on_frame,
            lambda frame: outbox.wait_for_room() and in_flight.take(_weight(frame), over.is_set),
        )
        for turn in range(2):
            threading.Thread(
                target=readers.run, name=f"rrpc-serve-{peer_rank}-{turn}", daemon=True
            ).start()
        try:
            yield from outbox.packets()
        except Exception as exc:
            self._refuse(context, f"bad-frame:{type(exc).__name__}", f"malformed frame: {exc}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {exc}")
        finally:
            self._outboxes.discard(outbox)

    def _authenticate(
        self,
        requests: Iterator[bytes],
        context: grpc.ServicerContext,
        metadata: dict[str, Any],
        peer_rank: int,
    ) -> Generator[bytes, None, Iterator[bytes] | None]:
        """The callee's side of the handshake (``auth.py``): yields this
        worker's handshake packet, returns the requests once the caller proved
        itself, None if it went away first (aborts the stream if it fails,
        before any frame is read)."""
        assert self._token is not None
        try:
            caller_nonce = bytes.fromhex(metadata.get(auth.NONCE_KEY, ""))
        except ValueError:
            caller_nonce = b""
        if len(caller_nonce) != auth.NONCE_SIZE:
            self._refuse(
                context, "refused:nonce", f"{_REFUSED} (no valid auth nonce in its metadata)"
            )
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        binding = auth.Binding(peer_rank, self._rank, self.address, caller_nonce, auth.new_nonce())
        yield codec.handshake_frame(binding.callee_nonce, self._token.proof(auth.CALLEE, binding))
        # A caller that never answers holds this thread no longer than this.
        timeout = SERVER_HANDSHAKE_TIMEOUT

        def expire() -> None:
            # Logged before the cancel, which the caller sees at once.
            self._refuse(context, "refused:timeout", f"no auth handshake within {timeout:g} s")
            context.cancel()

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            first = next(requests)
        except Exception:  # the caller went away (or the timer cancelled the stream)
            return None
        finally:
            timer.cancel()
        try:
            handshake, rest = codec.read_handshake(first)
            reason = "wrong auth proof: it does not know the token"
        except codec.ProtocolError as exc:
            handshake, rest, reason = None, b"", f"no auth handshake: {exc}"
        del first
        if handshake is None or not self._token.verify(auth.CALLER, binding, handshake.proof):
            self._refuse(context, "refused:proof", f"{_REFUSED} ({reason})")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        return itertools.chain((rest,), requests) if rest else requests

    def _refuse(self, context: grpc.ServicerContext, kind: str, reason: str) -> None:
        """Log a stream this worker refused or ended (``logs.event``: one line
        per kind of event and peer host per interval, never one per stream;
        ``kind`` tells reasons apart, so a flood of one hides no other)."""
        peer = context.peer()  # e.g. "ipv4:127.0.0.1:54321"
        host = peer.rsplit(":", 1)[0]  # each stream comes from a new port
        logs.event(
            kind, host, "%s: stream from %s (claims rank %s) ended: %s",
            self.address, peer, dict(context.invocation_metadata()).get("rrpc-rank", "?"), reason,
        )  # fmt: skip

    def stop(self, grace: float | None = 1.0) -> None:
        for outbox in list(self._outboxes):
            outbox.end()
        self._server.stop(grace).wait(grace)


def tls_credentials(
    cert_file: str | None, key_file: str | None, ca_file: str | None
) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    """Server and channel credentials for TLS with client certificates (both
    sides present a certificate signed by ``ca_file``); (None, None) without."""
    files = (cert_file, key_file, ca_file)
    if not any(files):
        return None, None
    if not all(files):
        raise ValueError("TLS needs tls_cert_file, tls_key_file and tls_ca_file together")
    cert, key, ca = (open(path, "rb").read() for path in files)  # type: ignore[arg-type]
    server = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )
    channel = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return server, channel
