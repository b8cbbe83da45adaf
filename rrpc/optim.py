"""``DistributedOptimizer``: parameters on many workers, stepped with a context's gradients.

As ``torch.distributed.optim``'s: one local optimizer per parameter owner,
stepped with the gradients of a distributed autograd context.

Theory of operation
- The constructor groups the parameter RRefs by owner and asks each owner, in
  parallel, to build a ``_LocalOptimizer`` over its own parameters (the values
  of those RRefs, not copies); each answers with an RRef to it. An optimizer
  whose constructor raises makes the constructor raise, with that error.
- ``step(context_id)`` asks every owner, in parallel, to step its local
  optimizer with that worker's gradients in the context (``get_gradients``)
  and waits for all of them; the first error is raised once all have answered.
  A step names the local optimizer by a number the owner gave it, not by its
  RRef: passing an RRef to its owner costs an extra ACCEPT exchange per call
  (the RRef, held here, is what keeps the local optimizer alive there).
- Parameters may be shared by several trainers' optimizers (data-parallel
  trainers over one model): on each worker one lock (``autograd.grad_lock``,
  also held by backward passes, which borrow ``.grad`` and may have saved a
  parameter a step changes in place) serialises steps, so one step never
  runs with another's gradients. As in torch, steps of different trainers
  interleave in any order.
- The step takes the gradients as a list where it can: for the optimizers
  torch ships a *functional* form of (``SGD``, ``Adam``, ``AdamW``,
  ``Adagrad``, ``Adadelta``, ``Adamax``, ``RMSprop``, ``Rprop``: torch's own
  ``DistributedOptimizer`` steps these), the local optimizer is that form,
  and ``step(gradients)`` applies the context's gradients with the same
  arithmetic (bit for bit) and none of ``torch.optim.Optimizer.step``'s
  layers (hooks, profiling, ``.grad``); their defaults are torch's
  ``DistributedOptimizer``'s too (``SGD``'s ``lr`` is 0.01 there, 0.001 in
  ``torch.optim.SGD``). Any other optimizer class, or
  arguments only the class itself takes, get the class: ``.grad`` is then
  only borrowed, each parameter's own ``.grad`` restored after the step, so
  the context's gradients are not kept alive by the parameters.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import defaultdict
from typing import Any

from rrpc import autograd, restricted
from rrpc.api import rpc_async, rpc_sync
from rrpc.futures import values_of
from rrpc.rref import RRef

__all__ = ["DistributedOptimizer"]


@functools.cache
def _functional_forms() -> dict[type, type]:
    """torch's functional optimizers by the class they stand for (none if this
    torch has none). Looked up when the first local optimizer is built: the
    package that holds them takes most of a second to import."""
    try:
        from torch.distributed.optim.utils import functional_optim_map
    except ImportError:  # pragma: no cover - a torch without torch.distributed
        return {}
    # Adagrad's zips the parameters with only the gradients there are, strictly:
    # a parameter without one in the context raised (torch runs it as TorchScript,
    # whose zip stops at the shorter list). Its class form steps right.
    from torch.optim import Adagrad

    return {cls: form for cls, form in functional_optim_map.items() if cls is not Adagrad}


class _LocalOptimizer:
    """On a parameter owner: ``optimizer_class`` over the parameters it owns,
    in its functional form where torch has one (see the module doc)."""

    # One per worker, shared with distributed backward passes: a step changes
    # parameters in place, which a pass may have saved for its gradients, and
    # the class form borrows .grad, as passes do.
    lock = autograd.grad_lock

    def __init__(self, optimizer_class: type, param_rrefs: list[RRef], *args: Any, **kwargs: Any):
        self.params = [rref.local_value() for rref in param_rrefs]
        self.functional = None
        functional = _functional_forms().get(optimizer_class)
        if functional is not None:
            try:
                self.functional = functional(self.params, *args, **kwargs)
            except TypeError:  # an argument only the class takes (``differentiable``, say)
                pass
        self.optimizer = (
            None if self.functional is not None else optimizer_class(self.params, *args, **kwargs)
        )

    def step(self, context_id: int) -> None:
        # A worker that got no gradient in this context steps with none (torch raises).
        gradients = autograd._gradients_if_any(context_id)
        if self.functional is not None:
            ordered = [gradients.get(param) for param in self.params]
            with _LocalOptimizer.lock:
                self.functional.step(ordered)
            return
        assert self.optimizer is not None
        with _LocalOptimizer.lock:
            own = [param.grad for param in self.params]
            for param in self.params:
                param.grad = gradients.get(param)
            try:
                self.optimizer.step()
            finally:
                for param, grad in zip(self.params, own, strict=True):
                    param.grad = grad


# This worker's local optimizers by number; each lives while its RRef does.
_local_optimizers: weakref.WeakValueDictionary[int, _LocalOptimizer] = weakref.WeakValueDictionary()
_numbers = itertools.count(1)


@restricted.allow_call
def _new_local_optimizer(
    optimizer_class: type, param_rrefs: list[RRef], *args: Any, **kwargs: Any
) -> tuple[RRef, int]:
    local = _LocalOptimizer(optimizer_class, param_rrefs, *args, **kwargs)
    number = next(_numbers)
    _local_optimizers[number] = local
    return RRef(local), number


@restricted.allow_call
def _local_optimizer_step(number: int, context_id: int) -> None:
    local = _local_optimizers.get(number)
    if local is None:
        raise RuntimeError(f"local optimizer {number} is gone: its DistributedOptimizer was freed")
    local.step(context_id)


class DistributedOptimizer:
    """Optimise parameters spread over workers with one local optimizer per owner.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` class (``SGD``, ``Adam``, ...)
            built on each worker that owns some of the parameters.
        params_rref: RRefs to the parameters (local or remote), e.g. from
            ``rrpc.remote`` or a module's ``parameter_rrefs()``-style helper.
        *args, **kwargs: passed to ``optimizer_class`` on each worker.

    ``step(context_id)`` applies the gradients that distributed autograd
    computed in that context (never ``.grad``). Concurrent steps from several
    trainers are serialised on each worker; as in torch, their order is not.

    Example::

        params = [rrpc.remote("worker1", make_weight), rrpc.remote("worker2", make_weight)]
        optimizer = rrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
        with rrpc.autograd.context() as context_id:
            loss = forward(x).sum()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    """

    def __init__(self, optimizer_class: type, params_rref: list[RRef], *args: Any, **kwargs: Any):
        by_owner: dict[Any, list[RRef]] = defaultdict(list)
        for rref in params_rref:
            by_owner[rref.owner()].append(rref)
        created: list[tuple[RRef, int]] = values_of(
            [
                rpc_async(
                    owner,
                    _new_local_optimizer,
                    args=(optimizer_class, rrefs, *args),
                    kwargs=kwargs,
                )
                for owner, rrefs in by_owner.items()
            ]
        )
        self.remote_optimizers: list[RRef] = [rref for rref, _ in created]
        self._numbers = [number for _, number in created]

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with its gradients in ``context_id``; wait for all."""
        autograd._is_valid_context(context_id)
        if len(self._numbers) == 1:  # one owner: a blocking call reads its own reply (a lane)
            rpc_sync(
                self.remote_optimizers[0].owner(),
                _local_optimizer_step,
                args=(self._numbers[0], context_id),
            )
            return
        values_of(
            [
                rpc_async(optimizer.owner(), _local_optimizer_step, args=(number, context_id))
                for optimizer, number in zip(self.remote_optimizers, self._numbers, strict=True)
            ]
        )
