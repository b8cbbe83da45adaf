"""Distributed autograd bookkeeping: contexts, their send and recv records, who took part.

No I/O and no autograd graph logic here (that is ``rrpc.autograd``): only the
tables one worker keeps, so that a unit test can drive them with plain calls.

Rules
- A context is named by an id unique in the cluster: the creating worker's rank
  in the top 16 bits, a per-process counter below (as torch: ``rank << 48 | n``).
- The creator makes its context in ``context()``; every other worker makes it
  lazily: the callee of a user function's request in it (``CALL``, ``remote()``,
  ``to_here()``: ``messages.RECORDED_KINDS``) when the request arrives, as
  torch, since the function runs in the context and may use it (a backward
  there, a nested call); any worker, the first time a tensor that requires
  grad is sent or received in it. Other messages without such tensors leave
  no state anywhere.
- A *send record* (``sends[key]``) is what the sender keeps of a message: the
  tensors that required grad, in pickling order. When the gradients of those
  tensors come back, the pass continues from them. It keeps that part of the
  graph alive until the context is released.
- A *recv record* (``recvs[key]``) is what the receiver keeps: who sent the
  message. The recv nodes themselves live in the autograd graph; each knows its
  message key, the index of its tensor in the message and its peer.
- ``participants`` are the workers this one exchanged such tensors or such
  requests with in the context, in either direction: the sender of a request
  records its callee, the callee its caller, whatever the request holds.
  Releasing a context tells each of them, and each tells its own: every worker
  that holds state for it is reached.
- Once released, a context id is remembered (a bounded list): a late message in
  it (an RPC left in flight when the ``with`` block ended) creates no state that
  nobody would release. Ids this worker created are never re-created. Sending
  in a released context what would be recorded (a user function's request,
  tensors that require grad: a function still running when the release came)
  raises, as torch: the message would make state on its receiver that no
  release reaches (``Hooks.check``).
- Gradients of leaves accumulate here (``gradients``), never in ``.grad``;
  DDP's average of one replaces it (``replace``).

Locks: the table's lock guards the id -> context map; each context's lock
guards its records, which several threads may touch at once (the transport's
receive threads decode replies, pool threads run backward passes).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from rrpc.messages import MessageKey, WorkerInfo

CONTEXT_ID_BITS = 48
# torch's error for a message sent in a context this worker no longer has.
RELEASED = "Couldn't find autograd context data for current autograd context id"
REMEMBERED_RELEASES = 65536  # released ids remembered, to drop late messages


class Context:
    """One worker's state for one distributed autograd context."""

    def __init__(self, context_id: int):
        self.context_id = context_id
        self.lock = threading.Lock()
        self.sends: dict[MessageKey, tuple[WorkerInfo, list[torch.Tensor]]] = {}
        self.recvs: dict[MessageKey, WorkerInfo] = {}
        self.participants: dict[int, WorkerInfo] = {}  # rank -> worker
        # Leaf tensor -> its accumulated gradient. Tensors hash by identity.
        self.gradients: dict[torch.Tensor, torch.Tensor] = {}

    def record_send(self, key: MessageKey, peer: WorkerInfo, tensors: list[torch.Tensor]) -> None:
        with self.lock:
            self.sends[key] = (peer, tensors)
            self.participants[peer.id] = peer

    def enroll(self, peer: WorkerInfo) -> None:
        """``peer`` sent or was sent a user function's request in this context."""
        with self.lock:
            self.participants[peer.id] = peer

    def record_recv(self, key: MessageKey, peer: WorkerInfo) -> None:
        with self.lock:
            self.recvs[key] = peer
            self.participants[peer.id] = peer

    def sent_tensors(self, key: MessageKey) -> list[torch.Tensor]:
        with self.lock:
            record = self.sends.get(key)
        if record is None:
            raise RuntimeError(
                f"autograd context {self.context_id} has no send record for message {key} "
                "(gradients arrived for a message this worker did not send in this context)"
            )
        return record[1]

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        # Out of place: a tensor handed out by get_gradients() never changes under its reader.
        with self.lock:
            previous = self.gradients.get(leaf)
            self.gradients[leaf] = grad if previous is None else previous + grad

    def replace(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        """Set ``leaf``'s gradient (a DDP average of it)."""
        with self.lock:
            self.gradients[leaf] = grad

    def gradient_leaves(self) -> list[torch.Tensor]:
        with self.lock:
            return list(self.gradients)

    def gradients_copy(self) -> dict[torch.Tensor, torch.Tensor]:
        with self.lock:
            return dict(self.gradients)


class ContextTable:
    """Every context alive on this worker, by id."""

    def __init__(self, rank: int, first: int = 1):
        if not 0 <= rank < 1 << (64 - CONTEXT_ID_BITS - 1):
            raise ValueError(f"rank {rank} does not fit in an autograd context id")
        self.rank = rank
        self._lock = threading.Lock()
        self._contexts: dict[int, Context] = {}
        self._released: OrderedDict[int, None] = OrderedDict()
        # From 1: 0 would make rank 0's first id "no context". A rank that rejoined
        # a dynamic group starts past its earlier incarnations' ids (``first``).
        self._counter = itertools.count(first)

    def create(self) -> Context:
        context_id = (self.rank << CONTEXT_ID_BITS) | next(self._counter)
        context = Context(context_id)
        with self._lock:
            self._contexts[context_id] = context
        return context

    def get(self, context_id: int) -> Context:
        context = self._contexts.get(context_id)
        if context is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return context

    def find(self, context_id: int) -> Context | None:
        return self._contexts.get(context_id)

    def get_or_create(self, context_id: int) -> Context | None:
        """The context, made if new; None for one released (or ours and gone)."""
        context = self._contexts.get(context_id)
        if context is not None:
            return context
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                if context_id >> CONTEXT_ID_BITS == self.rank or context_id in self._released:
                    return None
                context = self._contexts[context_id] = Context(context_id)
            return context

    def released(self, context_id: int) -> bool:
        """Whether ``context_id`` ended here: neither alive nor to be made."""
        if context_id in self._contexts:
            return False
        with self._lock:
            mine = context_id >> CONTEXT_ID_BITS == self.rank
            return context_id not in self._contexts and (mine or context_id in self._released)

    def release(self, context_id: int) -> Context | None:
        """Forget a context; return it (for its participants), or None if unknown."""
        with self._lock:
            context = self._contexts.pop(context_id, None)
            if context_id >> CONTEXT_ID_BITS != self.rank:
                self._released[context_id] = None
                if len(self._released) > REMEMBERED_RELEASES:
                    self._released.popitem(last=False)
        return context

    def clear(self) -> None:
        with self._lock:
            self._contexts.clear()
            self._released.clear()

    def debug_info(self) -> dict[str, int]:
        with self._lock:
            contexts = list(self._contexts.values())
        return {
            "contexts": len(contexts),
            "send_records": sum(len(c.sends) for c in contexts),
            "recv_records": sum(len(c.recvs) for c in contexts),
            "gradients": sum(len(c.gradients) for c in contexts),
        }


class Hooks:
    """What the agent calls for messages in a context (``agent.AutogradHooks``).
    ``receive(context_id, key, index, peer, tensor)`` makes a received tensor's
    recv node (``rrpc.autograd``'s)."""

    def __init__(self, table: ContextTable, receive: Callable[..., torch.Tensor]):
        self.table = table
        self._receive = receive

    def check(self, context_id: int) -> None:
        """Raise torch's error if ``context_id`` ended here. Before a message
        that would be recorded is framed (a user function's request, tensors
        that require grad): its receiver would make state that no release
        reaches (a function that called on after its context was released)."""
        if self.table.released(context_id):
            raise RuntimeError(RELEASED)

    def on_send(
        self, context_id: int, peer: WorkerInfo, key: MessageKey, tensors: list[torch.Tensor]
    ) -> None:
        """A message in the context to ``peer``, with ``tensors`` that require
        grad, or none (a user function's request): the callee is a participant."""
        context = self.table.get_or_create(context_id)
        if context is None:  # released since ``check`` passed: nobody will ask for it
            return
        if tensors:
            context.record_send(key, peer, tensors)
        else:
            context.enroll(peer)

    def tensor_hook(
        self, context_id: int, peer: WorkerInfo, key: MessageKey, enroll: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook that makes each tensor of ``peer``'s message that requires
        grad a recv node's output. With ``enroll`` (a user function's request),
        the context is made here now and the caller recorded, whatever the
        message holds: the function runs in the context."""
        if enroll:
            context = self.table.get_or_create(context_id)
            if context is not None:
                context.enroll(peer)
        index = 0

        def receive(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal index
            if index == 0:
                context = self.table.get_or_create(context_id)
                if context is None:  # a late message of a released context
                    return tensor.requires_grad_()
                context.record_recv(key, peer)
            index += 1
            return self._receive(context_id, key, index - 1, peer, tensor)

        return receive
