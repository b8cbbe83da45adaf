"""Serving requests: each request frame, decoded, run by the handler of its kind, answered once.

Theory of operation. A carrier (a gRPC stream's readers, ``transport.Server``;
a lane's, ``lane_listener.Listener``) hands each request frame to
``on_request`` with a ``respond`` function that writes onto the same
stream. The frame is run on the worker pool, or on the reader that read it
when that reader handed reading to its partner (``inline``; a permit of the
pool all the same). Running it: decode the payload, wait (without holding a
thread) for any value it names that is still being created here, run the
handler registered for its kind (``register``: the services that
``init_rpc`` builds, ``rrpc/worker.py``), and encode the result, or the
exception with its traceback, as the one REPLY or ERROR. A handler whose
result is not ready yet returns a ``Deferred``: the reply waits for its
future (``async_execution``).

A request that raised here is also logged on this worker (``rrpc.request_errors``,
rate-limited), as torch's callee prints it: operators read the callee's log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rrpc import codec, logs, messages, metrics, wire
from rrpc.futures import on_done
from rrpc.messages import ERROR, REPLY, RpcError, WorkerInfo, thread_state

# A request that raised here, logged as torch's callee prints it: operators
# read the callee's log. Its own logger, so that a user can silence it alone.
request_errors_log = logging.getLogger("rrpc.request_errors")

Handler = Callable[[Any, WorkerInfo], Any]


class Deferred:
    """A handler's result that is not ready yet: the reply waits for ``future``."""

    __slots__ = ("future",)

    def __init__(self, future: torch._C.Future):
        self.future = future


class Dispatcher:
    """The handlers of this worker's message kinds, and the run of each request.

    ``agent`` is the run's ``Agent``: its peers, pool, options, metrics,
    autograd hooks, how it unpickles and encodes."""

    def __init__(self, agent: Any):
        self._agent = agent
        self.handlers: dict[int, Handler] = {}

    def register(self, kind: int, handler: Handler) -> None:
        self.handlers[kind] = handler

    def on_request(self, frame: wire.Frame, peer_rank: int, respond, inline: bool) -> None:
        if not self._agent.ready.is_set():
            # A peer that finished init_rpc first may call before this worker
            # knows every peer and is current: its functions would not find them.
            self._agent.ready.wait(self._agent.options.init_timeout)
        entry = self._agent.peers.get(peer_rank)  # looked up if it joined after this one
        peer = entry.info if entry is not None else WorkerInfo(f"rank{peer_rank}", peer_rank)
        # Inline: on the stream's reader thread, which handed reading to its partner.
        inline = inline and self._agent.options.run_inline
        if not (inline and self._agent.pool.run_inline(self._serve, frame, peer, respond)):
            self._agent.pool.submit(self._serve, frame, peer, respond)

    def _serve(self, frame: wire.Frame, peer: WorkerInfo, respond) -> None:
        envelope = frame.envelope
        context_id = envelope.autograd_context_id
        tensor_bytes = frame.tensor_bytes()
        size = len(frame.payload) + tensor_bytes
        handler = self.handlers.get(envelope.kind)
        try:
            if handler is None:
                kind = messages.kind_name(envelope.kind)
                raise RpcError(f"{self._agent.info.name} has no handler for {kind}")
            hook = None
            if context_id and self._agent.autograd_hooks is not None:
                key = (peer.id, envelope.request_id, False)
                enroll = envelope.kind in messages.RECORDED_KINDS  # its function runs in it
                hook = self._agent.autograd_hooks.tensor_hook(context_id, peer, key, enroll)
            request, waits = codec.loads_waiting(frame, peer, hook, self._agent.unpickle)
        except BaseException as exc:
            row = self._agent.metrics.served(peer.name, envelope.kind, None, size, tensor_bytes)
            self._reply_error(exc, peer, envelope.request_id, respond, row)
            return
        del frame
        row = self._agent.metrics.served(peer.name, envelope.kind, request, size, tensor_bytes)
        # The request travels in a box that its run empties: nothing of this
        # worker's keeps what it was sent past the function's own use (a large
        # argument's shared-memory slot is freed, or returned to its sender,
        # before the reply leaves: shm.py).
        box = [request]
        del request
        run = (self._run, handler, box, peer, envelope.request_id, context_id, respond, row)
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
            self._agent.pool.submit(*run)

        for wait in waits:
            on_done(wait, ready)

    def _run(
        self, handler, box: list, peer: WorkerInfo, request_id: int, context_id: int, respond, row
    ):
        previous_context = thread_state.autograd_context_id
        thread_state.autograd_context_id = context_id
        try:
            result = handler(box.pop(), peer)
        except BaseException as exc:
            self._reply_error(exc, peer, request_id, respond, row)
            return
        finally:
            thread_state.autograd_context_id = previous_context
        if isinstance(result, Deferred):
            if result.future.done():  # answered already (a value at hand): reply now
                self._reply_future(result.future, peer, request_id, context_id, respond, row)
                return
            on_done(
                result.future,
                lambda done: self._reply_future(done, peer, request_id, context_id, respond, row),
            )
        else:
            box.append(result)
            del result
            self._reply(box, peer, request_id, context_id, respond, row)

    def _reply_future(self, done, peer, request_id, context_id, respond, row) -> None:
        try:
            result = done.value()
        except BaseException as exc:
            # See api.rpc_sync: drop the frames (and the future) from the traceback.
            del done
            self._reply_error(exc, peer, request_id, respond, row)
            exc.__traceback__ = None
            return
        box = [result]
        del result
        self._reply(box, peer, request_id, context_id, respond, row)

    def _reply(self, box: list, peer: WorkerInfo, request_id: int, context_id: int, respond, row):
        """Answer with the result in ``box``, which it empties: the result is
        not kept here while the reply is written."""
        try:
            out = self._agent.encode(
                REPLY, request_id, box.pop(), peer, context_id, (peer.id, request_id, True)
            )
        except BaseException as exc:
            self._reply_error(exc, peer, request_id, respond, row)
            return
        try:  # counted before it leaves; should the counting fail, it leaves all the same
            metrics.replied(row, out.size, out.tensor_bytes, error=False)
        finally:
            respond(out.pieces)

    def _reply_error(self, exc: BaseException, peer: WorkerInfo, request_id: int, respond, row):
        payload = messages.remote_exception_payload(exc, self._agent.info.name)
        if getattr(exc, "remote_origin", None) is None:  # raised here, not passed on
            _, type_name, _, text, _ = payload
            logs.event(
                "request-failed",
                f"{peer.name}/{type_name}",  # once per caller and error type per interval
                "%s: a request from %s raised (the caller gets it):\n%s",
                self._agent.info.name,
                peer.name,
                text.rstrip(),
                logger=request_errors_log,
            )
        out = codec.encode(ERROR, request_id, payload, peer=peer)
        try:
            metrics.replied(row, out.size, out.tensor_bytes, error=True)
        finally:
            respond(out.pieces)
