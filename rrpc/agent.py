"""The agent: one per process and run. Sends requests and matches their replies; owns the run.

Theory of operation:

- ``send(peer, kind, obj, timeout, what)`` passes the request through the
  send layers (``add_send_layer``: profiling's RPC events), then encodes
  it, opens a call in the call table (``calls.CallTable``: request id ->
  future, peer, deadline, carrier) and writes the frame on the carrier to
  ``peer`` (``routes.Routes``): its same-host lane when it has one
  (``lane.py``), else the one gRPC stream this worker keeps to it
  (``transport.py``). ``rpc_sync``'s caller reads its own reply while nobody
  else reads the carrier (``SyncReply.lead``; ``grpc_replies.py`` on gRPC);
  otherwise the carrier's reader completes the future (``on_reply``).
- Requests arriving on either carrier are run by ``dispatch.Dispatcher``:
  decoded, run by the handler registered for their kind, answered once.
- Exactly one of three things ends a call, whichever takes it from the table
  first: its reply, its deadline (``calls.Deadlines``: one entry on the
  run's scheduler, at the earliest deadline), or the carrier it went out on
  breaking. Taking is atomic, so a late reply is dropped (once decoded: an
  RRef in it is counted, then let go). The table decides; the agent completes.
- Upper layers plug in without the agent importing them: ``init_rpc``
  builds the run's services (``rrpc/worker.py``), which register handlers
  for their kinds and layers on the send path; distributed autograd sets
  ``autograd_hooks`` to see tensors that require grad as they are sent and
  received. The agent holds the services (``rrefs``, ``autograd``, ...):
  one run, one owner, stopped in one order (``stop``).

Where each job lives: the call table in ``calls.py`` (no I/O, unit-tested
alone), futures and every wait in ``futures.py``, serving in ``dispatch.py``,
the carriers to each peer in ``routes.py`` (gRPC streams: ``transport.py``
over ``streams.py``; lanes: ``lane.py``, ``lane_listener.py``,
``lane_io.py``), frames in ``wire.py``, their payloads and the errors that
travel in them in ``codec.py``, what restricted mode unpickles in
``restricted.py``, the worker pool in ``pool.py``, the peer directory in
``peers.py``, timed work on ``scheduler.py``'s one thread.

Threads: ARCHITECTURE.md lists every thread rrpc starts, with what each may
run and block on. The rule: user code (functions, ``then`` /
``add_done_callback`` callbacks, ``async_execution`` chains) never runs on a
thread the transport needs.

Locks: none of the agent's own on the per-call path (the call table is a
dict; ids come from an atomic counter)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rrpc import (
    auth,
    codec,
    dispatch,
    faults,
    grpc_settings,
    lane,
    lane_listener,
    logs,
    messages,
    metrics,
    peers,
    restricted,
    routes,
    shm,
    streams,
    transport,
    wire,
)
from rrpc.calls import Call, CallTable, Deadlines
from rrpc.futures import Future, SyncReply, on_done, outcome, settle, wait_until
from rrpc.messages import (
    AUTOGRAD_RELEASE,
    ERROR,
    RREF_ACCEPT,
    RREF_CREATE,
    RREF_CREATE_FAILED,
    RREF_DELETE,
    RREF_FORK,
    MessageKey,
    PeerUnavailableError,
    RpcError,
    RpcTimeoutError,
    What,
    WorkerInfo,
    thread_state,
)
from rrpc.options import UNSET_RPC_TIMEOUT, RpcBackendOptions
from rrpc.pool import WorkerPool, lending
from rrpc.rendezvous import Rendezvous
from rrpc.scheduler import Scheduler
from rrpc.streams import CLOSED

log = logging.getLogger("rrpc")
# Sends again of a protocol message that never left (``send_reliably``): torch's
# agent makes 5, 1 s apart and 1.5x longer each time; these take 3.1 s in all.
RESENDS = 5
RESEND_DELAY = 0.1
# Seconds the run's threads get to end when ``stop`` has no time left (a shutdown
# past its deadline): an idle one ends in µs; one running a request is left to end.
STOP_GRACE = 0.25
# Requests whose replies only rrpc's bookkeeping awaits: on a lane, read by
# the next caller that leads, or soon after (``lane.Lane.read_soon``).
READ_SOON_KINDS = frozenset(
    {RREF_CREATE, RREF_FORK, RREF_ACCEPT, RREF_DELETE, RREF_CREATE_FAILED, AUTOGRAD_RELEASE}
)
# A liveness probe (``Agent.probe``) calls ``int()`` on peers, restricted or not.
restricted.allow_call(int)


class Send(Protocol):
    """What sends a request (``Agent.send``); see ``Agent._send`` for the arguments."""

    def __call__(
        self,
        peer: WorkerInfo,
        kind: int,
        obj: Any,
        timeout: float,
        what: What,
        sync: bool = False,
        mode: str | None = None,
    ) -> Any: ...


# A send layer (``Agent.add_send_layer``), as a WSGI middleware: ``layer(send)`` is
# what to call instead of ``send``, which hands each request on, changed or as it is.
SendLayer = Callable[[Send], Send]


class AutogradHooks(Protocol):
    def check(self, context_id: int) -> None: ...

    def on_send(
        self, context_id: int, peer: WorkerInfo, key: MessageKey, tensors: list[torch.Tensor]
    ) -> None: ...

    def tensor_hook(
        self, context_id: int, peer: WorkerInfo, key: MessageKey, enroll: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]: ...


class Agent:
    """This process's RPC endpoint. Created by ``init_rpc``; see the module doc."""

    def __init__(self, name: str, rank: int, host: str, options: RpcBackendOptions):
        self.info = WorkerInfo(name, rank)
        self.options = options
        # Restricted mode is chosen per run, here: how every message is unpickled
        # (the CALL handler and RRef proxies check options.restricted too).
        self.unpickle = restricted.loads if options.restricted else pickle.loads
        self.dispatcher = dispatch.Dispatcher(self)  # each kind's handler; each request's run
        self.handlers = self.dispatcher.handlers
        self.register = self.dispatcher.register
        self.autograd_hooks: AutogradHooks | None = None
        self.metrics = metrics.Metrics()  # calls, errors, bytes, latency: by peer, by function
        self.incarnation = 0  # times this rank joined a dynamic group before (membership.py)
        self.calls = CallTable()  # the calls this worker sent and awaits
        # Ranks maybe dead: their carrier broke, a lane to them could not open, or a barrier
        # probes them (``all_unreachable``); cleared by their next reply. No new lane opens to them.
        self.suspects: set[int] = set()
        self._ids = itertools.count(1)
        self._stopped = False
        # In the shutdown barrier: a carrier breaking is a peer that stopped first (not logged).
        self.leaving = False
        self.ready = threading.Event()  # set once init_rpc learned every peer: requests wait for it
        server_credentials, channel_credentials = grpc_settings.tls_credentials(
            options.tls_cert_file, options.tls_key_file, options.tls_ca_file
        )
        shm.tune_allocator()
        # Same-host fast path: our slots, which peers on this host may map.
        self.shm_pool = shm.SenderPool() if options.shared_memory else None
        # Who the others are (peers.py), and which of them share this host's lanes.
        self.peers = peers.Directory(
            self.shm_pool, lane.lane_key() if options.same_host_lane else ""
        )
        # Replies in shared memory their callers have not read: bounded as a backlog.
        unread_replies = peers.UnreadReplies(self.peers, streams.REPLY_BACKLOG)
        self.pool = WorkerPool(options.num_worker_threads, f"rrpc-{name}")
        self.scheduler = Scheduler()  # timed work: deadlines, resends, delays; short callbacks only
        self.faults = faults.injector(options, self.scheduler)  # None: no fault injection
        self._deadlines = Deadlines(self.calls, self.scheduler, self._expire)
        # Every request passes through these on its way out (``add_send_layer``),
        # outermost first; ``send`` is them wrapped around ``_send``.
        self.send_layers: list[SendLayer] = []
        self.send: Send = self._send
        # This run's services, built, started and stopped by init_rpc and shutdown
        # (``worker.py``); None before. Their layers' functions find them here.
        self.rrefs: Any = None  # the RRef protocol's driver (rref_service.RRefService)
        self.autograd: Any = None  # distributed autograd's contexts (autograd.Autograd)
        self.profiling: Any = None  # RPCs in torch's profilers (profiling.Profiling)
        self.group: Any = None  # a dynamic group's membership, while joined (membership.Group)
        self.exporter: metrics.Exporter | None = None  # the Prometheus endpoint (metrics_port)
        self.rendezvous: Rendezvous | None = None  # how this run's workers found each other
        self.server = transport.Server(
            host,
            self.dispatcher.on_request,
            options.auth_token,
            options.chunk_size,
            options.max_message_size,
            scheduler=self.scheduler,
            credentials=server_credentials,
            attach=self.attach_from,
            batch_delay=options.batch_delay,
            batch_min_open=options.batch_min_open,
            rank=rank,
            bulk_channel=options.bulk_channel,
            peer_timeout=options.peer_timeout,
            unread_replies=unread_replies,
            lend=lending,  # a reply's send that its caller holds up keeps no permit
            spin=options.grpc_spin,
        )
        self.address = self.server.address
        self.server.admission.gate(self.ready, options.init_timeout)
        # Our same-host lane's socket (lane_listener.py), which callers on this host dial.
        self.lane_listener: lane_listener.Listener | None = None
        if options.same_host_lane:
            token = auth.Token(options.auth_token) if options.auth_token else None
            serve, admission = self.dispatcher.on_request, self.server.admission.of
            self.lane_listener = lane_listener.Listener(
                rank, serve, token, self.frame_reader, admission, unread_replies, options.lane_spin
            )
        # The carriers of our calls: lanes and gRPC streams, by peer (routes.py).
        self.routes = routes.Routes(self, channel_credentials)

    def advertisement(self) -> dict[str, Any]:
        """What peers need to know of this worker besides its address."""
        pool = self.shm_pool
        return {
            "host": shm.host_key(),
            "probe": pool.probe.name if pool is not None else "",
            "shm_key": pool.key.hex() if pool is not None else "",
            "main": codec.main_fingerprint(),
            "lane": self.lane_listener.path if self.lane_listener is not None else "",
            "lane_key": lane.lane_key() if self.lane_listener is not None else "",
            "bulk": self.server.bulk_port,
        }

    def frame_reader(self, rank: int) -> wire.FrameReader:
        """Cuts the frames peer ``rank`` sends on a lane, with a stream's limits."""
        attach = functools.partial(self.attach_from, rank)
        return wire.FrameReader(self.options.max_message_size, attach)

    def attach_from(self, rank: int, shared: Any) -> torch.Tensor:
        """A tensor over a shared-memory slot that peer ``rank`` sent on its
        stream: only in that peer's own pool (see shm's rules)."""
        peer = self.peers.get(rank)  # looked up if it joined after this one
        if peer is None and not self.ready.is_set():
            # A peer that finished init_rpc first may send before it was added here.
            self.ready.wait(self.options.init_timeout)
            peer = self.peers.get(rank)
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
        self.peers.remove(info, reason)
        if close:
            self.routes.remove(info.id)

    def worker_info(self, to: Any) -> WorkerInfo:
        """A name, a rank or a WorkerInfo as a known worker (``Directory.resolve``)."""
        return self.peers.resolve(to)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker this one knows, itself included (torch's agent method)."""
        return self.peers.all()

    def all_workers(self) -> list[WorkerInfo]:
        return self.peers.all()

    def all_unreachable(self, ranks: list[int], timeout: float = 2.0) -> bool:
        """True if none of ``ranks`` answers a no-op call: they are gone.
        Takes ``timeout`` seconds at most: the probed ranks are suspects from
        now on (until they answer), so no probe waits in a lane's handshake
        with a frozen peer (``routes``' rules)."""
        self.suspects.update(ranks)
        probes = []
        for rank in ranks:
            found = self.peers.get(rank)
            if found is None:
                continue
            try:
                probes.append(self.probe(found.info, timeout, "liveness probe"))
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
        """Where ``peer``'s traffic that belongs to no call is counted (a late reply)."""
        return self.metrics.late_row(peer.name)

    def queue_depth(self) -> int:
        """Requests waiting for a worker thread."""
        return self.pool.queued()

    def probe(self, peer: WorkerInfo, timeout: float, what: str) -> Any:
        """A no-op call to ``peer``, outside the thread's autograd context."""
        previous, thread_state.autograd_context_id = thread_state.autograd_context_id, 0
        try:
            return self.send(peer, messages.CALL, (int, (), {}), timeout, what)
        finally:
            thread_state.autograd_context_id = previous

    # -- Sending ---------------------------------------------------------------
    def add_send_layer(self, layer: SendLayer) -> None:
        """Pass every request this worker sends through ``layer`` (profiling's
        RPC events, ``rrpc/profiling.py``), outside the layers added before it.
        A layer sees each request before it is encoded and may change it, or
        hand it on as it is: a request no layer wants costs each one a call
        and its own check."""
        self.send_layers.insert(0, layer)
        self.send = layer(self.send)

    def _send(
        self,
        peer: WorkerInfo,
        kind: int,
        obj: Any,
        timeout: float,
        what: What,
        sync: bool = False,
        mode: str | None = None,
    ) -> Any:
        """Send a request (``Agent.send``, after the send layers); returns a
        ``torch.futures.Future`` of its reply (with ``sync``, a ``SyncReply``
        for a caller that blocks at once).

        ``what`` describes it in errors ("call of f"); ``mode`` is torch's
        ``RPCExecMode`` of a user's call ("sync", "async", "remote": what the
        profiler names its event by), None for rrpc's own messages. Metrics
        count it as it goes; fault injection, when on, fails or delays its
        frames (``rrpc/faults.py``: it needs them encoded, and the call open)."""
        if self._stopped:
            raise RpcError(f"{what} to {peer.name}: rrpc on {self.info.name} is shut down")
        context_id = thread_state.autograd_context_id
        request_id = next(self._ids)
        out = self.encode(
            kind, request_id, obj, peer, context_id, (self.info.id, request_id, False)
        )
        now = time.monotonic()  # a lane opened for the call (on this thread) spends its time
        connection, route = self.routes.to(peer, timeout)
        if sync:  # the caller reads its own reply while nobody else reads (a lane, gRPC)
            future: SyncReply | Future = SyncReply((route or connection).lead)
        else:
            future = Future()
        row = self.metrics.sent(peer.name, kind, obj, out.size, out.tensor_bytes)
        if self.calls.open(request_id, future, peer, what, timeout, now, connection, row):
            self._deadlines.watch(now + timeout)
        # Nobody waits for its reply at once (rrpc's bookkeeping): on a lane, no wake-up now.
        bookkeeping = not sync and kind in READ_SOON_KINDS
        if route is not None:
            route.expect(request_id, bookkeeping)  # before any write: a late one is still read
        if self.faults is None:
            connection.send(out.pieces)
        # Fault injection (rrpc/faults.py): fail it, delay it, or send it.
        elif self.faults.send(peer, kind, obj, what, out, connection.send, self.calls, request_id):
            if route is not None:
                route.ended(request_id)  # dropped: no reply will come
        if connection.stream.state is CLOSED:  # it broke between lookup and send: fail now
            self.on_carrier_closed(peer, connection, connection.stream.error)
        elif not sync:
            if bookkeeping and route is not None:
                route.read_soon()
            else:
                (route or connection).need_reader()
        return future

    def send_reliably(
        self, peer: WorkerInfo, kind: int, obj: Any, timeout: float, what: What
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
            # A resend runs on the scheduler's thread: in the sender's context, for this send only.
            previous = thread_state.autograd_context_id
            thread_state.autograd_context_id = context_id
            try:
                reply = self.send(peer, kind, obj, timeout, what)
            except BaseException as exc:
                answered(number, None, exc)
                return
            finally:
                thread_state.autograd_context_id = previous
            on_done(reply, lambda done: answered(number, *outcome(done)))

        def answered(number: int, value: Any, error: BaseException | None) -> None:
            if isinstance(error, faults.InjectedFailure) and number < RESENDS and not self._stopped:
                self.scheduler.call_later(RESEND_DELAY * 2**number, attempt, number + 1)
            else:
                settle(result, value, error)

        attempt(0)
        return result

    def encode(
        self,
        kind: int,
        request_id: int,
        obj: Any,
        peer: WorkerInfo,
        context_id: int,
        key: MessageKey,
    ) -> wire.Outgoing:
        """One message (request or reply) for ``peer``, shown to distributed
        autograd under ``key`` if it holds tensors that require grad or is a
        user function's request (``messages.RECORDED_KINDS``); either raises,
        before framing, in a context released here (``AutogradHooks.check``)."""
        hooks = self.autograd_hooks if context_id else None
        recorded = hooks is not None and kind in messages.RECORDED_KINDS
        if recorded and hooks is not None:  # before pickling: nothing to undo
            hooks.check(context_id)
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
            check_context=None if recorded or hooks is None else hooks.check,
        )
        if hooks is not None and (recorded or out.grad_tensors):
            hooks.on_send(context_id, peer, key, out.grad_tensors)
        return out

    def on_reply(self, peer: WorkerInfo, frame: wire.Frame) -> bool:
        """Settle the call ``frame`` answers; False if it had ended already."""
        envelope = frame.envelope
        pending = self.calls.settle(envelope.request_id)
        tensor_bytes = frame.tensor_bytes()
        size = len(frame.payload) + tensor_bytes
        if pending is None:  # timed out or failed already
            metrics.late(self.peer_stats(peer), size, tensor_bytes)
            # Decoded all the same, and dropped: an RRef in it is counted by
            # unpickling it, then let go; undecoded, its owner would keep it.
            with contextlib.suppress(Exception):  # no one to tell: the caller has its error
                codec.loads(frame, peer, None, self.unpickle)
            return False
        if self.suspects:
            self.suspects.discard(peer.id)
        latency = time.monotonic() - pending.started
        try:
            metrics.answered(pending.row, size, tensor_bytes, latency, envelope.kind == ERROR)
        except Exception as exc:  # bookkeeping: the call it counts ends all the same
            logs.event(
                "count-failed", peer.name, "counting the reply to %s failed: %r", pending.what, exc
            )
        hook = None
        context_id = envelope.autograd_context_id
        if context_id and self.autograd_hooks is not None:
            key = (self.info.id, envelope.request_id, True)
            hook = self.autograd_hooks.tensor_hook(context_id, peer, key)
        try:
            value = codec.loads(frame, peer, hook, self.unpickle)
        except Exception as exc:
            if envelope.kind != ERROR:
                metrics.undecodable(pending.row)
            settle(pending.future, error=exc)
            return True
        if envelope.kind == ERROR:
            settle(pending.future, error=messages.rebuild_remote_exception(value, self.unpickle))
        else:
            settle(pending.future, value)
        return True

    def _expire(self, call: Call) -> None:
        if isinstance(call.stream, lane.Lane):
            call.stream.expired(call.request_id)
        metrics.ended(call.row, timed_out=True)
        reason = (
            f"{call.what} on {call.peer.name} timed out after {call.timeout:g} s "
            f"(called from {self.info.name}): RPC ran for more than its timeout"
        )
        settle(call.future, error=RpcTimeoutError(reason))
        if isinstance(call.stream, transport.Connection):
            call.stream.interrupt()  # a caller reading the stream for its reply stops

    def on_carrier_closed(self, peer: WorkerInfo, connection: Any, error: BaseException | None):
        """A gRPC stream or a lane to ``peer`` ended: the calls on it fail."""
        self.routes.closed(peer, connection, error)
        if error is not None and not self._stopped:
            self.suspects.add(peer.id)
        if error is not None and not self._stopped and not self.leaving:
            logs.event(
                "peer-lost",
                peer.name,
                "%s: stream to %s at %s failed: %s",
                self.info.name,
                peer.name,
                self.peers.address(peer.id) or "?",
                error,
            )
        if self._stopped:  # our own shutdown ended the stream: say so, not "peer unreachable"
            reason: BaseException = RpcError(f"rrpc on {self.info.name} shut down")
        else:
            reason = error or PeerUnavailableError(f"stream to {peer.name} closed")
        for call in self.calls.broken(connection):  # not calls already on a newer stream
            metrics.ended(call.row, timed_out=False)
            settle(call.future, error=type(reason)(f"{call.what} on {peer.name} failed: {reason}"))

    # -- Lifecycle -------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """Whether ``stop`` has begun: nothing more is sent."""
        return self._stopped

    def wait_idle(self, timeout: float, peer: int | None = None) -> bool:
        """Wait until no request this worker sent (to rank ``peer``, if given) is
        pending. False on timeout."""
        deadline = time.monotonic() + timeout
        while waiting := [call for call in self.calls if peer is None or call.peer.id == peer]:
            for call in waiting:
                if not wait_until(call.future, deadline - time.monotonic()):
                    return False
        return True

    def stop(self, graceful: bool, timeout: float = 5.0, until: float | None = None) -> None:
        """Close every stream and the server; fail what is still pending; end
        the run's threads. Graceful closes share ``timeout`` seconds: a stream
        whose peer does not finish in time (frozen, partitioned) is cancelled
        instead. It returns by ``until`` (``time.monotonic()``; by default
        ``timeout`` or ``STOP_GRACE`` from now, the later): a thread still
        busy then is left to end by itself (every thread of a run is a daemon)."""
        now = time.monotonic()
        deadline = now + (timeout if graceful else 0.0)
        if until is None:
            until = max(deadline, now + STOP_GRACE)
        self.ready.set()  # release requests that waited for an init that failed
        self._stopped = True
        for call in self.calls.close_all():
            metrics.ended(call.row, timed_out=False)
            settle(call.future, error=RpcError(f"rrpc on {self.info.name} shut down"))
        self.routes.stop(graceful, deadline)
        if self.lane_listener is not None:
            self.lane_listener.stop()
        self.server.stop(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.shm_pool is not None:
            self.shm_pool.close()
        self.scheduler.stop(max(0.0, until - time.monotonic()))
        self.pool.stop(max(0.0, until - time.monotonic()))


# The process's one pointer to its run (as torch's ``_agent``): the agent of
# the current init_rpc .. shutdown, which holds everything else of the run.
_current: Agent | None = None


def current_agent() -> Agent:
    """This process's agent; raises if ``init_rpc`` has not run."""
    agent = _current
    if agent is None:
        raise RpcError("RPC has not been initialized: call rrpc.init_rpc() first")
    return agent


def set_current_agent(agent: Agent | None) -> None:
    global _current
    _current = agent
