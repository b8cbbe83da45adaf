"""Distributed autograd (rrpc.autograd) against the same computation in one process.

Each scenario runs on worker0 of a three-worker cluster shared by the dist tests
of the session (starting workers costs seconds; a scenario costs milliseconds). A
scenario computes the gradients twice, once across workers inside
``rrpc.autograd.context()`` and once locally with ``torch.autograd.grad``, and
returns both; the test compares them. After every test, every worker's
autograd tables must be empty again.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from types import SimpleNamespace

import numpy
import pytest
import torch

import rrpc
from harness import Cluster, free_port, mp_context, run_workers
from rrpc import autograd_release, tensors
from rrpc.autograd_context import RELEASED, ContextTable, Hooks
from rrpc.autograd_release import Releases
from rrpc.messages import AUTOGRAD_BACKWARD, WorkerInfo

ATOL = 1e-6


def assert_close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def assert_each_close(actual, expected, atol=ATOL):
    """Pairwise ``assert_close`` of two equally long lists."""
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, atol)


# -- A cluster kept up for the session (see harness.Cluster) --------------------
_shared: list[Cluster] = []


def shared_cluster(config) -> Cluster:
    """The three-worker cluster of the dist tests: started on first use, stopped
    when the session ends, replaced if a test broke it."""
    if not _shared or _shared[0].broken:
        cluster = Cluster(world_size=3)
        config.add_cleanup(cluster.close)
        _shared[:] = [cluster]
    return _shared[0]


@pytest.fixture
def cluster(request):
    return shared_cluster(request.config)


def _autograd_state_everywhere():
    assert rrpc.autograd._wait_releases(timeout=10), "context releases still pending after 10 s"
    return [rrpc.rpc_sync(f"worker{rank}", rrpc.autograd._debug_info) for rank in range(3)]


EMPTY = {"contexts": 0, "send_records": 0, "recv_records": 0, "gradients": 0, "pending_releases": 0}


@pytest.fixture
def no_state_left_behind(cluster):
    """After the test, every worker's autograd tables are empty."""
    yield
    assert cluster.run(_autograd_state_everywhere) == [EMPTY] * 3


# -- Helpers that run on the workers -------------------------------------------
_PARAMS: dict[str, torch.Tensor] = {}  # this worker's parameters, by name


def _param(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=generator) - 0.5).requires_grad_()


def _make_param(name, shape, seed):
    _PARAMS[name] = _param(shape, seed)


def _grad_of_param(context_id, name):
    """Read on the owner: the gradient of one of its parameters in context_id."""
    return rrpc.autograd.get_gradients(context_id).get(_PARAMS[name])


def _stage(x, name, then=None):
    """tanh(x @ P[name]); with ``then=(worker, name)``, continue on that worker."""
    h = torch.tanh(x @ _PARAMS[name])
    if then is not None:
        h = rrpc.rpc_sync(then[0], _stage, args=(h, then[1]))
    return h


def _stage_using_param_twice(x, name):
    w = _PARAMS[name]
    return torch.tanh(x @ w) @ w


def _inputs(*shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=generator).requires_grad_() for shape in shapes]


# -- Scenarios (run on worker0) ------------------------------------------------
def _one_hop():
    t1, t2 = _inputs((3, 3), (3, 3))
    with rrpc.autograd.context() as context_id:
        y = rrpc.rpc_sync("worker1", torch.mul, args=(t1, t2))
        loss = (y * t1).sum()  # t1 also used locally
        rrpc.autograd.backward(context_id, [loss])
        grads = rrpc.autograd.get_gradients(context_id)
        distributed = [grads[t1], grads[t2]]
        assert t1.grad is None and t2.grad is None, "gradients leaked into .grad"
    local = torch.autograd.grad(((t1 * t2) * t1).sum(), [t1, t2])
    return distributed, list(local)


def test_one_hop_gradients_equal_local_ones(cluster, no_state_left_behind):
    distributed, local = cluster.run(_one_hop)
    assert_each_close(distributed, local)


def _backward_bytes_sent():
    row = rrpc.stats("function").get("AUTOGRAD_BACKWARD")
    return row["tensor_bytes_sent"] if row else 0


def _sum_of_a_received_tensor():
    # A sum's gradient is one element expanded to the tensor's shape: it goes
    # back as that element, as torch sends it (not as 64 KiB of ones).
    (t,) = _inputs((128, 128))
    before = _backward_bytes_sent()
    with rrpc.autograd.context() as context_id:
        y = rrpc.rpc_sync("worker1", torch.mul, args=(t, 3.0))
        rrpc.autograd.backward(context_id, [y.sum()])
        grad = rrpc.autograd.get_gradients(context_id)[t]
    return grad, _backward_bytes_sent() - before


def test_the_expanded_gradient_of_a_sum_goes_back_as_one_element(cluster, no_state_left_behind):
    grad, sent = cluster.run(_sum_of_a_received_tensor)
    assert_close(grad, torch.full((128, 128), 3.0))
    assert sent == 4, f"{sent} tensor bytes sent for the gradient of a sum"


def _chain_over_three_workers():
    # worker0 -> worker1 -> worker2 and back: backward goes 0 -> 1 -> 2 -> 1 -> 0.
    rrpc.rpc_sync("worker1", _make_param, args=("chain1", (4, 5), 1))
    rrpc.rpc_sync("worker2", _make_param, args=("chain2", (5, 3), 2))
    (x,) = _inputs((2, 4))
    with rrpc.autograd.context() as context_id:
        out = rrpc.rpc_sync("worker1", _stage, args=(x, "chain1", ("worker2", "chain2")))
        loss = (out**2).sum()
        rrpc.autograd.backward(context_id, [loss])
        distributed = [
            rrpc.autograd.get_gradients(context_id)[x],
            rrpc.rpc_sync("worker1", _grad_of_param, args=(context_id, "chain1")),
            rrpc.rpc_sync("worker2", _grad_of_param, args=(context_id, "chain2")),
        ]
    w1, w2 = _param((4, 5), 1), _param((5, 3), 2)
    local = torch.autograd.grad((torch.tanh(torch.tanh(x @ w1) @ w2) ** 2).sum(), [x, w1, w2])
    return distributed, list(local)


def test_chain_over_three_workers_gradients_equal_local_ones(cluster, no_state_left_behind):
    distributed, local = cluster.run(_chain_over_three_workers)
    assert_each_close(distributed, local)


def _release_the_scheduler_is_sending():
    """What ``_wait_releases`` says while the scheduler's delayed flush has
    taken a release from the queue and not yet sent it, and once it is let go."""
    service = rrpc.agent.current_agent().autograd.releases
    taken, go = threading.Event(), threading.Event()
    real_send = service._send

    def held_on_the_scheduler(peer, releases):
        if threading.current_thread().name == "rrpc-scheduler":
            taken.set()
            go.wait(30)
        return real_send(peer, releases)

    service._send = held_on_the_scheduler
    try:
        with rrpc.autograd.context():
            rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2, requires_grad=True), 1))
        assert taken.wait(30), "the scheduler never flushed the release"
        while_taken = rrpc.autograd._wait_releases(timeout=0.2)
        go.set()
        return while_taken, rrpc.autograd._wait_releases(timeout=10)
    finally:
        go.set()
        service._send = real_send


def test_waiting_for_releases_waits_for_one_the_scheduler_is_sending(cluster, no_state_left_behind):
    # A clean-clone run caught it: the release was neither queued nor under
    # way, and the state check after the test found it pending.
    assert cluster.run(_release_the_scheduler_is_sending) == (False, True)


def _fan_out_fan_in():
    rrpc.rpc_sync("worker1", _make_param, args=("fan1", (4, 4), 3))
    rrpc.rpc_sync("worker2", _make_param, args=("fan2", (4, 4), 4))
    (x,) = _inputs((3, 4))
    with rrpc.autograd.context() as context_id:
        y1 = rrpc.rpc_async("worker1", _stage, args=(x, "fan1"))
        y2 = rrpc.rpc_async("worker2", _stage, args=(x, "fan2"))
        loss = (y1.wait() + y2.wait()).pow(2).sum()
        rrpc.autograd.backward(context_id, [loss])
        distributed = [
            rrpc.autograd.get_gradients(context_id)[x],
            rrpc.rpc_sync("worker1", _grad_of_param, args=(context_id, "fan1")),
            rrpc.rpc_sync("worker2", _grad_of_param, args=(context_id, "fan2")),
        ]
    w1, w2 = _param((4, 4), 3), _param((4, 4), 4)
    loss = (torch.tanh(x @ w1) + torch.tanh(x @ w2)).pow(2).sum()
    return distributed, list(torch.autograd.grad(loss, [x, w1, w2]))


def test_tensor_sent_to_two_workers_and_summed_gradients_equal_local_ones(
    cluster, no_state_left_behind
):
    distributed, local = cluster.run(_fan_out_fan_in)
    assert_each_close(distributed, local)


def _parameter_used_twice_on_one_worker():
    rrpc.rpc_sync("worker1", _make_param, args=("twice", (4, 4), 5))
    (x,) = _inputs((2, 4))
    with rrpc.autograd.context() as context_id:
        # Twice inside one call, and once more in a second call (a second send record).
        a = rrpc.rpc_sync("worker1", _stage_using_param_twice, args=(x, "twice"))
        b = rrpc.rpc_sync("worker1", _stage, args=(x * 2, "twice"))
        loss = (a * b).sum()
        rrpc.autograd.backward(context_id, [loss])
        distributed = [
            rrpc.autograd.get_gradients(context_id)[x],
            rrpc.rpc_sync("worker1", _grad_of_param, args=(context_id, "twice")),
        ]
    w = _param((4, 4), 5)
    loss = ((torch.tanh(x @ w) @ w) * torch.tanh((x * 2) @ w)).sum()
    return distributed, list(torch.autograd.grad(loss, [x, w]))


def test_parameter_used_twice_on_one_worker_gets_the_sum_of_both_uses(
    cluster, no_state_left_behind
):
    distributed, local = cluster.run(_parameter_used_twice_on_one_worker)
    assert_each_close(distributed, local)


def _retain_graph_twice():
    rrpc.rpc_sync("worker1", _make_param, args=("retain", (3, 3), 6))
    (x,) = _inputs((3, 3))
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _stage, args=(x, "retain")).sum()
        rrpc.autograd.backward(context_id, [loss], retain_graph=True)
        rrpc.autograd.backward(context_id, [loss], retain_graph=True)
        distributed = [
            rrpc.autograd.get_gradients(context_id)[x],
            rrpc.rpc_sync("worker1", _grad_of_param, args=(context_id, "retain")),
        ]
    w = _param((3, 3), 6)
    local = torch.autograd.grad(torch.tanh(x @ w).sum(), [x, w])
    return distributed, [2 * g for g in local]


def test_two_backward_passes_with_retain_graph_accumulate(cluster, no_state_left_behind):
    distributed, twice_local = cluster.run(_retain_graph_twice)
    assert_each_close(distributed, twice_local)


class _Net(torch.nn.Module):
    """tanh(Linear(size, size)) with seeded weights: the same net on every worker."""

    def __init__(self, seed, size=4):
        super().__init__()
        self.linear = torch.nn.Linear(size, size)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def _module_gradients(module_rref, context_id):
    """Read on the owner: the gradients of a module's parameters in context_id."""
    gradients = rrpc.autograd.get_gradients(context_id)
    return [gradients[param] for param in module_rref.local_value().parameters()]


def _rref_proxies():
    net_rref = rrpc.remote("worker1", _Net, args=(11,))
    (x,) = _inputs((2, 4))
    with rrpc.autograd.context() as context_id:
        y = net_rref.rpc_sync().forward(x)
        z = net_rref.rpc_async().forward(y).wait()
        out = net_rref.remote().forward(z).to_here()
        rrpc.autograd.backward(context_id, [(out**2).sum()])
        distributed = [
            rrpc.autograd.get_gradients(context_id)[x],
            *rrpc.rpc_sync("worker1", _module_gradients, args=(net_rref, context_id)),
        ]
    net = _Net(11)
    loss = (net(net(net(x))) ** 2).sum()
    return distributed, list(torch.autograd.grad(loss, [x, *net.parameters()]))


def test_rref_proxies_gradients_equal_local_ones(cluster, no_state_left_behind):
    distributed, local = cluster.run(_rref_proxies)
    assert len(distributed) == 3
    assert_each_close(distributed, local)


def _stage_sum(x, name):
    return _stage(x, name).sum()


def _rref_backward():
    # RRef.backward as torch's test_owner_rref_backward / test_user_rref_backward.
    rrpc.rpc_sync("worker1", _make_param, args=("rref_backward", (3, 3), 5))
    (x,) = _inputs((2, 3))
    w = _param((3, 3), 5)
    local = torch.autograd.grad(torch.tanh(x @ w).sum(), [x])[0]
    with rrpc.autograd.context() as context_id:  # user RRef: the pass starts on its owner
        loss = rrpc.remote("worker1", _stage_sum, args=(x, "rref_backward"))
        loss.backward(context_id, retain_graph=True)
        loss.backward(context_id)
        user_twice = rrpc.autograd.get_gradients(context_id)[x]
        with pytest.raises(RuntimeError, match="require 'dist_autograd_ctx_id'"):
            loss.backward()
    with rrpc.autograd.context() as context_id:  # owner RRef, distributed
        y = rrpc.rpc_sync("worker1", _stage, args=(x, "rref_backward"))
        rrpc.RRef(y.sum()).backward(context_id)
        owner_distributed = rrpc.autograd.get_gradients(context_id)[x]
        assert x.grad is None, "a distributed pass wrote .grad"
    t = x.detach().clone().requires_grad_()
    rrpc.RRef((t * 3).sum()).backward()  # owner RRef, local: into .grad
    owner_local = t.grad
    with pytest.raises(RuntimeError, match="RRef should contain a tensor"):
        rrpc.RRef("foo").backward()
    with pytest.raises(RuntimeError, match="scalar outputs"):
        rrpc.RRef(torch.rand(3, requires_grad=True)).backward()
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        rrpc.RRef(torch.rand(3, requires_grad=True).sum()).backward(100)
    with rrpc.autograd.context() as context_id:
        remote_text = rrpc.remote("worker1", str, args=("foo",))
        with pytest.raises(RuntimeError, match="RRef should contain a tensor"):
            remote_text.backward(context_id)
    return (user_twice, 2 * local), (owner_distributed, local), (owner_local, torch.full_like(t, 3))


def test_rref_backward_runs_on_the_owner_and_matches_local_gradients(cluster, no_state_left_behind):
    for distributed, local in cluster.run(_rref_backward):
        assert_close(distributed, local)


def _loss_computed_remotely_and_sent_back():
    # The root itself is a received tensor; its graph starts at a recv node.
    rrpc.rpc_sync("worker1", _make_param, args=("remote_loss", (3, 3), 7))
    (x,) = _inputs((3, 3))
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _stage, args=(x, "remote_loss")).sum()
        remote_loss = rrpc.rpc_sync("worker2", torch.mul, args=(loss, 3.0))
        rrpc.autograd.backward(context_id, [remote_loss])
        distributed = rrpc.autograd.get_gradients(context_id)[x]
    w = _param((3, 3), 7)
    return distributed, torch.autograd.grad(3.0 * torch.tanh(x @ w).sum(), [x])[0]


def test_root_received_from_another_worker(cluster, no_state_left_behind):
    distributed, local = cluster.run(_loss_computed_remotely_and_sent_back)
    assert_close(distributed, local)


def _in_place_then_sum(t):
    t.mul_(2)  # allowed on a received tensor, as in torch
    return t.sum()


def _in_place_op_on_received_tensor():
    (x,) = _inputs((3,))
    with rrpc.autograd.context() as context_id:
        y = rrpc.rpc_sync("worker1", _in_place_then_sum, args=(x * x,))
        rrpc.autograd.backward(context_id, [y])
        distributed = rrpc.autograd.get_gradients(context_id)[x]
    return distributed, 4 * x.detach()


def test_in_place_op_on_a_received_tensor_is_differentiated(cluster, no_state_left_behind):
    distributed, local = cluster.run(_in_place_op_on_received_tensor)
    assert_close(distributed, local)


def _calls_without_tensors_requiring_grad():
    with rrpc.autograd.context():
        rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), torch.ones(2)))
        rrpc.rpc_sync("worker2", rrpc.rpc_sync, args=("worker1", torch.neg, (torch.ones(2),)))
        return [rrpc.rpc_sync(f"worker{rank}", rrpc.autograd._debug_info) for rank in range(3)]


@pytest.mark.timeout(60)
def test_calls_without_tensors_requiring_grad_enrol_their_callees_until_the_block_ends(
    cluster, no_state_left_behind
):
    # As torch (its forceGradRecording): a function called in a context runs in
    # it, so its worker has the context, and the release reaches it (the fixture).
    infos = cluster.run(_calls_without_tensors_requiring_grad)
    assert [info["contexts"] for info in infos] == [1, 1, 1]
    assert all(info["send_records"] == info["recv_records"] == 0 for info in infos)


def _sends_on_and_returns_a_float():
    w = torch.ones(3, requires_grad=True)
    return float(rrpc.rpc_sync("worker2", torch.neg, args=(w,)).sum())


def _nested_call_with_grad_under_a_call_without():
    with rrpc.autograd.context():
        return rrpc.rpc_sync("worker1", _sends_on_and_returns_a_float)


@pytest.mark.timeout(60)
def test_state_a_callee_makes_in_a_nested_call_is_released(cluster, no_state_left_behind):
    # worker0 sends worker1 nothing that requires grad; worker1's own call to
    # worker2 does. The release must reach both (the fixture checks).
    assert cluster.run(_nested_call_with_grad_under_a_call_without) == -3.0


def _backward_here(context_id):
    w = torch.ones(3, requires_grad=True)
    rrpc.autograd.backward(context_id, [(w * 2).sum()])
    return rrpc.autograd.get_gradients(context_id)[w]


def _backward_on_the_callee():
    with rrpc.autograd.context() as context_id:
        return rrpc.rpc_sync("worker1", _backward_here, args=(context_id,))


@pytest.mark.timeout(60)
def test_a_callee_runs_backward_in_the_callers_context(cluster, no_state_left_behind):
    assert torch.equal(cluster.run(_backward_on_the_callee), torch.full((3,), 2.0))


_GO = threading.Event()  # on a callee: what a test's function waits for


def _go():
    _GO.set()


def _when_told(then):
    assert _GO.wait(30), "never told to go on"
    _GO.clear()
    return then()


def _ones_requiring_grad():
    return torch.ones(3, requires_grad=True)


def _sent_after_the_block_ended(then):
    """What waiting for a call to worker1 raised, whose function ran ``then``
    only once the block's release had reached worker1 (its callee)."""
    with rrpc.autograd.context():
        future = rrpc.rpc_async("worker1", _when_told, args=(then,))
    assert rrpc.autograd._wait_releases(timeout=10)
    rrpc.rpc_sync("worker1", _go)
    try:
        future.wait()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_a_reply_requiring_grad_sent_after_the_block_ended_raises_and_leaves_no_state(
    cluster, no_state_left_behind
):
    # As torch: the callee cannot send in a context it no longer has.
    error = cluster.run(_sent_after_the_block_ended, _ones_requiring_grad)
    assert error is not None and RELEASED in error


@pytest.mark.timeout(60)
def test_a_call_made_after_the_block_ended_raises_and_leaves_no_state(
    cluster, no_state_left_behind
):
    # worker1's function calls worker2 in a context released meanwhile: as in
    # torch that call raises (on worker1, so worker0's wait does), and worker2
    # makes no state that nobody would release (the fixture checks).
    error = cluster.run(_sent_after_the_block_ended, _sends_on_and_returns_a_float)
    assert error is not None and RELEASED in error


def _state_while_in_context_then_released():
    rrpc.rpc_sync("worker1", _make_param, args=("release", (3, 3), 8))
    (x,) = _inputs((3, 3))
    with rrpc.autograd.context():
        rrpc.rpc_sync("worker1", _stage, args=(x, "release", ("worker2", "release2")))
        during = [rrpc.rpc_sync(f"worker{rank}", rrpc.autograd._debug_info) for rank in range(3)]
    return during


def test_context_state_lives_on_every_participant_until_the_block_ends(
    cluster, no_state_left_behind
):
    cluster.run(lambda: rrpc.rpc_sync("worker2", _make_param, args=("release2", (3, 3), 9)))
    during = cluster.run(_state_while_in_context_then_released)
    # worker0: send x, recv reply; worker1: recv x, send h, recv reply, send reply;
    # worker2: recv h, send reply. (The fixture checks all is gone afterwards.)
    assert [(i["contexts"], i["send_records"], i["recv_records"]) for i in during] == [
        (1, 1, 1),
        (1, 2, 2),
        (1, 1, 1),
    ]


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("simulated error in the backward pass")


def _fails_in_backward(x):
    return _FailInBackward.apply(x) * 2


def _error_in_remote_backward():
    (x,) = _inputs((3,))
    with rrpc.autograd.context() as context_id:
        # The error is two hops away: worker0 -> worker1 -> worker2.
        loss = rrpc.rpc_sync(
            "worker1", rrpc.rpc_sync, args=("worker2", _fails_in_backward, (x,))
        ).sum()
        try:
            rrpc.autograd.backward(context_id, [loss])
        except RuntimeError as error:
            return str(error), getattr(error, "remote_traceback", ""), len(repr(error.__notes__))
    return None


def test_error_in_a_remote_backward_names_its_node_once_as_torch(cluster, no_state_left_behind):
    raised = cluster.run(_error_in_remote_backward)
    assert raised is not None, "backward did not raise"
    message, remote_traceback, notes_size = raised
    # torch's wording: RuntimeError("Error on Node N: ..."), N where the pass failed.
    assert message == "Error on Node 2: simulated error in the backward pass"
    assert 'raise ValueError("simulated error in the backward pass")' in remote_traceback
    # The origin's traceback is attached once, not again at every hop back.
    assert remote_traceback.count("Traceback (most recent call last)") == 2  # error and cause
    assert notes_size < len(remote_traceback) + 200


def _threads_with_their_own_contexts():
    rrpc.rpc_sync("worker1", _make_param, args=("threads", (3, 3), 10))
    w = _param((3, 3), 10)
    results, errors = {}, []

    def train(index):
        try:
            (x,) = _inputs((3, 3), seed=100 + index)
            for _ in range(20):
                with rrpc.autograd.context() as context_id:
                    loss = rrpc.rpc_sync("worker1", _stage, args=(x, "threads")).sum()
                    rrpc.autograd.backward(context_id, [loss])
                    got = rrpc.autograd.get_gradients(context_id)
                    assert list(got) == [x], f"context {context_id} saw others' tensors"
                    results[index] = got[x]
            expected = torch.autograd.grad(torch.tanh(x @ w).sum(), [x])[0]
            results[index] = (results[index], expected)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_contexts_on_different_threads_are_independent(cluster, no_state_left_behind):
    results = cluster.run(_threads_with_their_own_contexts)
    assert sorted(results) == [0, 1, 2, 3]
    for distributed, local in results.values():
        assert_close(distributed, local)


def _api_errors():
    errors = {}

    def error_of(fn):
        try:
            fn()
        except Exception as error:
            return type(error).__name__, str(error)
        return None

    with rrpc.autograd.context() as context_id:
        errors["nested"] = error_of(lambda: rrpc.autograd.context().__enter__())
        errors["no roots"] = error_of(lambda: rrpc.autograd.backward(context_id, []))
        errors["no grad"] = error_of(lambda: rrpc.autograd.backward(context_id, [torch.ones(())]))
        errors["not scalar"] = error_of(
            lambda: rrpc.autograd.backward(context_id, [torch.ones(3, requires_grad=True)])
        )
        errors["leaf root"] = error_of(
            lambda: rrpc.autograd.backward(context_id, [torch.ones(1, requires_grad=True)])
        )
    t = torch.ones(2, requires_grad=True)
    errors["unknown context"] = error_of(lambda: rrpc.autograd.backward(12345, [(t * 2).sum()]))
    errors["gradients of unknown context"] = error_of(lambda: rrpc.autograd.get_gradients(12345))
    errors["released context"] = error_of(lambda: rrpc.autograd.get_gradients(context_id))
    # As torch: the context is looked up before the roots are checked.
    errors["unknown context, bad root"] = error_of(
        lambda: rrpc.autograd.backward(12345, [torch.ones(())])
    )
    return errors


def test_invalid_arguments_raise_torch_errors(cluster, no_state_left_behind):
    errors = cluster.run(_api_errors)
    assert errors["nested"][1].startswith("Already have an autograd context id for this thread")
    assert errors["no roots"] == ("RuntimeError", "No tensors provided for gradient computation.")
    assert "requires_grad not set on" in errors["no grad"][1]
    assert "is not a scalar, all roots need to be scalar" in errors["not scalar"][1]
    assert "does not have a valid gradient function" in errors["leaf root"][1]
    unknown = ("unknown context", "gradients of unknown context", "released context")
    for case in (*unknown, "unknown context, bad root"):
        assert errors[case][0] == "RuntimeError"
        assert "Could not find autograd context with id" in errors[case][1]


def _context_ids():
    ids = []
    for _ in range(3):
        with rrpc.autograd.context() as context_id:
            ids.append(context_id)
    remote = rrpc.rpc_sync("worker2", _one_context_id)
    return ids, remote


def _one_context_id():
    with rrpc.autograd.context() as context_id:
        return context_id


def test_context_ids_carry_the_creator_rank_in_the_top_16_bits(cluster, no_state_left_behind):
    ids, remote = cluster.run(_context_ids)
    assert len(set(ids)) == 3 and all(i >> 48 == 0 and i > 0 for i in ids)
    assert remote >> 48 == 2


# -- Sparse tensors ------------------------------------------------------------
def _sparse(seed, coalesce):
    generator = torch.Generator().manual_seed(seed)
    indices = torch.tensor([[0, 1, 1, 2, 1], [2, 0, 2, 1, 0]])  # (1, 0) twice
    values = torch.rand(5, generator=generator)
    tensor = torch.sparse_coo_tensor(indices, values, (3, 3), check_invariants=True)
    return (tensor.coalesce() if coalesce else tensor).requires_grad_()


def _sparse_scale(x, factor):
    return x * factor


def _embedding_bag_sparse(weight, indices, offsets):
    return torch.nn.functional.embedding_bag(indices, weight, offsets, sparse=True)


def _sparse_round_trips():
    # Sparse tensors out (worker0 -> worker1 -> worker2) and a sparse result
    # back; a dense weight whose gradient comes back sparse (embedding_bag).
    t1, t2 = _sparse(1, coalesce=False), _sparse(2, coalesce=True)
    (weight,) = _inputs((5, 3))
    indices, offsets = torch.tensor([1, 2, 4, 4, 0]), torch.tensor([0, 3])
    with rrpc.autograd.context() as context_id:
        total = rrpc.rpc_sync("worker1", torch.add, args=(t1, t2))
        scaled = rrpc.rpc_sync(
            "worker1", rrpc.rpc_sync, args=("worker2", _sparse_scale, (total, 3.0))
        )
        bags = rrpc.rpc_sync("worker2", _embedding_bag_sparse, args=(weight, indices, offsets))
        loss = torch.sparse.sum(scaled * t1) + (bags**2).sum()
        rrpc.autograd.backward(context_id, [loss])
        grads = rrpc.autograd.get_gradients(context_id)
        distributed = [grads[t1], grads[t2], grads[weight]]
    local_loss = (
        torch.sparse.sum(((t1 + t2) * 3.0) * t1)
        + (_embedding_bag_sparse(weight, indices, offsets) ** 2).sum()
    )
    local = torch.autograd.grad(local_loss, [t1, t2, weight])
    return distributed, list(local)


def test_sparse_tensors_and_sparse_gradients_equal_local_ones(cluster, no_state_left_behind):
    distributed, local = cluster.run(_sparse_round_trips)
    for actual, expected in zip(distributed, local, strict=True):
        assert actual.layout is torch.sparse_coo and expected.layout is torch.sparse_coo
        assert torch.equal(actual.coalesce().to_dense(), expected.coalesce().to_dense())


# -- Gradients that travel nowhere ---------------------------------------------
def _unused_rpc_result():
    t1, t2 = _inputs((3, 3), (3, 3))
    with rrpc.autograd.context() as context_id:
        rrpc.rpc_sync("worker1", torch.add, args=(t1, t2))  # its result is never used
        rrpc.autograd.backward(context_id, [(t1 * t2).sum()])
        grads = rrpc.autograd.get_gradients(context_id)
        distributed = [grads[t1], grads[t2]]
    return distributed, list(torch.autograd.grad((t1 * t2).sum(), [t1, t2]))


def test_backward_returns_when_an_rpc_result_is_unused(cluster, no_state_left_behind):
    # torch's FAST mode waits forever for the gradient of the unused result
    # (its own test asserts the hang); rrpc returns the gradients of what was used.
    distributed, local = cluster.run(_unused_rpc_result)
    assert_each_close(distributed, local, atol=0)


class _SameGradientTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return grad, grad  # one tensor, for both inputs


def _one_gradient_tensor_for_two_leaves():
    a, b = _inputs((2, 3), (2, 3))
    with rrpc.autograd.context() as context_id:
        y = rrpc.rpc_sync("worker1", torch.mul, args=(_SameGradientTwice.apply(a, b), 2.0))
        rrpc.autograd.backward(context_id, [y.sum()])
        grads = rrpc.autograd.get_gradients(context_id)
        grads[a].add_(1)  # the reader owns what it got: b's gradient does not change
        return grads[a].data_ptr() != grads[b].data_ptr(), grads[b]


def test_leaves_given_one_gradient_tensor_get_gradients_of_their_own(cluster, no_state_left_behind):
    separate, b_gradient = cluster.run(_one_gradient_tensor_for_two_leaves)
    assert separate
    assert torch.equal(b_gradient, torch.full((2, 3), 2.0))


# -- DDP over several local passes ---------------------------------------------
class _TwoLocalStages(torch.nn.Module):
    """fc1 here, tanh on worker2, fc2 here: backward reaches fc2 in one local
    pass and fc1 in a later one (when worker2 sends the gradient of fc1's output)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4)
        self.fc2 = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.fc2(rrpc.rpc_sync("worker2", torch.tanh, args=(self.fc1(x),)))


def _ddp_trainer(rank, world_size, port):
    if rank == 2:  # serves tanh
        return None
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        torch.manual_seed(0)
        module = _TwoLocalStages()
        ddp = torch.nn.parallel.DistributedDataParallel(module)  # one bucket: fc1 and fc2
        x = torch.rand((5, 3), generator=torch.Generator().manual_seed(rank + 1))
        params = list(module.parameters())
        with rrpc.autograd.context() as context_id:
            rrpc.autograd.backward(context_id, [(ddp(x) ** 2).sum()])
            grads = rrpc.autograd.get_gradients(context_id)
            distributed = [grads[param] for param in params]
        leaked = [param.grad for param in params if param.grad is not None]
        local_loss = (module.fc2(torch.tanh(module.fc1(x))) ** 2).sum()
        local = torch.autograd.grad(local_loss, params)
        return distributed, list(local), leaked
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_averages_a_bucket_whose_parameters_two_local_passes_reach():
    results = run_workers(_ddp_trainer, world_size=3, args=(free_port(),))
    (dist0, local0, leaked0), (dist1, local1, leaked1) = results[:2]
    assert leaked0 == [] and leaked1 == [], "gradients leaked into .grad"
    average = [(g0 + g1) / 2 for g0, g1 in zip(local0, local1, strict=True)]
    assert_each_close(dist0, average)
    assert_each_close(dist1, average)


# -- A worker dies during backward ---------------------------------------------
class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        os._exit(1)


def _dies_in_backward(x):
    return _DieInBackward.apply(x) * 2


def _backward_with_a_dying_worker(rank, world_size, done, rpc_timeout):
    rrpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rrpc.RpcBackendOptions(rpc_timeout=rpc_timeout),
    )
    try:
        if rank == 2:  # dies in backward; must not wait on `done` (a dead waiter wedges its set())
            threading.Event().wait(60)
            return None
        if rank == 1:
            done.wait(60)
            return None
        (x,) = _inputs((3,))
        with rrpc.autograd.context() as context_id:
            y = rrpc.rpc_sync("worker1", rrpc.rpc_sync, args=("worker2", _dies_in_backward, (x,)))
            started = time.monotonic()
            try:
                rrpc.autograd.backward(context_id, [y.sum()])
            except Exception as error:
                return type(error).__name__, str(error), time.monotonic() - started
            finally:
                done.set()
        return None
    finally:
        rrpc.shutdown(graceful=False)


def test_worker_dying_during_backward_makes_backward_raise_within_the_timeout():
    done = mp_context.Event()
    rpc_timeout = 20.0
    results = run_workers(
        _backward_with_a_dying_worker,
        world_size=3,
        args=(done, rpc_timeout),
        init=False,
        may_die={2},
        timeout=60,
    )
    assert results[0] is not None, "backward did not raise"
    kind, message, elapsed = results[0]
    assert kind == "PeerUnavailableError", message
    assert "worker2" in message
    assert elapsed < rpc_timeout / 2  # death is noticed, not timed out


# -- Bookkeeping alone, no processes -------------------------------------------
def test_context_ids_are_unique_and_start_with_the_rank():
    table = ContextTable(rank=5)
    ids = [table.create().context_id for _ in range(3)]
    assert ids == [(5 << 48) + 1, (5 << 48) + 2, (5 << 48) + 3]


def test_other_workers_contexts_are_made_on_first_use_and_not_again_after_release():
    table = ContextTable(rank=0)
    peer = WorkerInfo("worker1", 1)
    theirs = (1 << 48) + 7
    context = table.get_or_create(theirs)
    assert context is not None and table.get_or_create(theirs) is context
    context.record_send((0, 1, False), peer, [torch.ones(1, requires_grad=True)])
    assert table.debug_info()["send_records"] == 1
    assert table.release(theirs) is context
    assert table.get_or_create(theirs) is None  # a late message makes no new state
    assert table.debug_info() == {
        "contexts": 0,
        "send_records": 0,
        "recv_records": 0,
        "gradients": 0,
    }


def test_own_context_is_not_remade_once_released():
    table = ContextTable(rank=3)
    context_id = table.create().context_id
    table.release(context_id)
    assert table.get_or_create(context_id) is None
    with pytest.raises(
        RuntimeError, match=f"Could not find autograd context with id: {context_id}$"
    ):
        table.get(context_id)


def test_gradients_accumulate_out_of_place():
    table = ContextTable(rank=0)
    context = table.create()
    leaf = torch.ones(2, requires_grad=True)
    context.accumulate(leaf, torch.ones(2))
    first = context.gradients_copy()[leaf]
    context.accumulate(leaf, torch.full((2,), 2.0))
    assert torch.equal(context.gradients_copy()[leaf], torch.full((2,), 3.0))
    assert torch.equal(first, torch.ones(2))  # what a reader already holds does not change


def test_participants_are_recorded_in_both_directions():
    table = ContextTable(rank=0)
    context = table.create()
    context.record_send((0, 1, False), WorkerInfo("worker1", 1), [])
    context.record_recv((2, 9, False), WorkerInfo("worker2", 2))
    assert sorted(context.participants) == [1, 2]


class _RecordingAgent:
    """Stands in for the agent: records what a local pass sends, answers at once."""

    def __init__(self):
        self.sent = []
        self.options = SimpleNamespace(rpc_timeout=5.0)

    def send(self, peer, kind, obj, timeout, what, sync=False):
        self.sent.append((peer, kind, obj))
        future = torch.futures.Future()
        future.set_result(None)
        return future


def test_received_tensors_get_a_recv_node_and_their_gradients_go_back_to_the_sender():
    table = ContextTable(rank=0)
    context = table.create()
    hooks = Hooks(table, rrpc.autograd._receive)
    sender, key = WorkerInfo("worker1", 1), (1, 7, False)
    receive = hooks.tensor_hook(context.context_id, sender, key)
    a, b = receive(torch.ones(2)), receive(torch.full((2,), 3.0))
    assert type(a.grad_fn).__name__ == "RecvRpcBackward" and a.requires_grad
    w = torch.full((2,), 2.0, requires_grad=True)
    loss = (a * w + b * b).sum()

    agent = _RecordingAgent()
    hops = rrpc.autograd._local_pass(agent, context, [loss], [torch.ones(())])

    assert len(hops) == 1
    ((peer, kind, (context_id, sent_key, by_index)),) = agent.sent
    assert (peer, kind, context_id, sent_key) == (
        sender,
        AUTOGRAD_BACKWARD,
        context.context_id,
        key,
    )
    assert sorted(by_index) == [0, 1]
    gradients = {index: tensors.put_together(parts) for index, parts in by_index.items()}
    assert torch.equal(gradients[0], torch.full((2,), 2.0))  # d loss / d a = w
    assert torch.equal(gradients[1], torch.full((2,), 6.0))  # d loss / d b = 2 b
    assert torch.equal(context.gradients_copy()[w], torch.ones(2))
    assert w.grad is None
    assert context.recvs == {key: sender} and context.participants == {1: sender}


def test_a_gradient_of_another_shape_is_refused_before_anything_is_allocated_for_it():
    # One element "expanded" to 2**40 of them, for a tensor of 2: made dense
    # as it came, it would be 4 TiB.
    element = pickle.PickleBuffer(numpy.ones(1, numpy.float32))
    parts = (tensors.DTYPE_INDEX[torch.float32], (1 << 40,), True, element)
    with pytest.raises(
        ValueError, match=r"shape \(1099511627776,\) came for a tensor of shape \(2,\)"
    ):
        rrpc.autograd._arrived(parts, torch.ones(2))


def test_a_message_without_tensors_requiring_grad_creates_no_context():
    table = ContextTable(rank=0)
    hooks = Hooks(table, rrpc.autograd._receive)
    hooks.tensor_hook((1 << 48) + 1, WorkerInfo("worker1", 1), (1, 1, False))  # never called
    assert table.find((1 << 48) + 1) is None


def test_a_user_functions_request_enrols_each_end_without_tensors_requiring_grad():
    caller, callee = ContextTable(rank=0), ContextTable(rank=1)
    context = caller.create()
    me, them, key = WorkerInfo("worker0", 0), WorkerInfo("worker1", 1), (0, 1, False)
    Hooks(caller, rrpc.autograd._receive).on_send(context.context_id, them, key, [])
    Hooks(callee, rrpc.autograd._receive).tensor_hook(context.context_id, me, key, enroll=True)
    assert context.participants == {1: them} and not context.sends
    assert callee.get(context.context_id).participants == {0: me}
    callee.release(context.context_id)
    Hooks(callee, rrpc.autograd._receive).tensor_hook(context.context_id, me, key, enroll=True)
    assert callee.find(context.context_id) is None  # a late request: no state


def test_sending_in_a_context_that_ended_here_raises_as_torch():
    table = ContextTable(rank=0)
    hooks = Hooks(table, rrpc.autograd._receive)
    mine, theirs = table.create().context_id, (1 << 48) + 4
    hooks.check(mine)
    hooks.check(theirs)  # not made here yet: a first message makes it
    table.get_or_create(theirs)
    for context_id in (mine, theirs):
        table.release(context_id)
        with pytest.raises(RuntimeError, match=f"^{RELEASED}$"):
            hooks.check(context_id)


class _ReleaseAgent:
    """What ``Releases`` uses of an agent: a scheduler whose timers are only
    recorded, and a ``send_reliably`` that records each release message."""

    def __init__(self):
        self.info = WorkerInfo("worker0", 0)
        self.options = SimpleNamespace(rpc_timeout=10.0)
        self.timers = []
        self.sent = []
        self.scheduler = SimpleNamespace(call_later=self._call_later)

    def _call_later(self, delay, fn):
        timer = SimpleNamespace(cancelled=False)
        timer.cancel = lambda: setattr(timer, "cancelled", True)
        self.timers.append(timer)
        return timer

    def send_reliably(self, peer, kind, releases, timeout, what):
        self.sent.append((peer.name, [context_id for context_id, _ in releases]))
        return None  # not tracked: nothing to wait for


def _ended_context(table, peer):
    context = table.create()
    context.record_recv((peer.id, context.context_id, False), peer)
    return context.context_id


def test_a_flush_cancels_the_timer_armed_for_what_it_took():
    agent, table, peer = _ReleaseAgent(), ContextTable(rank=0), WorkerInfo("worker1", 1)
    releases = Releases(agent, table)
    first = _ended_context(table, peer)
    releases.release(first)  # the first gathered: a timer is armed for it
    releases.flush()  # early (a drain): the timer must not send the next ones early
    second = _ended_context(table, peer)
    releases.release(second)
    assert agent.sent == [("worker1", [first])]
    assert [timer.cancelled for timer in agent.timers] == [True, False]


def test_releases_for_one_participant_go_at_once_when_a_batch_is_gathered():
    agent, table, peer = _ReleaseAgent(), ContextTable(rank=0), WorkerInfo("worker1", 1)
    releases = Releases(agent, table)
    ended = [_ended_context(table, peer) for _ in range(autograd_release.RELEASE_BATCH + 1)]
    for context_id in ended:
        releases.release(context_id)
    assert agent.sent == [("worker1", ended[:-1])]
    assert releases.pending() == 1  # the last waits for its timer


def test_send_records_keep_the_sent_tensors_until_release():
    table = ContextTable(rank=0)
    hooks = Hooks(table, rrpc.autograd._receive)
    theirs, peer, key = (2 << 48) + 5, WorkerInfo("worker2", 2), (2, 3, True)
    t = torch.ones(3, requires_grad=True)
    hooks.on_send(theirs, peer, key, [t])
    assert table.get(theirs).sent_tensors(key) == [t]
    table.release(theirs)
    hooks.on_send(theirs, peer, key, [t])  # late: ignored
    assert table.find(theirs) is None


def _parameter_as_an_argument():
    weight = torch.nn.Parameter(torch.arange(3.0))
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", torch.mul, args=(weight, 2.0)).sum()
        rrpc.autograd.backward(context_id, [loss])
        grads = rrpc.autograd.get_gradients(context_id)
        return grads.get(weight), weight.grad


def test_an_nn_parameter_sent_as_an_argument_gets_its_gradient(cluster, no_state_left_behind):
    # As torch: a Parameter is a tensor that requires grad like any other.
    in_context, in_dot_grad = cluster.run(_parameter_as_an_argument)
    assert torch.equal(in_context, torch.full((3,), 2.0))
    assert in_dot_grad is None
