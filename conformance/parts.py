"""The user-facing parts of torch's tests that are otherwise not applicable, run on both frameworks.

Some of torch's tests mix what a user can do (``to_here()`` after
``shutdown()``, a failed RRef passed as an argument, the values of calls made
inside an autograd context) with checks of torch's internals (its C++ autograd
context objects, its RPC pickler). ``not_applicable.py`` lists such a test
with the reason its internal part does not apply, and names the test here
that runs its user-facing part. Each test here is written as torch's are
(its fixture, ``dist_init``, its helpers), names the torch test it comes from,
and runs in the same suite, on torch (the control) and on rrpc: a behaviour
torch does not have fails on torch and is reported as environment-broken, not
silently assumed.

What a test here checks instead of an internal object is a user's way of
seeing the same thing: ``dist_autograd._is_valid_context`` (mapped by the
shim, as a private helper with a user-facing meaning; it raises for a context
the worker does not have) for "every worker forgot the context",
``get_gradients`` for "the context is gone".
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.autograd import Function
from torch.testing._internal import dist_utils
from torch.testing._internal.common_distributed import tp_transports
from torch.testing._internal.dist_utils import (
    dist_init,
    initialize_pg,
    wait_until_pending_futures_and_users_flushed,
    worker_name,
)
from torch.testing._internal.distributed.nn.api.remote_module_test import (
    CommonRemoteModuleTest,
    ModuleCreationMode,
)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (
    build_sparse_tensor,
    my_py_nested_call,
    my_scalar_add,
)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture
from torch.testing._internal.distributed.rpc.rpc_test import (
    add_rref_to_value,
    foo_add,
    my_sleep_func,
)

CLEANUP_TIMEOUT = 10.0  # seconds every worker has to forget a context that ended


def _knows_context(context_id: int) -> bool:
    """Whether this worker still has the context (torch's ``_is_valid_context``
    raises for one it does not have)."""
    try:
        dist_autograd._is_valid_context(context_id)
    except RuntimeError as error:
        if "Could not find autograd context with id" in str(error):
            return False
        raise
    return True


class _Parts(RpcAgentTestFixture):
    def _next_rank(self, step: int = 1) -> int:
        return (self.rank + step) % self.world_size

    def _assert_forgotten_everywhere(self, context_id: int) -> None:
        """Every worker forgets ``context_id`` (torch's tests read its C++
        context table for this: ``_retrieve_context`` raises)."""
        deadline = time.monotonic() + CLEANUP_TIMEOUT
        for rank in range(self.world_size):
            while rpc.rpc_sync(worker_name(rank), _knows_context, args=(context_id,)):
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker{rank} still knows context {context_id}")
                time.sleep(0.05)  # polling a condition with a deadline, as torch's helper does


class RpcParts(_Parts):
    @dist_init(setup_rpc=False)
    def test_use_rref_after_shutdown(self):
        # RpcTest.test_use_rref_after_shutdown without rpc.internal.serialize(rref)
        rpc.init_rpc(
            name=f"worker{self.rank:d}",
            backend=self.rpc_backend,
            rank=self.rank,
            world_size=self.world_size,
            rpc_backend_options=self.rpc_backend_options,
        )
        n = self.rank + 1
        rref = rpc.remote(
            worker_name(self._next_rank()), torch.add, args=(torch.ones(n, n), torch.ones(n, n))
        )
        rpc.shutdown(graceful=True)  # deletes the local UserRRefs
        with self.assertRaisesRegex(
            RuntimeError, "Cannot call to_here\\(\\) on it after deletion."
        ):
            rref.to_here()

    @dist_init
    def test_rref_get_future(self):
        # RpcTest.test_rref_get_future without its TorchScript case
        if self.rank == 0:
            rref = rpc.remote(worker_name(1), torch.add, args=(1, 1))
            rref.to_here()
            self.assertIsInstance(rref._get_future(), torch._C.Future)
            rref = rpc.remote(worker_name(1), foo_add, args=())
            rref.to_here()
            self.assertIsInstance(rref._get_future(), torch._C.Future)

    @dist_init(setup_rpc=False)
    def test_duplicate_name(self):
        # RpcTest.test_duplicate_name through init_rpc, not torch's _init_rpc_backend
        with self.assertRaisesRegex(RuntimeError, "is not unique"):
            rpc.init_rpc(
                name="duplicate_name",
                backend=self.rpc_backend,
                rank=self.rank,
                world_size=self.world_size,
                rpc_backend_options=self.rpc_backend_options,
            )

    @dist_init(setup_rpc=False)
    def test_infer_backend_from_options(self):
        # TensorPipeAgentRpcTest.test_infer_backend_from_options, with a call
        # where it checks the type of torch's C++ agent
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=self.init_method, _transports=tp_transports()
        )
        rpc.init_rpc(
            name=worker_name(self.rank),
            rank=self.rank,
            world_size=self.world_size,
            rpc_backend_options=options,  # no backend: inferred from the options
        )
        result = rpc.rpc_sync(worker_name(self._next_rank()), torch.add, args=(torch.ones(2), 1))
        self.assertEqual(result, torch.ones(2) + 1)
        rpc.shutdown()


class _IdentityFunc(Function):
    """DistAutogradTest.TestDebugInfoFunc without its read of torch's debug counters."""

    @staticmethod
    def forward(ctx, input):
        return input

    @staticmethod
    def backward(ctx, input):
        return input


class DistAutogradParts(_Parts):
    @dist_init
    def test_autograd_context(self):
        # DistAutogradTest.test_autograd_context without _get_max_id and _retrieve_context
        context_ids = []
        for _ in range(200):
            with dist_autograd.context() as context_id:
                self.assertEqual(self.worker_id, context_id >> 48)  # its first 16 bits
                context_ids.append(context_id)
        self.assertEqual(len(set(context_ids)), 200)
        for context_id in context_ids:
            with self.assertRaisesRegex(
                RuntimeError, f"Could not find autograd context with id: {context_id}"
            ):
                dist_autograd.get_gradients(context_id)

    @dist_init
    def test_clean_context_during_backward(self):
        # DistAutogradTest.test_clean_context_during_backward without
        # _new_context: backward with a context id that does not exist
        with dist_autograd.context():
            t1 = torch.rand((3, 3), requires_grad=True)
            for step in range(1, 10):
                t1 = rpc.rpc_sync(worker_name(self._next_rank(step)), torch.add, args=(t1, t1))
            with self.assertRaisesRegex(
                RuntimeError, "Could not find autograd context with id: 100"
            ):
                dist_autograd.backward(100, [t1.sum()])

    @dist_init
    def test_debug_info(self):
        # DistAutogradTest.test_debug_info without dist_autograd._get_debug_info:
        # a backward through every worker, a custom Function in the middle
        initialize_pg(self.file_init_method, self.rank, self.world_size)
        t1 = torch.rand((3, 3), requires_grad=True)
        t2 = torch.rand((3, 3), requires_grad=True)
        with dist_autograd.context() as context_id:
            result = t1
            for rank in range(self.world_size):
                if rank != self.rank:
                    result = rpc.rpc_sync(worker_name(rank), torch.add, args=(result, t2))
            result = _IdentityFunc.apply(result)
            for rank in range(self.world_size):
                if rank != self.rank:
                    result = rpc.rpc_sync(worker_name(rank), torch.add, args=(result, t2))
            dist_autograd.backward(context_id, [result.sum()])
            grads = dist_autograd.get_gradients(context_id)
            self.assertEqual(grads[t1], torch.ones(3, 3))
            self.assertEqual(grads[t2], torch.full((3, 3), 2.0 * (self.world_size - 1)))
        dist.barrier()
        self._assert_forgotten_everywhere(context_id)

    def _context_cleanup(self, rpc_args, func, nested=False):
        # DistAutogradTest.context_cleanup_test_helper, seen through _is_valid_context
        # where it reads torch's C++ context table (_retrieve_context)
        dst_ranks = (
            {self._next_rank()}
            if nested
            else {rank for rank in range(self.world_size) if rank != self.rank}
        )
        with dist_autograd.context() as context_id:
            for dst_rank in dst_ranks:
                rpc.rpc_sync(worker_name(dst_rank), func, args=rpc_args)
        self._assert_forgotten_everywhere(context_id)

    @dist_init
    def test_context_cleanup_no_tensors(self):
        self._context_cleanup(rpc_args=(1, 1), func=my_scalar_add)

    @dist_init
    def test_context_cleanup_tensor_no_grad(self):
        t1 = torch.ones(3, 3, requires_grad=False)
        self._context_cleanup(rpc_args=(t1, t1), func=torch.add)

    @dist_init
    def test_context_cleanup_tensor_with_grad(self):
        t1 = torch.ones(3, 3, requires_grad=True)
        t2 = torch.zeros(3, 3, requires_grad=True)
        self._context_cleanup(rpc_args=(t1, t2), func=torch.add)

    @dist_init
    def test_context_cleanup_nested_rpc(self):
        t1 = torch.ones(3, 3, requires_grad=True)
        t2 = torch.zeros(3, 3, requires_grad=True)
        args = (t1, t2, self._next_rank(), self.world_size, 0)
        self._context_cleanup(rpc_args=args, func=my_py_nested_call, nested=True)

    @dist_init
    def test_context_cleanup_tensor_no_grad_sparse(self):
        t1 = build_sparse_tensor(requires_grad=False)
        self._context_cleanup(rpc_args=(t1, t1), func=torch.add)

    @dist_init
    def test_context_cleanup_tensor_with_grad_sparse(self):
        t1 = build_sparse_tensor(requires_grad=True)
        t2 = build_sparse_tensor(requires_grad=True)
        self._context_cleanup(rpc_args=(t1, t2), func=torch.add)

    @dist_init
    def test_context_cleanup_nested_rpc_sparse(self):
        t1 = build_sparse_tensor(requires_grad=True)
        t2 = build_sparse_tensor(requires_grad=True)
        args = (t1, t2, self._next_rank(), self.world_size, 0)
        self._context_cleanup(rpc_args=args, func=my_py_nested_call, nested=True)

    def _complex_args(self, remote: bool, sparse: bool):
        # DistAutogradTest._test_rpc_complex_args without its read of the
        # context's send functions and known worker ids
        with dist_autograd.context() as context_id:
            tensors = [
                build_sparse_tensor(requires_grad=i % 2 == 0)
                if sparse
                else torch.ones(3, 3, requires_grad=i % 2 == 0)
                for i in range(10)
            ]
            dst = worker_name(self._next_rank())
            if remote:
                ret = rpc.remote(dst, torch.stack, args=(tensors,)).to_here()
            else:
                ret = rpc.rpc_sync(dst, torch.stack, args=(tensors,))
            self.assertEqual(torch.stack(tensors), ret)
            loss = torch.sparse.sum(ret) if sparse else ret.sum()
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            # the tensors that require grad, and only they, get a gradient
            self.assertEqual(len(grads), 5)
            for i, tensor in enumerate(tensors):
                self.assertEqual(tensor in grads, i % 2 == 0)

    @dist_init
    def test_rpc_complex_args(self):
        self._complex_args(remote=False, sparse=False)

    @dist_init
    def test_remote_complex_args(self):
        self._complex_args(remote=True, sparse=False)

    @dist_init
    def test_rpc_complex_args_sparse(self):
        self._complex_args(remote=False, sparse=True)

    @dist_init
    def test_remote_complex_args_sparse(self):
        self._complex_args(remote=True, sparse=True)


class FaultyAgentRpcParts(RpcAgentTestFixture):
    def _remote_message_dropped_pickle(self, dst=None):
        # FaultyAgentRpcTest._test_remote_message_dropped_pickle without
        # rref._serialize(): the RRef of a dropped remote() passed as an argument
        if self.rank != 0:
            return
        dst_rank = dst if dst is not None else (self.rank + 1) % self.world_size
        dst_worker = f"worker{dst_rank}"
        rref = rpc.remote(dst_worker, my_sleep_func, args=(1,))
        wait_until_pending_futures_and_users_flushed()
        with self.assertRaisesRegex(RuntimeError, "RRef creation"):
            rpc.rpc_async(dst_worker, add_rref_to_value, args=(rref, 1))

    @dist_init(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_remote_message_dropped_pickle(self):
        self._remote_message_dropped_pickle()

    @dist_init(faulty_messages=["PYTHON_REMOTE_CALL"])
    def test_remote_message_dropped_pickle_to_self(self):
        self._remote_message_dropped_pickle(self.rank)


class FaultyAgentDistAutogradParts(_Parts):
    # No faulty_messages: every retryable message (the context release among
    # them) fails num_fail_sends times first, as in torch's test.
    @dist_init
    def test_context_cleanup_tensor_with_grad(self):
        # FaultyAgentDistAutogradTest.test_context_cleanup_tensor_with_grad,
        # seen through _is_valid_context where it reads _retrieve_context
        t1 = torch.ones(3, 3, requires_grad=True)
        t2 = torch.zeros(3, 3, requires_grad=True)
        with dist_autograd.context() as context_id:
            for rank in range(self.world_size):
                if rank != self.rank:
                    rpc.rpc_sync(worker_name(rank), torch.add, args=(t1, t2))
        self._assert_forgotten_everywhere(context_id)


class RemoteModuleParts(CommonRemoteModuleTest):
    def _forward(self, call):
        # RemoteModuleTest.test_forward_sync / test_forward_async in the plain
        # creation mode, without the scripted one
        if self.rank != 0:
            return
        dst_worker_name = dist_utils.worker_name((self.rank + 1) % self.world_size)
        args = (torch.ones(1), 2, "3")
        modes = [ModuleCreationMode.MODULE_CTOR]
        for remote_module in self._create_remote_module_iter(dst_worker_name, modes=modes):
            self.assertEqual(call(remote_module, args), tuple(reversed(args)))

    @dist_utils.dist_init
    def test_forward_sync(self):
        self._forward(lambda module, args: module.forward(*args))

    @dist_utils.dist_init
    def test_forward_async(self):
        self._forward(lambda module, args: module.forward_async(*args).wait())
