"""DistributedOptimizer (rrpc.optim) against the same training done in one process.

Scenarios run on worker0 of the three-worker cluster the dist tests share (see
test_dist_autograd.py): worker0 trains, worker1 and worker2 own parameters.
"""

from __future__ import annotations

import gc
import resource
import threading
import time

import pytest
import test_dist_autograd as dist
import torch

import rrpc
from rrpc.optim import DistributedOptimizer

ATOL = 1e-5


def assert_each_close(actual, expected):
    dist.assert_each_close(actual, expected, ATOL)


@pytest.fixture
def cluster(request):
    return dist.shared_cluster(request.config)


@pytest.fixture
def no_state_left_behind(cluster):
    """After the test, every worker's autograd tables are empty."""
    yield
    assert cluster.run(dist._autograd_state_everywhere) == [dist.EMPTY] * 3


# -- Helpers that run on the workers -------------------------------------------
_param = dist._param


def _tanh_layer(weight_rref, x):
    return torch.tanh(x @ weight_rref.local_value())


def _linear(weight_rref, x):
    return x @ weight_rref.local_value()


def _parameter_rrefs(module_rref):
    return [rrpc.RRef(param) for param in module_rref.local_value().parameters()]


# -- Training equals local training --------------------------------------------
def _train_two_remote_layers(optimizer_class, kwargs, steps):
    w1 = rrpc.remote("worker1", _param, args=((4, 5), 21))
    w2 = rrpc.remote("worker2", _param, args=((5, 3), 22))
    optimizer = DistributedOptimizer(optimizer_class, [w1, w2], **kwargs)
    local_w1, local_w2 = _param((4, 5), 21), _param((5, 3), 22)
    local_optimizer = optimizer_class([local_w1, local_w2], **kwargs)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, target = torch.rand((8, 4), generator=data), torch.rand((8, 3), generator=data)
        with rrpc.autograd.context() as context_id:
            h = rrpc.rpc_sync("worker1", _tanh_layer, args=(w1, x))
            out = rrpc.rpc_sync("worker2", _tanh_layer, args=(w2, h))
            loss = ((out - target) ** 2).mean()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        local_loss = ((torch.tanh(torch.tanh(x @ local_w1) @ local_w2) - target) ** 2).mean()
        local_loss.backward()
        local_optimizer.step()
    distributed = [w1.to_here().detach(), w2.to_here().detach()]
    return distributed, [local_w1.detach(), local_w2.detach()], [_param((4, 5), 21).detach()]


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [
        (torch.optim.SGD, {"lr": 0.05}),
        (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.99)}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
        # No functional form takes it: the class steps, with .grad borrowed.
        (torch.optim.SGD, {"lr": 0.05, "differentiable": False}),
        (torch.optim.NAdam, {"lr": 0.01}),  # torch has no functional NAdam
    ],
    ids=["SGD", "SGD-nesterov", "Adam", "Adam-amsgrad", "RMSprop", "SGD-class", "NAdam"],
)
def test_twenty_steps_equal_local_training(cluster, no_state_left_behind, optimizer_class, kwargs):
    distributed, local, (initial_w1,) = cluster.run(
        _train_two_remote_layers, optimizer_class, kwargs, 20
    )
    assert not torch.allclose(distributed[0], initial_w1), "the optimizer did not change w1"
    assert_each_close(distributed, local)


# -- Concurrent trainers -------------------------------------------------------
def _trainer(w1, w2, seed, steps, lr):
    """One trainer with its own optimizer over shared parameters. The loss is
    linear in the weights, so the updates add up the same in any order."""
    optimizer = DistributedOptimizer(torch.optim.SGD, [w1, w2], lr=lr)
    data = torch.Generator().manual_seed(seed)
    total = torch.zeros(4, 3, dtype=torch.float64)  # sum of x^T @ 1, each weight's gradient
    for _ in range(steps):
        x = torch.rand((6, 4), generator=data)
        with rrpc.autograd.context() as context_id:
            y1 = rrpc.rpc_async("worker1", _linear, args=(w1, x))
            y2 = rrpc.rpc_async("worker2", _linear, args=(w2, x))
            rrpc.autograd.backward(context_id, [(y1.wait() + y2.wait()).sum()])
            optimizer.step(context_id)
        total += x.double().t() @ torch.ones(6, 3, dtype=torch.float64)
    assert rrpc.autograd._wait_releases(timeout=10)
    return total


def _concurrent_trainers():
    steps, lr = 15, 0.01
    w1 = rrpc.remote("worker1", _param, args=((4, 3), 31))
    w2 = rrpc.remote("worker2", _param, args=((4, 3), 32))
    totals, errors = [], []

    def run(seed):
        try:
            totals.append(_trainer(w1, w2, seed, steps, lr))
        except BaseException as error:
            errors.append(error)

    # Two trainer threads here, and a third trainer on worker1 itself.
    elsewhere = rrpc.rpc_async("worker1", _trainer, args=(w1, w2, 3, steps, lr))
    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    totals.append(elsewhere.wait())
    gradient_sum = sum(totals)
    expected = [
        (_param((4, 3), seed).detach().double() - lr * gradient_sum).float() for seed in (31, 32)
    ]
    return [w1.to_here().detach(), w2.to_here().detach()], expected


def test_concurrent_trainers_stepping_the_same_parameters_apply_every_update(
    cluster, no_state_left_behind
):
    distributed, expected = cluster.run(_concurrent_trainers)
    assert_each_close(distributed, expected)


# -- Errors and edge cases -----------------------------------------------------
class _FailingOptimizer(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        raise ValueError("Error running optimizer.")


class _OptimizerFailingOnConstructor(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})
        raise ValueError("Error creating optimizer.")


def _optimizer_errors():
    w1 = rrpc.remote("worker1", _param, args=((3, 3), 41))
    w2 = rrpc.remote("worker2", _param, args=((3, 3), 42))
    raised = {}
    try:
        DistributedOptimizer(_OptimizerFailingOnConstructor, [w1, w2])
    except ValueError as error:
        raised["constructor"] = str(error)
    optimizer = DistributedOptimizer(_FailingOptimizer, [w1, w2])
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _linear, args=(w1, torch.ones(2, 3))).sum()
        rrpc.autograd.backward(context_id, [loss])
        try:
            optimizer.step(context_id)
        except ValueError as error:
            raised["step"] = str(error)
    return raised


def test_optimizer_errors_raise_on_the_trainer(cluster, no_state_left_behind):
    raised = cluster.run(_optimizer_errors)
    assert raised == {
        "constructor": "Error creating optimizer.",
        "step": "Error running optimizer.",
    }


def _parameter_without_gradient():
    w1 = rrpc.remote("worker1", _param, args=((3, 3), 51))
    w2 = rrpc.remote("worker2", _param, args=((3, 3), 52))  # not used: no gradient on worker2
    optimizer = DistributedOptimizer(torch.optim.SGD, [w1, w2], lr=0.5)
    x = torch.ones(2, 3)
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _linear, args=(w1, x)).sum()
        rrpc.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    expected_w1 = _param((3, 3), 51).detach() - 0.5 * (x.t() @ torch.ones(2, 3))
    return [w1.to_here().detach(), w2.to_here().detach()], [
        expected_w1,
        _param((3, 3), 52).detach(),
    ]


def test_parameters_without_gradients_in_the_context_stay_unchanged(cluster, no_state_left_behind):
    distributed, expected = cluster.run(_parameter_without_gradient)
    assert_each_close(distributed, expected)


def _adagrad_with_a_parameter_without_gradient():
    used = rrpc.remote("worker1", _param, args=((3, 3), 71))
    unused = rrpc.remote("worker1", _param, args=((3, 3), 72))  # same owner, no gradient
    optimizer = DistributedOptimizer(torch.optim.Adagrad, [used, unused], lr=0.1)
    x = torch.ones(2, 3)
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _linear, args=(used, x)).sum()
        rrpc.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    local = [_param((3, 3), 71), _param((3, 3), 72)]
    reference = torch.optim.Adagrad(local, lr=0.1)
    (x @ local[0]).sum().backward()
    reference.step()
    return [used.to_here().detach(), unused.to_here().detach()], [p.detach() for p in local]


def test_adagrad_steps_an_owner_with_a_parameter_without_gradient_as_torch(
    cluster, no_state_left_behind
):
    # Its functional form raised (zip() argument 2 is shorter than argument 1).
    distributed, expected = cluster.run(_adagrad_with_a_parameter_without_gradient)
    assert_each_close(distributed, expected)


def _grad_attribute_untouched():
    w = rrpc.remote("worker1", _param, args=((3, 3), 61))
    optimizer = DistributedOptimizer(torch.optim.SGD, [w], lr=0.1)
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync("worker1", _linear, args=(w, torch.ones(1, 3))).sum()
        rrpc.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    return rrpc.rpc_sync("worker1", _grad_of, args=(w,))


def _grad_of(rref):
    return rref.local_value().grad


def test_step_leaves_the_parameters_grad_attribute_alone(cluster, no_state_left_behind):
    assert cluster.run(_grad_attribute_untouched) is None


def _what_a_step_sends():
    w = rrpc.remote("worker1", _param, args=((3, 3), 62))
    optimizer = DistributedOptimizer(torch.optim.SGD, [w], lr=0.1)
    sent = []
    real = {"rpc_async": rrpc.optim.rpc_async, "rpc_sync": rrpc.optim.rpc_sync}

    def recording(name):
        def call(to, func, args=None, kwargs=None, timeout=-1.0):
            sent.append(args)
            return real[name](to, func, args, kwargs, timeout)

        return call

    for name in real:  # one owner: the step is an rpc_sync; several: rpc_async to each
        setattr(rrpc.optim, name, recording(name))
    try:
        with rrpc.autograd.context() as context_id:
            loss = rrpc.rpc_sync("worker1", _linear, args=(w, torch.ones(1, 3))).sum()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)
    finally:
        for name, function in real.items():
            setattr(rrpc.optim, name, function)
    return [[type(arg).__name__ for arg in args] for args in sent]


def test_a_step_names_the_local_optimizer_instead_of_passing_its_rref(
    cluster, no_state_left_behind
):
    # An RRef passed to its owner costs an ACCEPT exchange on every step.
    assert cluster.run(_what_a_step_sends) == [["int", "int"]]


# -- Nothing leaks -------------------------------------------------------------
def _memory_probe():
    gc.collect()
    tensors = sum(1 for obj in gc.get_objects() if type(obj) in (torch.Tensor, torch.nn.Parameter))
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * resource.getpagesize()
    return {"tensors": tensors, "rss": rss, **rrpc.autograd._debug_info()}


def _everywhere(fn):
    return [rrpc.rpc_sync(f"worker{rank}", fn) for rank in range(3)]


def _training_loop(iterations, warmup=50):
    net1 = rrpc.remote("worker1", dist._Net, args=(71, 8))
    net2 = rrpc.remote("worker2", dist._Net, args=(72, 8))
    params = rrpc.rpc_sync("worker1", _parameter_rrefs, args=(net1,))
    params += rrpc.rpc_sync("worker2", _parameter_rrefs, args=(net2,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.001)
    x = torch.rand(4, 8, requires_grad=True)

    def step():
        with rrpc.autograd.context() as context_id:
            y = net1.rpc_sync().forward(x)
            z = net2.rpc_sync().forward(y)
            rrpc.autograd.backward(context_id, [z.sum()])
            optimizer.step(context_id)

    for _ in range(warmup):
        step()
    assert rrpc.autograd._wait_releases(timeout=10)
    before = _everywhere(_memory_probe)
    started = time.monotonic()
    for _ in range(iterations):
        step()
    elapsed = time.monotonic() - started
    assert rrpc.autograd._wait_releases(timeout=10)
    after = _everywhere(_memory_probe)
    return before, after, elapsed


def _check_flat(before, after):
    for rank, (b, a) in enumerate(zip(before, after, strict=True)):
        state = {key: a[key] for key in dist.EMPTY}
        assert state == dist.EMPTY, f"worker{rank} keeps autograd state: {a}"
        assert a["tensors"] - b["tensors"] <= 8, f"worker{rank}: live tensors {b} -> {a}"
        assert a["rss"] - b["rss"] < 32 << 20, f"worker{rank}: memory grew {b} -> {a}"


def test_many_training_iterations_leave_no_state_and_flat_memory(cluster, no_state_left_behind):
    before, after, elapsed = cluster.run(_training_loop, 300)
    _check_flat(before, after)


@pytest.mark.slow
def test_two_thousand_training_iterations_leave_no_state_and_flat_memory(
    cluster, no_state_left_behind
):
    before, after, elapsed = cluster.run(_training_loop, 2000, timeout=300)
    _check_flat(before, after)
