"""The agent: one per process. Sends requests, matches replies, serves requests.

Theory of operation:

- ``send(peer, kind, obj, timeout)`` encodes the message, opens a call in the
  call table (``calls.CallTable``: request id -> future, peer, deadline,
  stream) and queues the frame on the one stream this worker keeps to
  ``peer``. The stream's receive thread completes the future when the REPLY
  or ERROR with that id comes back.
- A request frame arriving on the server is decoded and run on the worker
  pool by the handler registered for its kind; the handler's result (or a
  ``Deferred`` future's, for ``async_execution``) goes back as one reply.
- Exactly one of three things ends a call, whichever takes it from the table
  first: its reply, its deadline (one thread sleeps until the earliest
  deadline), or the stream it went out on breaking. Taking is atomic, so a
  late reply is dropped. The table decides; the agent completes.
- Upper layers plug in without the agent importing them: protocol kinds
  register handlers; distributed autograd sets ``autograd_hooks`` to see
  tensors that require grad as they are sent and received.

Where each job lives: the call table in ``calls.py`` (no I/O, unit-tested
alone), futures and every wait in ``futures.py``, streams, packets and TLS
credentials in ``transport.py``, frames and the errors that travel in them in
``codec.py``, the worker pool in ``pool.py``, the peer directory in
``peers.py``; here dispatch, connections and the deadline thread.

Threads (ARCHITECTURE.md has the full table, with what each runs). The rule:
user code (functions, ``then``/``add_done_callback`` callbacks,
``async_execution`` chains) never runs on a thread the transport needs.

=========================  ===========================  ==========================
thread                     may block on                 must never run
=========================  ===========================  ==========================
caller (the user's)        anything                     -
``rrpc-recv-<peer>``       the socket                   user code (callbacks go to
                                                        ``rrpc-callback-*``)
gRPC request iterator      the outbox, flow control     anything but packing
``rrpc-stream-*`` (server) the reply outbox             requests
``rrpc-serve-<rank>-{0,1}``  the socket, or the request   a request while it holds
                           it runs inline               the read turn
``rrpc-<name>-<i>`` (pool) anything (a wait for an RPC  -
                           gives its permit back)
``rrpc-callback-<n>``      anything                     -
``rrpc-deadlines``         its condition variable       user code
``rrpc-rref-<name>``       its event queue              user code
=========================  ===========================  ==========================

Locks: none on the per-call path (the call table is a dict; ids come from an
atomic counter). ``_connect_lock`` guards opening a peer's stream once.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rrpc import codec, faults, logs, messages, metrics, peers, shm, transport
from rrpc.calls import Call, CallTable
from rrpc.futures import (
    Future,
    SyncReply,
    mark_transport_thread,
    on_done,
    outcome,
    settle,
    wait_until,
)
from rrpc.messages import (
    ERROR,
    REPLY,
    PeerUnavailableError,
    RpcError,
    RpcTimeoutError,
    WorkerInfo,
    thread_state,
)
from rrpc.options import UNSET_RPC_TIMEOUT, RpcBackendOptions
from rrpc.pool import WorkerPool

log = logging.getLogger("rrpc")

Handler = Callable[[Any, WorkerInfo], Any]
# Sends again of a protocol message that never left (``send_reliably``):
# torch's agent makes 5, 1 s apart and 1.5x longer each time; these take
# 3.1 s in all.
RESENDS = 5
RESEND_DELAY = 0.1
# (caller rank, request id, is_reply): names one message, and so one send/recv pair.
MessageKey = tuple[int, int, bool]


class AutogradHooks(Protocol):
    def on_send(
        self, context_id: int, peer: WorkerInfo, key: MessageKey, tensors: list[torch.Tensor]
    ) -> None: ...

    def tensor_hook(
        self, context_id: int, peer: WorkerInfo, key: MessageKey
    ) -> Callable[[torch.Tensor], torch.Tensor]: ...


class Deferred:
    """A handler's result that is not ready yet: the reply waits for ``future``."""

    __slots__ = ("future",)

    def __init__(self, future: torch._C.Future):
        self.future = future


class _Deadlines:
    """One thread that fails the calls whose deadline passed.

    It sleeps until the earliest deadline it knows; ``watch`` wakes it only
    when a new deadline is earlier than that (the call table says when:
    timeouts are mostly equal, so rarely).
    """

    def __init__(self, calls: CallTable, expire: Callable[[Call], None]):
        self._calls = calls
        self._expire = expire
        self._cond = threading.Condition()
        self._next = math.inf
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rrpc-deadlines", daemon=True)
        self._thread.start()

    def watch(self, deadline: float) -> None:
        if deadline < self._next:
            with self._cond:
                if deadline < self._next:
                    self._next = deadline
                    self._cond.notify()

    def _run(self) -> None:
        mark_transport_thread()
        while True:
            with self._cond:
                now = time.monotonic()
                while not self._stopped and self._next > now:
                    self._cond.wait(None if self._next == math.inf else self._next - now)
                    now = time.monotonic()
                if self._stopped:
                    return
                self._next = math.inf  # a watch() during the scan below must notify
            expired = self._calls.expired(now)
            self.watch(self._calls.earliest())
            for call in expired:
                self._expire(call)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5.0)


class Agent:
    """This process's RPC endpoint. Created by ``init_rpc``; see the module doc."""

    def __init__(self, name: str, rank: int, host: str, options: RpcBackendOptions):
        self.info = WorkerInfo(name, rank)
        self.options = options
        self.handlers: dict[int, Handler] = {}
        self.autograd_hooks: AutogradHooks | None = None
        self.metrics = metrics.Metrics()  # calls, errors, bytes, latency: by peer, by function
        self.stats = self.metrics.peers  # the rows by peer name
        # Dynamic membership: how many times this rank joined before (rrpc/membership.py).
        self.incarnation = 0
        self.calls = CallTable()  # the calls this worker sent and awaits
        self.suspects: set[int] = set()  # ranks whose stream broke: maybe dead
        self._ids = itertools.count(1)
        self._connections: dict[int, transport.Connection] = {}
        self._connect_lock = threading.Lock()
        self._opened: list[transport.Connection] = []  # every channel opened, closed at stop
        self._stopped = False
        # Set once init_rpc has learned every peer: requests wait for it.
        self.ready = threading.Event()
        self._server_credentials, self._channel_credentials = transport.tls_credentials(
            options.tls_cert_file, options.tls_key_file, options.tls_ca_file
        )
        self._metadata = [("rrpc-rank", str(rank))]
        shm.tune_allocator()
        # Same-host fast path: our slots, which peers on this host may map.
        self.shm_pool = shm.SenderPool() if options.shared_memory else None
        self.peers = peers.Directory(self.shm_pool)  # who the others are (peers.py)
        self._pool = WorkerPool(options.num_worker_threads, f"rrpc-{name}")
        self.faults = faults.injector(options)  # None unless FaultyRpcBackendOptions
        self._deadlines = _Deadlines(self.calls, self._expire)
        self.server = transport.Server(
            host,
            self._on_request,
            options.auth_token,
            options.chunk_size,
            options.max_message_size,
            self._server_credentials,
            attach=self._attach_from,
            batch_delay=options.batch_delay,
            batch_min_open=options.batch_min_open,
            rank=rank,
        )
        self.address = self.server.address

    def advertisement(self) -> dict[str, Any]:
        """What peers need to know of this worker besides its address."""
        pool = self.shm_pool
        return {
            "host": shm.host_key(),
            "probe": pool.probe.name if pool is not None else "",
            "shm_key": pool.key.hex() if pool is not None else "",
            "main": codec.main_fingerprint(),
        }

    def _attach_from(self, rank: int, shared: Any) -> torch.Tensor:
        """A tensor over a shared-memory slot that peer ``rank`` sent on its
        stream: only in that peer's own pool (see shm's rules)."""
        peer = self.peers.get(rank)  # looked up if it joined after this one
        if peer is None or peer.source is None:
            raise ValueError(f"rank {rank} sent a shared-memory buffer but shares no memory here")
        return peer.source(shared)

    # -- Peers -----------------------------------------------------------------
    def add_peer(self, info: WorkerInfo, address: str, advertised: dict[str, Any]) -> None:
        self.peers.add(info, address, advertised)

    def remove_peer(self, info: WorkerInfo, reason: str, close: bool) -> None:
        """Forget a worker that left the group (or the old incarnation of one that
        came back): calls to it fail at once with ``PeerUnavailableError(reason)``.
        Calls already on its stream go on unless ``close``."""
        with self._connect_lock:
            self.peers.remove(info, reason)
            connection = self._connections.pop(info.id, None) if close else None
        if connection is not None:
            connection.close()

    def worker_info(self, to: Any) -> WorkerInfo:
        """A name, a rank or a WorkerInfo as a known worker (``Directory.resolve``)."""
        return self.peers.resolve(to)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker this one knows, itself included (torch's agent method)."""
        return self.peers.all()

    def all_workers(self) -> list[WorkerInfo]:
        return self.peers.all()

    def all_unreachable(self, ranks: list[int], timeout: float = 2.0) -> bool:
        """True if none of ``ranks`` answers a no-op call: they are gone."""
        probes = []
        for rank in ranks:
            found = self.peers.get(rank)
            if found is None:
                continue
            try:
                peer = found.info
                probes.append(
                    self.send(peer, messages.CALL, (int, (), {}), timeout, "liveness probe")
                )
            except RpcError:
                continue
        for probe in probes:
            try:
                probe.wait()
                return False
            except PeerUnavailableError:
                continue
            except RpcError:
                return False  # alive but slow or busy: keep waiting for it
        return True

    def resolve_timeout(self, timeout: float) -> float:
        """A call's timeout in seconds: -1 is the options' ``rpc_timeout``, 0 none."""
        if timeout == UNSET_RPC_TIMEOUT:
            return self.options.rpc_timeout
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 (0: none) or -1 (default), got {timeout}")
        return timeout

    def peer_stats(self, peer: WorkerInfo) -> metrics.Row:
        return self.metrics.peer(peer.name)

    def queue_depth(self) -> int:
        """Requests waiting for a worker thread."""
        return self._pool.queued()

    # -- Sending ---------------------------------------------------------------
    def send(
        self, peer: WorkerInfo, kind: int, obj: Any, timeout: float, what: str, sync: bool = False
    ) -> Any:
        """Send a request; returns a ``torch.futures.Future`` of its reply
        (with ``sync``, a ``SyncReply`` for a caller that blocks at once)."""
        if self._stopped:
            raise RpcError(f"{what} to {peer.name}: rrpc on {self.info.name} is shut down")
        context_id = thread_state.autograd_context_id
        request_id = next(self._ids)
        out = self._encode(
            kind, request_id, obj, peer, context_id, (self.info.id, request_id, False)
        )
        connection = self._connection(peer)
        future: SyncReply | Future = SyncReply() if sync else Future()
        now = time.monotonic()
        rows = self.metrics.sent(peer.name, kind, obj, out.size, out.tensor_bytes)
        if self.calls.open(request_id, future, peer, what, timeout, now, connection, rows):
            self._deadlines.watch(now + timeout)
        if self.faults is None:
            connection.send(out.pieces)
        else:  # fault injection (rrpc/faults.py): fail it, delay it, or send it
            self.faults.send(peer, kind, obj, what, out, connection.send, self.calls, request_id)
        if connection.closed:  # it broke between lookup and send: fail now, not at the deadline
            self._on_stream_closed(peer, connection, connection.error)
        return future

    def send_reliably(
        self, peer: WorkerInfo, kind: int, obj: Any, timeout: float, what: str
    ) -> Future:
        """``send`` for protocol messages whose loss would leak state (RRef
        FORK, ACCEPT, DELETE; autograd context releases): one that fails
        without having left this worker (``faults.InjectedFailure``) is sent
        again after ``RESEND_DELAY``, doubling each time, up to ``RESENDS``
        times, as torch's agent retries these. One that may have arrived (its
        stream broke) is not sent again: the peer would count it twice."""
        result = Future()
        context_id = thread_state.autograd_context_id

        def attempt(number: int) -> None:
            thread_state.autograd_context_id = context_id  # a resend runs on a timer thread
            try:
                reply = self.send(peer, kind, obj, timeout, what)
            except BaseException as exc:
                answered(number, None, exc)
                return
            on_done(reply, lambda done: answered(number, *outcome(done)))

        def answered(number: int, value: Any, error: BaseException | None) -> None:
            if isinstance(error, faults.InjectedFailure) and number < RESENDS and not self._stopped:
                timer = threading.Timer(RESEND_DELAY * 2**number, attempt, (number + 1,))
                timer.name = "rrpc-resend"
                timer.daemon = True
                timer.start()
            else:
                settle(result, value, error)

        attempt(0)
        return result

    def _encode(
        self,
        kind: int,
        request_id: int,
        obj: Any,
        peer: WorkerInfo,
        context_id: int,
        key: MessageKey,
    ) -> codec.Outgoing:
        """One message (request or reply) for ``peer``, its tensors that require
        grad shown to distributed autograd under ``key``."""
        entry = self.peers.known(peer.id)
        out = codec.encode(
            kind,
            request_id,
            obj,
            autograd_context_id=context_id,
            peer=peer,
            max_message_size=self.options.max_message_size,
            shared_memory=entry.placer if entry is not None else None,
            shm_threshold=self.options.shm_threshold,
            same_main=entry is not None and entry.same_main,
        )
        if out.grad_tensors and context_id and self.autograd_hooks is not None:
            self.autograd_hooks.on_send(context_id, peer, key, out.grad_tensors)
        return out

    def _connection(self, peer: WorkerInfo) -> transport.Connection:
        connection = self._connections.get(peer.id)
        if connection is not None:
            return connection
        with self._connect_lock:
            connection = self._connections.get(peer.id)
            if connection is None:
                if self._stopped:
                    raise RpcError(f"rrpc on {self.info.name} is shut down")
                address = self.peers.address(peer.id)
                if address is None:
                    raise PeerUnavailableError(
                        self.peers.departed.get(peer.id, f"{peer.name} is not a known worker")
                    )
                connection = transport.Connection(
                    address,
                    self._metadata,
                    on_frame=lambda frame: self._on_reply(peer, frame),
                    on_close=lambda closed, error: self._on_stream_closed(peer, closed, error),
                    packet_size=self.options.chunk_size,
                    max_message_size=self.options.max_message_size,
                    peer_name=peer.name,
                    credentials=self._channel_credentials,
                    attach=functools.partial(self._attach_from, peer.id),
                    batch_delay=self.options.batch_delay,
                    batch_min_open=self.options.batch_min_open,
                    peer_timeout=self.options.peer_timeout,
                    auth_token=self.options.auth_token,
                    ranks=(self.info.id, peer.id),
                )
                self._connections[peer.id] = connection
                self._opened.append(connection)
        return connection

    def _on_reply(self, peer: WorkerInfo, frame: codec.Frame) -> None:
        envelope = frame.envelope
        pending = self.calls.settle(envelope.request_id)
        tensor_bytes = frame.tensor_bytes()
        size = len(frame.payload) + tensor_bytes
        if pending is None:
            metrics.late(self.peer_stats(peer), size, tensor_bytes)
            return  # timed out or failed already
        if self.suspects:
            self.suspects.discard(peer.id)
        latency = time.monotonic() - pending.started
        metrics.answered(pending.rows, size, tensor_bytes, latency, envelope.kind == ERROR)
        hook = None
        context_id = envelope.autograd_context_id
        if context_id and self.autograd_hooks is not None:
            key = (self.info.id, envelope.request_id, True)
            hook = self.autograd_hooks.tensor_hook(context_id, peer, key)
        try:
            value = codec.loads(frame, peer, hook)
        except Exception as exc:
            if envelope.kind != ERROR:
                metrics.undecodable(pending.rows)
            settle(pending.future, error=exc)
            return
        if envelope.kind == ERROR:
            settle(pending.future, error=codec.rebuild_remote_exception(value))
        else:
            settle(pending.future, value)

    def _expire(self, call: Call) -> None:
        metrics.ended(call.rows, timed_out=True)
        settle(
            call.future,
            error=RpcTimeoutError(
                f"{call.what} on {call.peer.name} timed out after {call.timeout:g} s "
                f"(called from {self.info.name}): RPC ran for more than its timeout"
            ),
        )

    def _on_stream_closed(
        self, peer: WorkerInfo, connection: transport.Connection, error: BaseException | None
    ) -> None:
        with self._connect_lock:
            if self._connections.get(peer.id) is connection:
                del self._connections[peer.id]  # the next call reconnects (or fails fast)
            if connection in self._opened:
                self._opened.remove(connection)
        if error is not None and not self._stopped:
            self.suspects.add(peer.id)
            logs.event(
                "peer-lost",
                peer.name,
                "%s: stream to %s at %s failed: %s",
                self.info.name,
                peer.name,
                self.peers.address(peer.id) or "?",
                error,
            )
        # Close its channel now: an open channel left to the garbage collector
        # can hang the interpreter's exit in gRPC's finalizer.
        connection.release()
        if self._stopped:  # our own shutdown ended the stream: say so, not "peer unreachable"
            reason: BaseException = RpcError(f"rrpc on {self.info.name} shut down")
        else:
            reason = error or PeerUnavailableError(f"stream to {peer.name} closed")
        for call in self.calls.broken(connection):  # not calls already on a newer stream
            metrics.ended(call.rows, timed_out=False)
            settle(call.future, error=type(reason)(f"{call.what} on {peer.name} failed: {reason}"))

    # -- Serving ---------------------------------------------------------------
    def register(self, kind: int, handler: Handler) -> None:
        self.handlers[kind] = handler

    def _on_request(self, frame: codec.Frame, peer_rank: int, respond, inline: bool) -> None:
        if not self.ready.is_set():
            # A peer that finished init_rpc first may call before this worker
            # knows every peer and is current: its functions would not find them.
            self.ready.wait(self.options.init_timeout)
        entry = self.peers.get(peer_rank)  # looked up if it joined after this one
        peer = entry.info if entry is not None else WorkerInfo(f"rank{peer_rank}", peer_rank)
        # Inline: on the stream's reader thread, which handed reading to its partner.
        inline = inline and self.options.run_inline
        if not (inline and self._pool.run_inline(self._serve, frame, peer, respond)):
            self._pool.submit(self._serve, frame, peer, respond)

    def _serve(self, frame: codec.Frame, peer: WorkerInfo, respond) -> None:
        envelope = frame.envelope
        context_id = envelope.autograd_context_id
        tensor_bytes = frame.tensor_bytes()
        size = len(frame.payload) + tensor_bytes
        handler = self.handlers.get(envelope.kind)
        try:
            if handler is None:
                raise RpcError(
                    f"{self.info.name} has no handler for {messages.kind_name(envelope.kind)}"
                )
            hook = None
            if context_id and self.autograd_hooks is not None:
                key = (peer.id, envelope.request_id, False)
                hook = self.autograd_hooks.tensor_hook(context_id, peer, key)
            request, waits = codec.loads_waiting(frame, peer, hook)
        except BaseException as exc:
            rows = self.metrics.served(peer.name, envelope.kind, None, size, tensor_bytes)
            self._reply_error(exc, peer, envelope.request_id, respond, rows)
            return
        del frame
        rows = self.metrics.served(peer.name, envelope.kind, request, size, tensor_bytes)
        run = (self._run, handler, request, peer, envelope.request_id, context_id, respond, rows)
        if not waits:
            run[0](*run[1:])
            return
        # It names a value still being created here: run it once that is done.
        remaining = [len(waits)]
        lock = threading.Lock()

        def ready(_: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._pool.submit(*run)

        for wait in waits:
            on_done(wait, ready)

    def _run(
        self, handler, request, peer: WorkerInfo, request_id: int, context_id: int, respond, rows
    ):
        previous_context = thread_state.autograd_context_id
        thread_state.autograd_context_id = context_id
        try:
            result = handler(request, peer)
        except BaseException as exc:
            self._reply_error(exc, peer, request_id, respond, rows)
            return
        finally:
            thread_state.autograd_context_id = previous_context
        if isinstance(result, Deferred):
            on_done(
                result.future,
                lambda done: self._reply_future(done, peer, request_id, context_id, respond, rows),
            )
        else:
            self._reply(result, peer, request_id, context_id, respond, rows)

    def _reply_future(self, done, peer, request_id, context_id, respond, rows) -> None:
        try:
            result = done.value()
        except BaseException as exc:
            # See api.rpc_sync: drop the frames (and the future) from the traceback.
            del done
            self._reply_error(exc, peer, request_id, respond, rows)
            exc.__traceback__ = None
            return
        self._reply(result, peer, request_id, context_id, respond, rows)

    def _reply(
        self, result: Any, peer: WorkerInfo, request_id: int, context_id: int, respond, rows
    ):
        try:
            out = self._encode(
                REPLY, request_id, result, peer, context_id, (peer.id, request_id, True)
            )
        except BaseException as exc:
            self._reply_error(exc, peer, request_id, respond, rows)
            return
        metrics.replied(rows, out.size, out.tensor_bytes, error=False)
        respond(out.pieces)

    def _reply_error(self, exc: BaseException, peer: WorkerInfo, request_id: int, respond, rows):
        payload = codec.remote_exception_payload(exc, self.info.name)
        out = codec.encode(ERROR, request_id, payload, peer=peer)
        metrics.replied(rows, out.size, out.tensor_bytes, error=True)
        respond(out.pieces)

    # -- Lifecycle -------------------------------------------------------------
    def wait_idle(self, timeout: float, peer: int | None = None) -> bool:
        """Wait until no request this worker sent (to rank ``peer``, if given) is
        pending. False on timeout."""
        deadline = time.monotonic() + timeout
        while waiting := [call for call in self.calls if peer is None or call.peer.id == peer]:
            for call in waiting:
                if not wait_until(call.future, deadline - time.monotonic()):
                    return False
        return True

    def stop(self, graceful: bool, timeout: float = 5.0) -> None:
        """Close every stream and the server; fail what is still pending.
        Graceful closes share ``timeout`` seconds: a stream whose peer does not
        finish in time (frozen, partitioned) is cancelled instead."""
        deadline = time.monotonic() + timeout
        self.ready.set()  # release requests that waited for an init that failed
        with self._connect_lock:
            self._stopped = True
            connections = list(self._connections.values())
            self._connections.clear()
            opened, self._opened = self._opened, []
        for call in self.calls.close_all():
            metrics.ended(call.rows, timed_out=False)
            settle(call.future, error=RpcError(f"rrpc on {self.info.name} shut down"))
        for connection in connections:
            if graceful:
                connection.close(max(0.0, deadline - time.monotonic()))
            else:
                connection.abort()
        for connection in opened:  # broken ones too: an open channel can hang exit
            connection.release()
        self.server.stop(min(1.0, max(0.0, deadline - time.monotonic())) if graceful else 0)
        if self.shm_pool is not None:
            self.shm_pool.close()
        self._deadlines.stop()
        self._pool.stop(max(0.5, deadline - time.monotonic()) if graceful else 0.5)


_current: Agent | None = None

# Lifecycle hooks that protocol layers (rref, autograd) append to when imported:
# on_start(agent) right after init_rpc's rendezvous (register message kinds);
# on_drain(timeout) at graceful shutdown, before the barrier (finish own traffic);
# on_stop() after the agent stopped (forget per-run state).
on_start: list[Callable[[Agent], None]] = []
on_drain: list[Callable[[float], None]] = []
on_stop: list[Callable[[], None]] = []


def current_agent() -> Agent:
    """This process's agent; raises if ``init_rpc`` has not run."""
    agent = _current
    if agent is None:
        raise RpcError("RPC has not been initialized: call rrpc.init_rpc() first")
    return agent


def set_current_agent(agent: Agent | None) -> None:
    global _current
    _current = agent
