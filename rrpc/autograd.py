"""Distributed autograd: ``context``, ``backward``, ``get_gradients``, as in torch.

Theory of operation

- Forward. ``with context() as ctx_id:`` sets the thread's context id, which
  every RPC from the thread carries (the agent sets it on the callee while the
  request runs, so nested calls and the reply carry it too). A user function's
  request in a context (a call, ``remote()``, ``to_here()``) makes each end the
  other's participant whatever it holds, and the callee's context exists while
  the function runs (as torch's forceGradRecording): it may run ``backward``
  there, or call on, and the release must reach it. When a message in
  a context holds tensors that require grad, the agent tells us
  (``Hooks.on_send``): the sender records them under the message's key. The
  receiver gets each such tensor through ``Hooks.tensor_hook`` and hands the
  user the output of a ``RecvRpc`` node instead: a tensor that requires grad,
  whose ``grad_fn`` knows the context, the message key, the tensor's index in
  the message and the sender. Tensors that do not require grad cost nothing.
- Backward. ``backward(ctx_id, roots)`` runs a *local pass* from the roots: one
  ``torch.autograd.backward(inputs=...)`` call whose inputs are the leaves and
  the recv nodes reachable from the roots (found by walking
  ``grad_fn.next_functions``); it runs the leaves' AccumulateGrad hooks, so DDP
  averages gradients as usual (see ``_gradients``). Leaf
  gradients accumulate in the context. DDP writes a bucket's average into
  each of its parameters once the last one is ready, which may be in a later
  pass on this worker than the one that reached the others: what a pass
  writes into the ``.grad`` of a leaf an earlier pass of the context reached
  replaces that leaf's gradient in the context (torch's DDP does the same to
  torch's context). The gradients that reached recv nodes go,
  one AUTOGRAD_BACKWARD message per message key, to the senders; each sender
  runs a local pass from the tensors of its send record, which may reach its
  own recv nodes: further hops. A worker answers an AUTOGRAD_BACKWARD only when
  its own hops have answered (a ``Deferred`` reply: no pool thread waits), so
  when the root's messages are answered the whole distributed pass is done.
  An error anywhere (an exception, a dead worker, a timeout, each bounded by
  the RPC timeout) fails the reply chain back to the root, where ``backward``
  raises it.
- A recv node runs in a local pass because it has a *dummy* input: an empty
  leaf, which the pass names among its ``inputs``. The node's
  backward keeps the gradient it is given on the node (``grad_to_send``) and
  gives the dummy none; the pass takes it from there. So the gradient goes
  out as it came: the expanded view a ``sum()`` hands back travels as its one
  element (as in torch), where an AccumulateGrad into the dummy would have
  copied it into a dense tensor. In-place ops on the received tensor (allowed,
  as in torch) change nothing.
- Graphs are retained until the context ends (every local pass runs with
  ``retain_graph=True``): a worker may run several passes over shared parts of
  its graph (gradients arriving for several of its send records, or the same
  one twice), and each pass adds its share, which sums to the right gradient
  because backward is linear. Two ``backward`` calls in one context therefore
  accumulate, as with ``retain_graph=True`` in torch; with
  ``retain_graph=False`` torch would refuse the second call, rrpc runs it.
  The cost: tensors saved for backward live until the block ends, not until
  ``backward`` returns.
- Release. Leaving the ``with`` block drops the context here and sends
  AUTOGRAD_RELEASE to every participant, which drops it and forwards the
  release to its own participants. It does not wait for the answers (as in
  torch); ``_wait_releases()`` does, for tests. Releases are gathered into
  one message per participant: ``rrpc/autograd_release.py``. A function
  still running when its context's release came cannot call on, or reply
  with tensors that require grad, in it: that raises, as in torch, since the
  state it would make on the receiver is out of every release's reach.
- One run's state (the context table, the releases under way) lives in the
  ``Autograd`` service that ``init_rpc`` builds (``rrpc/worker.py``); the
  functions above find it through the current agent.

Differences from torch: a send record whose gradient never comes back does not
make ``backward`` hang (torch's FAST mode waits for it); a worker without
gradients for a context gives the optimizer no gradients instead of an error.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from rrpc import agent as agent_module
from rrpc import tensors
from rrpc.agent import Agent
from rrpc.autograd_context import Context, ContextTable, Hooks
from rrpc.autograd_release import Releases
from rrpc.dispatch import Deferred
from rrpc.futures import all_of
from rrpc.messages import (
    AUTOGRAD_BACKWARD,
    MessageKey,
    WorkerInfo,
    thread_state,
)
from rrpc.profiling import Profiling

try:  # what torch.autograd.backward runs once it has checked its arguments
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # another torch: the public function
    _engine_run_backward = None  # type: ignore[assignment]

__all__ = ["backward", "context", "get_gradients", "is_available"]


def _service() -> Autograd:
    agent = agent_module._current
    if agent is None or agent.autograd is None:
        raise RuntimeError("distributed autograd needs rrpc: call rrpc.init_rpc() first")
    return agent.autograd


def _contexts() -> ContextTable:
    return _service().table


# -- The public API ------------------------------------------------------------
def is_available() -> bool:
    """Always True: rrpc always has distributed autograd (as torch's ``is_available``)."""
    return True


class context:
    """Context manager of a distributed autograd pass; ``__enter__`` returns its id.

    Every RPC made from this thread inside the block carries the id, so that the
    tensors it sends and receives are recorded for ``backward``. Leaving the block
    frees the context's state on every worker that took part. Contexts on
    different threads are independent; one thread has one at a time.

    Example::

        with rrpc.autograd.context() as context_id:
            t1 = torch.rand((3, 3), requires_grad=True)
            t2 = torch.rand((3, 3), requires_grad=True)
            loss = rrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
            rrpc.autograd.backward(context_id, [loss])
            grads = rrpc.autograd.get_gradients(context_id)  # {t1: ones, t2: ones}
    """

    def __enter__(self) -> int:
        if thread_state.autograd_context_id:
            raise RuntimeError(
                "Already have an autograd context id for this thread "
                f"({thread_state.autograd_context_id}): contexts do not nest"
            )
        self._context_id = _contexts().create().context_id
        thread_state.autograd_context_id = self._context_id
        return self._context_id

    def __exit__(self, *exc_info: object) -> None:
        thread_state.autograd_context_id = 0
        agent = agent_module._current
        if agent is not None and agent.autograd is not None:  # else: shut down inside the block
            agent.autograd.releases.release(self._context_id)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from scalar ``roots`` in ``context_id``.

    The local graph runs from the roots; gradients that reach tensors received
    by RPC go back to their senders, which continue there, across any number of
    hops. Returns when the whole pass is done on every worker that took part;
    the gradients of leaf tensors are then in ``get_gradients(context_id)`` on
    each worker (never in ``.grad``). Raises the first error of any worker, or
    ``rrpc.PeerUnavailableError`` / ``rrpc.RpcTimeoutError`` if one died or
    did not answer within the RPC timeout.

    Args:
        context_id: the id ``context()`` returned.
        roots: scalar tensors that require grad (typically one loss).
        retain_graph: accepted for compatibility: graphs are kept until the
            context ends, so calling ``backward`` twice in one context always
            accumulates (torch needs ``retain_graph=True`` for that).

    Example::

        with rrpc.autograd.context() as context_id:
            loss = model_rref.rpc_sync().forward(x).sum()
            rrpc.autograd.backward(context_id, [loss])
    """
    if not isinstance(context_id, int) or isinstance(context_id, bool):
        raise TypeError(
            "incompatible function arguments: context_id must be an int, "
            f"not {type(context_id).__name__}"
        )
    if isinstance(roots, torch.Tensor) or not isinstance(roots, Sequence):
        raise TypeError(
            "incompatible function arguments: roots must be a list of tensors, "
            f"not {type(roots).__name__}"
        )
    service = _service()
    context = service.table.get(context_id)  # as torch: the context first, then the roots
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for index, root in enumerate(roots):
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"roots[{index}] is a {type(root).__name__}, not a tensor")
        if not root.requires_grad:
            raise RuntimeError(f"requires_grad not set on roots[{index}]")
        if root.numel() != 1:
            raise RuntimeError(
                f"roots[{index}] of shape {tuple(root.shape)} is not a scalar, "
                "all roots need to be scalar"
            )
        if root.grad_fn is None:
            raise RuntimeError(f"roots[{index}] does not have a valid gradient function")
    with service.profiling.backward_pass(context_id):  # an event, when this thread profiles
        hops = _local_pass(
            service.agent, context, roots, [torch.ones_like(root) for root in roots], lead=True
        )
        if len(hops) == 1:  # a SyncReply: this thread may read its own reply (a lane)
            hops[0].wait()
        elif hops:
            all_of(hops).wait()  # a hop's error names its node already


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's leaf gradients in ``context_id``: ``{tensor: gradient}``.

    Example::

        with rrpc.autograd.context() as context_id:
            t = torch.rand(3, requires_grad=True)
            loss = rrpc.rpc_sync("worker1", torch.mul, args=(t, 2)).sum()
            rrpc.autograd.backward(context_id, [loss])
            rrpc.autograd.get_gradients(context_id)[t]  # tensor([2., 2., 2.])
    """
    return _contexts().get(context_id).gradients_copy()


def _is_valid_context(context_id: int) -> None:
    """Raise if ``context_id`` is not alive on this worker (as torch's helper)."""
    _contexts().get(context_id)


def _gradients_if_any(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """As ``get_gradients``, but empty where no gradient ever reached this worker."""
    context = _contexts().find(context_id)
    return {} if context is None else context.gradients_copy()


def _debug_info() -> dict[str, int]:
    """Counts of this worker's live autograd state; all zero when nothing leaks."""
    return _service().debug_info()


def _wait_releases(timeout: float) -> bool:
    """Wait until the releases this worker started are done everywhere. False on timeout."""
    return _service().releases.wait(timeout)


# -- Recv nodes and the local pass ---------------------------------------------
class RecvRpc(torch.autograd.Function):
    """The recv node of a tensor received in a context (torch's ``RecvRpcBackward``).

    Its ``grad_fn`` carries ``context_id``, ``key`` (the message), ``index`` (the
    tensor's place in the message) and ``peer`` (who sent it); a local pass
    takes the node's gradient from ``grad_to_send``. ``dummy`` is the leaf
    that makes the pass run the node.
    """

    @staticmethod
    def forward(
        ctx: Any,
        dummy: torch.Tensor,
        tensor: torch.Tensor,
        context_id: int,
        key: MessageKey,
        index: int,
        peer: WorkerInfo,
    ) -> torch.Tensor:
        ctx.context_id, ctx.key, ctx.index, ctx.peer = context_id, key, index, peer
        # A new tensor over the same memory: neither the input returned as-is
        # nor a view, either of which would forbid in-place ops on the result.
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        # For the local pass to send, as it is (see the module doc); a pass
        # runs a node once, and passes on a worker run one at a time (grad_lock).
        ctx.grad_to_send = grad
        return None, None, None, None, None, None


_RecvNode = RecvRpc._backward_cls
# ``Function.apply`` without its Python layer (setup_context binding, functorch
# unwrapping: neither applies to a tensor just decoded), a hundred bytecodes
# less per tensor received in a context.
_apply_recv = super(torch.autograd.Function, RecvRpc).apply


def _receive(context_id: int, key: MessageKey, index: int, peer: WorkerInfo, tensor: torch.Tensor):
    dummy = torch.empty(0, requires_grad=True)  # never given a gradient: any shape will do
    if torch.is_grad_enabled():
        return _apply_recv(dummy, tensor, context_id, key, index, peer)
    with torch.enable_grad():  # decoding may run on a thread in no_grad mode
        return _apply_recv(dummy, tensor, context_id, key, index, peer)


def _reachable(outputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
    """The leaves and recv nodes a pass from ``outputs`` reaches, stopping at recv nodes."""
    leaves: dict[int, torch.Tensor] = {}
    recv_nodes: list[Any] = []
    seen: set[Any] = set()
    stack: list[Any] = []
    for output in outputs:
        if output.grad_fn is None:
            leaves[id(output)] = output  # a leaf sent as is
        else:
            stack.append(output.grad_fn)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, _RecvNode):
            recv_nodes.append(node)
        elif type(node).__name__ == "AccumulateGrad":
            leaves[id(node.variable)] = node.variable
        else:
            stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return list(leaves.values()), recv_nodes


# Held by whoever borrows parameters' .grad on this worker: local passes here,
# DistributedOptimizer steps in optim.py. One at a time, or one would see the other's.
grad_lock = threading.Lock()


def _gradients(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor],
    leaves: list[torch.Tensor],
    recv_nodes: list[Any],
    earlier: Sequence[torch.Tensor] = (),
) -> tuple[list[torch.Tensor | None], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The gradients of ``leaves`` and then of ``recv_nodes`` from ``outputs``,
    leaving the leaves' ``.grad`` as it was, and the gradients the pass wrote
    for ``earlier`` leaves (not among ``leaves``).

    Not ``torch.autograd.grad``: that skips the inputs' AccumulateGrad nodes,
    and with them the hooks on those nodes, which is where DDP's reducer
    averages gradients across replicas. ``backward(inputs=...)`` runs them
    (DDP's final callback included); the ``.grad`` it fills is moved out and
    the previous one put back, so gradients still land only in the context.

    ``earlier``: leaves whose gradients an earlier pass of the context took.
    Their ``.grad`` is borrowed too (None during the pass): DDP's final
    callback writes a bucket's average into every parameter of the bucket,
    and a bucket may span parameters that earlier passes reached.
    """
    dummies = [node.next_functions[0][0].variable for node in recv_nodes]
    with grad_lock:
        borrowed = [*leaves, *earlier]
        saved = [tensor.grad for tensor in borrowed]
        try:
            for tensor in borrowed:
                tensor.grad = None
            for node in recv_nodes:
                node.grad_to_send = None
            _run_backward(outputs, grads, leaves + dummies)
            rewritten: list[tuple[torch.Tensor, torch.Tensor]] = []
            for leaf in earlier:
                if leaf.grad is not None:
                    rewritten.append((leaf, leaf.grad))
            return [tensor.grad for tensor in leaves] + [
                node.grad_to_send for node in recv_nodes
            ], rewritten
        finally:
            for tensor, grad in zip(borrowed, saved, strict=True):
                tensor.grad = grad
            for node in recv_nodes:
                node.grad_to_send = None  # the graph outlives the pass


def _run_backward(
    outputs: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor]
) -> None:
    """``torch.autograd.backward(outputs, grads, retain_graph=True, inputs=inputs)``
    without its argument checks, which ours are (the engine still checks each
    gradient's shape against its output's): about 300 bytecodes a pass."""
    if _engine_run_backward is None:
        torch.autograd.backward(outputs, grads, retain_graph=True, inputs=inputs)
    else:  # retain_graph, not create_graph
        args = (tuple(outputs), tuple(grads), True, False, tuple(inputs))
        _engine_run_backward(*args, allow_unreachable=True, accumulate_grad=True)


def _local_pass(
    agent: Agent,
    context: Context,
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor],
    lead: bool = False,
) -> list[Any]:
    """Backpropagate ``grads`` from ``outputs`` through this worker's graph.

    Leaf gradients accumulate in ``context``; the gradients that reached recv
    nodes are sent to their senders. Returns the futures of those messages;
    with ``lead`` (the caller blocks for them at once), a lone message's is a
    ``SyncReply``, whose waiting thread reads its own reply on a lane.
    """
    leaves, recv_nodes = _reachable(outputs)
    if not leaves and not recv_nodes:
        return []
    inputs_here = {id(tensor) for tensor in leaves}
    earlier = [leaf for leaf in context.gradient_leaves() if id(leaf) not in inputs_here]
    try:
        results, rewritten = _gradients(outputs, grads, leaves, recv_nodes, earlier)
    except Exception as exc:
        # As torch: the error names the worker where the pass failed, once,
        # however many hops it travels back.
        raise RuntimeError(f"Error on Node {agent.info.id}: {exc}") from exc
    for leaf, average in rewritten:  # as DDP in torch's context: the average replaces
        context.replace(leaf, average)
    for leaf, grad in zip(leaves, results[: len(leaves)], strict=True):
        if grad is not None:
            context.accumulate(leaf, grad)
    # One message per (context, message key): {tensor index: gradient, taken
    # apart (``tensors.take_apart``: no tensor for the pickler to call back on)}.
    outgoing: dict[tuple[int, MessageKey], tuple[WorkerInfo, dict[int, Any]]] = {}
    for node, grad in zip(recv_nodes, results[len(leaves) :], strict=True):
        if grad is not None:
            peer, by_index = outgoing.setdefault((node.context_id, node.key), (node.peer, {}))
            by_index[node.index] = tensors.take_apart(grad)
    timeout = agent.options.rpc_timeout
    sync = lead and len(outgoing) == 1
    return [
        agent.send(
            peer,
            AUTOGRAD_BACKWARD,
            (context_id, key, by_index),
            timeout,
            f"distributed backward pass (context {context_id})",
            sync,
        )
        for (context_id, key), (peer, by_index) in outgoing.items()
    ]


# -- One run ---------------------------------------------------------------------
class Autograd:
    """Distributed autograd's part of one run: the context table, the
    handler of AUTOGRAD_BACKWARD (``serve_backward``) and the contexts'
    releases (``releases``: ``autograd_release.Releases``, which serves
    AUTOGRAD_RELEASE). ``hooks`` is what the agent calls for messages in a
    context (``agent.autograd_hooks``)."""

    def __init__(self, agent: Agent, profiling: Profiling):
        self.agent = agent
        self.profiling = profiling  # backward passes are events when they run under a profile
        # Ids past those of this rank's earlier incarnations (a rejoin), which peers may hold.
        self.table = ContextTable(agent.info.id, first=1 + (agent.incarnation << 32))
        self.hooks = Hooks(self.table, _receive)
        self.releases = Releases(agent, self.table)

    def serve_backward(self, payload: tuple, caller: WorkerInfo) -> Any:
        """Gradients for one of our send records: run the rest of the pass here."""
        context_id, key, by_index = payload
        context = self.table.get(context_id)
        sent = context.sent_tensors(key)
        outputs = [sent[index] for index in by_index]
        grads = [_arrived(by_index[index], sent[index]) for index in by_index]
        with self.profiling.send_function_pass(context_id):  # profiled if its backward is
            hops = _local_pass(self.agent, context, outputs, grads)
        return Deferred(all_of(hops)) if hops else None

    def debug_info(self) -> dict[str, int]:
        info = self.table.debug_info()
        info["pending_releases"] = self.releases.pending()
        return info

    def stop(self) -> None:
        """The run is over (the agent stopped): forget every context."""
        self.table.clear()
        self.releases.stop()


def _arrived(parts: Any, output: torch.Tensor) -> torch.Tensor:
    """A gradient from a peer (``tensors.take_apart``'s parts), as a pass
    from ``output`` takes it: of the output's shape (checked before anything
    is allocated for it), on the output's device (tensors travel on the CPU)
    and, if strided, contiguous: one that came as a view (a sum's, expanded)
    would slow the pass's kernels (a Linear's backward on 32 x 512: 416 -> 488 µs)."""
    grad = tensors.put_together(parts)
    if grad.shape != output.shape:
        raise ValueError(
            f"a gradient of shape {tuple(grad.shape)} came for a tensor of shape "
            f"{tuple(output.shape)}"
        )
    grad = grad.to(output.device)
    return grad.contiguous() if grad.layout is torch.strided else grad
