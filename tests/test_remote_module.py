"""rrpc.nn.RemoteModule between real workers, against the same module run locally.

Scenarios run on worker0 of the module's three-worker cluster (conftest's
``cluster``): worker1 holds the remote modules, worker2 is the third worker
they are sent to. Where PyTorch's behaviour was in question, the same code was
run on ``torch.distributed.nn.RemoteModule`` (errors and their messages here
are PyTorch's); torch's own RemoteModule suite also runs against rrpc in
``make conformance``. After every test, no worker holds an RRef any more.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import re

import pytest
import torch
from test_rref import ZERO_DEBUG_INFO, _wait_for_empty_tables
from torch import nn

import rrpc
from rrpc.nn import RemoteModule
from rrpc.nn.api.remote_module import _REMOTE_MODULE_PICKLED_ATTRIBUTES, _RemoteModule

ATOL = 1e-6


@pytest.fixture
def no_rrefs_left_behind(cluster):
    yield
    assert cluster.run(_wait_for_empty_tables) == [ZERO_DEBUG_INFO] * 3


# -- Modules and helpers the workers run -----------------------------------------


class Echo(nn.Module):
    """torch's test module: forward returns its arguments reversed."""

    def __init__(self, first_arg, first_kwarg=-1):
        super().__init__()
        self.param1 = nn.Parameter(torch.ones(1))
        self.made_with = (first_arg, first_kwarg)

    def forward(self, tensor, number, word="default"):
        return word, number, tensor


class Keywords(nn.Module):
    """A forward whose keywords are named like parameters of rrpc's and torch's plumbing."""

    def forward(self, x, *, mode="m", timeout=0, method="", rref=None, device=None):
        return x + 1, mode, timeout, method, rref, device


class NotAModule:
    def __init__(self, first_arg, first_kwarg=-1):
        pass


def _mlp():
    """A module_cls may be any callable that returns a module: this one is seeded."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _mlp_with_dropout():
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))


def _inputs(*shape, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _outcome(fn, *args, **kwargs):
    """(type name, message) of what fn raises, or ("returned", value)."""
    try:
        return "returned", fn(*args, **kwargs)
    except Exception as exc:
        exc.__traceback__ = None  # see test_rref._outcome
        return type(exc).__name__, str(exc)


def _training_flags(module_rref):
    """On the owner: the training flag of the module and each of its submodules."""
    return [m.training for m in module_rref.local_value().modules()]


def _flags(module_rref):
    return rrpc.rpc_sync(module_rref.owner(), _training_flags, args=(module_rref,))


def _gradients_on_owner(module_rref, context_id):
    gradients = rrpc.autograd.get_gradients(context_id)
    return [gradients[p] for p in module_rref.local_value().parameters()]


def _attributes(remote_module):
    return remote_module.__dict__


def _forward_there(remote_module, args):
    return remote_module.forward(*args)


def _forward_async_there(remote_module, args):
    return remote_module.forward_async(*args).wait()


def _make_remote_module(remote_device):
    return RemoteModule(remote_device, Echo, args=(1,))


def _assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


# -- Forward ---------------------------------------------------------------------


def _forward_like_local():
    x = _inputs(5, 4)
    remote_mlp = RemoteModule("worker1/cpu", _mlp)
    future = remote_mlp.forward_async(x)
    echo = RemoteModule("worker1/cpu", Echo, args=(1,), kwargs={"first_kwarg": 2})
    return {
        "forward": remote_mlp.forward(x).detach(),
        "forward_async": future.wait().detach(),
        "is a Future": isinstance(future, torch.futures.Future),
        "call": remote_mlp(x).detach(),
        "local": _mlp()(x).detach(),
        "kwargs": echo.forward(torch.ones(1), 2, word="3"),
        "kwargs async": echo.forward_async(torch.ones(1), 2, word="3").wait(),
        "made with": echo.get_module_rref().to_here().made_with,
    }


def test_forward_forward_async_and_call_equal_the_local_module(cluster, no_rrefs_left_behind):
    got = cluster.run(_forward_like_local)
    for way in ("forward", "forward_async", "call"):
        assert torch.equal(got[way], got["local"]), way
    assert got["is a Future"]
    assert got["kwargs"] == got["kwargs async"] == ("3", 2, torch.ones(1))
    assert got["made with"] == (1, 2)


def _forward_with_keywords():
    remote_module = RemoteModule("worker1/cpu", Keywords)
    keywords = {"mode": "sum", "timeout": 5, "method": "mean", "rref": "r", "device": "d"}
    return (
        remote_module.forward(torch.zeros(2), **keywords),
        remote_module.forward_async(torch.zeros(2), **keywords).wait(),
    )


def test_forward_passes_any_keyword_argument_on(cluster, no_rrefs_left_behind):
    for out, *keywords in cluster.run(_forward_with_keywords):
        assert torch.equal(out, torch.ones(2))
        assert keywords == ["sum", 5, "mean", "r", "d"]


def _remote_device_forms():
    forms = {}
    for remote_device in ("worker1/cpu", "worker1", "rank:1/cpu", "rank:1", "worker1/cpu:0"):
        remote_module = RemoteModule(remote_device, Echo, args=(1,))
        forms[remote_device] = (
            remote_module.on,
            remote_module.device,
            remote_module.is_device_map_set,
            remote_module.is_scriptable,
            remote_module.get_module_rref().owner_name(),
            remote_module.forward(torch.ones(1), 2)[1],
        )
    return forms


def test_remote_device_names_a_worker_or_a_rank_and_a_device(cluster, no_rrefs_left_behind):
    assert cluster.run(_remote_device_forms) == {
        "worker1/cpu": ("worker1", "cpu", False, False, "worker1", 2),
        "worker1": ("worker1", "cpu", False, False, "worker1", 2),
        "rank:1/cpu": (1, "cpu", False, False, "worker1", 2),
        "rank:1": (1, "cpu", False, False, "worker1", 2),
        "worker1/cpu:0": ("worker1", "cpu:0", False, False, "worker1", 2),
    }


def _on_this_worker():
    x = _inputs(2, 4)
    remote_mlp = RemoteModule("worker0/cpu", _mlp)
    params = [p.to_here().detach() for p in remote_mlp.remote_parameters()]
    return remote_mlp.forward(x).detach(), _mlp()(x).detach(), params


def test_a_remote_module_on_the_calling_worker_works_too(cluster, no_rrefs_left_behind):
    remote_out, local_out, params = cluster.run(_on_this_worker)
    assert torch.equal(remote_out, local_out)
    assert [p.shape for p in params] == [p.shape for p in _mlp().parameters()]


# -- remote_device strings --------------------------------------------------------


def _construct(remote_device):
    return _outcome(lambda: RemoteModule(remote_device, Echo, args=(1,)).on)


PARSE_ERROR = "Could not parse remote_device: {}. The valid format is '<workername>/<device>'"


@pytest.mark.parametrize(
    "remote_device, error, pattern",
    [
        (
            "worker1/foo",
            "RuntimeError",
            r"Expected one of .+ device type at start of device string",
        ),
        ("worker1/cpu2", "RuntimeError", r"Invalid device string: 'cpu2'"),
        ("worker1/", "RuntimeError", r"Device string must not be empty"),
        ("worker1/cuda:0/cuda:1", "ValueError", PARSE_ERROR.format("worker1/cuda:0/cuda:1")),
        ("/", "ValueError", PARSE_ERROR.format("/")),
        ("/cuda:0", "ValueError", PARSE_ERROR.format("/cuda:0")),
        ("", "ValueError", PARSE_ERROR.format("")),
        ("a:b:c/cpu", "ValueError", PARSE_ERROR.format("a:b:c/cpu")),
        ("foo:1/cpu", "ValueError", PARSE_ERROR.format("foo:1/cpu")),
        ("rank:x/cpu", "ValueError", PARSE_ERROR.format("rank:x/cpu")),
        (3, "TypeError", r"Invalid type for remote_device: <class 'int'>"),
        ("cpu", "TypeError", r"remote_device 'cpu' names a device but no worker"),
    ],
)
def test_bad_remote_device_raises_as_in_torch(
    cluster, no_rrefs_left_behind, remote_device, error, pattern
):
    kind, message = cluster.run(_construct, remote_device)
    assert kind == error, message
    assert re.search(pattern, message), message


def _unknown_workers():
    return [
        (_construct("nosuch/cpu"), _outcome(rrpc.get_worker_info, "nosuch")),
        (_construct("rank:9/cpu"), _outcome(rrpc.get_worker_info, 9)),
    ]


def test_an_unknown_worker_raises_at_construction_as_get_worker_info(cluster, no_rrefs_left_behind):
    for construct, lookup in cluster.run(_unknown_workers):
        assert construct == lookup
        assert construct[0] != "returned"


def test_without_rpc_it_raises_as_in_torch():
    with pytest.raises(AssertionError, match=r"^RemoteModule only works in RPC\.$"):
        RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))


# -- Errors of the module class ---------------------------------------------------


def _bad_module_classes():
    not_a_module = RemoteModule("worker1/cpu", NotAModule, args=(1,), kwargs={"first_kwarg": 2})
    bad_arguments = RemoteModule("worker1/cpu", nn.Linear, args=("four",))
    return {
        "not a module": _outcome(not_a_module.forward),
        "bad arguments forward": _outcome(bad_arguments.forward, torch.ones(4)),
        "bad arguments async": _outcome(lambda: bad_arguments.forward_async(torch.ones(4)).wait()),
        "bad arguments remote_parameters": _outcome(bad_arguments.remote_parameters)[0],
    }


def test_an_error_of_module_cls_is_raised_by_the_first_use_with_its_type(
    cluster, no_rrefs_left_behind
):
    got = cluster.run(_bad_module_classes)
    kind, message = got["not a module"]
    assert kind == "ValueError"
    assert message.startswith(
        "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
        "but it returns an instance of <class 'test_remote_module.NotAModule'>."
    )
    assert got["bad arguments forward"][0] == got["bad arguments async"][0] == "TypeError"
    assert "out_features" in got["bad arguments forward"][1]
    assert got["bad arguments remote_parameters"] == "TypeError"


def _with_module_interface():
    made = RemoteModule("worker1/cpu", nn.Linear, args=(2, 2))
    return (
        _outcome(_RemoteModule, "worker1/cpu", nn.Linear, (2, 2), None, _module_interface_cls=Echo),
        _outcome(
            RemoteModule.init_from_module_rref,
            "worker1",
            made.module_rref,
            _module_interface_cls=Echo,
        ),
    )


def test_a_torchscript_module_interface_raises_not_implemented(cluster, no_rrefs_left_behind):
    for kind, message in cluster.run(_with_module_interface):
        assert kind == "NotImplementedError"
        assert "rrpc does not support TorchScript" in message and "Echo" in message


# -- Parameters, gradients, optimizer -------------------------------------------------


def _parameters_and_module_rref():
    remote_mlp = RemoteModule("worker1/cpu", _mlp)
    echo = RemoteModule("worker1", Echo, args=(1,))
    rref = remote_mlp.get_module_rref()
    params = remote_mlp.remote_parameters()
    return {
        "values": [p.to_here().detach() for p in params],
        "owners": {p.owner_name() for p in params},
        "local": [p.detach() for p in _mlp().parameters()],
        "not recursing": len(remote_mlp.remote_parameters(recurse=False)),
        "echo not recursing": [p.to_here() for p in echo.remote_parameters(recurse=False)],
        "get_module_rref is module_rref": rref is remote_mlp.module_rref,
        "module type": type(rref.to_here()).__name__,
        "rref owner": rref.owner_name(),
    }


def test_remote_parameters_are_rrefs_to_the_remote_modules_parameters(
    cluster, no_rrefs_left_behind
):
    got = cluster.run(_parameters_and_module_rref)
    assert len(got["values"]) == 4
    for remote, local in zip(got["values"], got["local"], strict=True):
        assert torch.equal(remote, local)
    assert got["owners"] == {"worker1"}
    assert got["not recursing"] == 0  # a Sequential holds no parameter itself
    assert got["echo not recursing"] == [torch.ones(1)]
    assert got["get_module_rref is module_rref"]
    assert (got["module type"], got["rref owner"]) == ("Sequential", "worker1")


def _gradients_like_local():
    remote_mlp = RemoteModule("worker1/cpu", _mlp)
    local = _mlp()
    x = _inputs(5, 4).requires_grad_()
    with rrpc.autograd.context() as context_id:
        loss = remote_mlp(x).sum() + (remote_mlp.forward_async(x * 2).wait() ** 2).sum()
        rrpc.autograd.backward(context_id, [loss])
        x_grad = rrpc.autograd.get_gradients(context_id)[x]
        remote = rrpc.rpc_sync(
            "worker1", _gradients_on_owner, args=(remote_mlp.get_module_rref(), context_id)
        )
    local_x = x.detach().clone().requires_grad_()
    (local(local_x).sum() + (local(local_x * 2) ** 2).sum()).backward()
    return remote, [p.grad for p in local.parameters()], x_grad, local_x.grad


def test_gradients_through_distributed_autograd_equal_local_backward(cluster, no_rrefs_left_behind):
    remote, local, x_grad, local_x_grad = cluster.run(_gradients_like_local)
    assert len(remote) == len(local) == 4
    for r, g in zip(remote, local, strict=True):
        _assert_close(r, g)
    _assert_close(x_grad, local_x_grad)


def _optimizer_steps_like_local(steps):
    remote_mlp = RemoteModule("worker1/cpu", _mlp)
    torch.manual_seed(11)
    head = nn.Linear(3, 1)  # a local layer in the same optimizer, as in a hybrid model
    local_mlp, local_head = _mlp(), copy.deepcopy(head)
    params = remote_mlp.remote_parameters() + [rrpc.RRef(p) for p in head.parameters()]
    optimizer = rrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    local_params = list(local_mlp.parameters()) + list(local_head.parameters())
    local_optimizer = torch.optim.SGD(local_params, lr=0.1, momentum=0.9)
    for step in range(steps):
        x, target = _inputs(8, 4, seed=step), _inputs(8, 1, seed=100 + step)
        with rrpc.autograd.context() as context_id:
            loss = ((head(remote_mlp(x)) - target) ** 2).mean()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        ((local_head(local_mlp(x)) - target) ** 2).mean().backward()
        local_optimizer.step()
    trained = [p.to_here().detach() for p in remote_mlp.remote_parameters()]
    trained += [p.detach() for p in head.parameters()]
    initial = [p.detach() for p in _mlp().parameters()]
    return trained, [p.detach() for p in local_params], initial


def test_distributed_optimizer_over_remote_parameters_equals_local_steps(
    cluster, no_rrefs_left_behind
):
    trained, local, initial = cluster.run(_optimizer_steps_like_local, 5)
    assert len(trained) == len(local) == 6
    for remote, expected in zip(trained, local, strict=True):
        _assert_close(remote, expected)
    assert not torch.equal(trained[0], initial[0])  # it did train


# -- train / eval -------------------------------------------------------------------


def _train_and_eval():
    remote_net = RemoteModule("worker1/cpu", _mlp_with_dropout)
    rref = remote_net.get_module_rref()
    flags = {"initially": _flags(rref)}
    flags["eval returns self"] = remote_net.eval() is remote_net
    flags["after eval"] = _flags(rref)
    x = _inputs(16, 4)
    flags["eval forward is deterministic"] = torch.equal(remote_net(x), remote_net(x))
    flags["train returns self"] = remote_net.train() is remote_net
    flags["after train"] = _flags(rref)
    remote_net.train(False)
    flags["after train(False)"] = _flags(rref)
    flags["local flag untouched"] = remote_net.training
    return flags


def test_train_and_eval_set_the_remote_modules_mode(cluster, no_rrefs_left_behind):
    # torch's train() ignores its mode and returns a copy of the remote module;
    # rrpc's passes the mode on and returns the RemoteModule (see remote_module.py).
    assert cluster.run(_train_and_eval) == {
        "initially": [True, True, True],
        "eval returns self": True,
        "after eval": [False, False, False],
        "eval forward is deterministic": True,
        "train returns self": True,
        "after train": [True, True, True],
        "after train(False)": [False, False, False],
        "local flag untouched": True,
    }


# -- nn.Module methods it does not support ----------------------------------------------


def _hook(module, grad_input, grad_output):
    return None


UNSUPPORTED = [
    ("register_buffer", ("buffer", torch.ones(5))),
    ("register_parameter", ("param", nn.Parameter(torch.ones(1)))),
    ("add_module", ("empty", None)),
    ("apply", (_hook,)),
    ("cuda", ()),
    ("ipu", ()),
    ("xpu", ()),
    ("cpu", ()),
    ("type", (torch.FloatTensor,)),
    ("float", ()),
    ("double", ()),
    ("half", ()),
    ("bfloat16", ()),
    ("to", ("cpu",)),
    ("register_backward_hook", (_hook,)),
    ("register_forward_pre_hook", (_hook,)),
    ("register_forward_hook", (_hook,)),
    ("state_dict", ()),
    ("load_state_dict", ({},)),
    ("named_parameters", ()),
    ("buffers", ()),
    ("named_buffers", ()),
    ("children", ()),
    ("named_children", ()),
    ("modules", ()),
    ("named_modules", ()),
    ("requires_grad_", ()),
    ("zero_grad", ()),
    ("share_memory", ()),
    ("extra_repr", ()),
]


def _unsupported_methods():
    remote_module = RemoteModule("worker1/cpu", Echo, args=(1,))
    got = {name: _outcome(getattr(remote_module, name), *args) for name, args in UNSUPPORTED}
    got["parameters"] = _outcome(remote_module.parameters)
    got["repr"] = _outcome(repr, remote_module)
    got["still works"] = remote_module.forward(torch.ones(1), 2)[1]
    return got


def test_unsupported_nn_module_methods_raise_as_in_torch(cluster, no_rrefs_left_behind):
    got = cluster.run(_unsupported_methods)
    for name, _ in UNSUPPORTED:
        assert got[name] == ("ValueError", f"Method ``{name}`` not supported for RemoteModule")
    assert got["parameters"] == (
        "ValueError",
        "Method ``parameters`` not supported for RemoteModule. "
        "Please use ``remote_parameters`` instead.",
    )
    # As in torch, repr() needs extra_repr().
    assert got["repr"] == ("ValueError", "Method ``extra_repr`` not supported for RemoteModule")
    assert got["still works"] == 2


# -- Pickling -----------------------------------------------------------------------

CANNOT_PICKLE = (
    "RuntimeError",
    "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC",
)


def _pickled_outside_rpc():
    remote_module = RemoteModule("worker1/cpu", Echo, args=(1,))
    return {
        "pickle": _outcome(pickle.dumps, remote_module),
        "torch.save": _outcome(torch.save, remote_module, io.BytesIO()),
        "copy": _outcome(copy.copy, remote_module),
        "deepcopy": _outcome(copy.deepcopy, remote_module),
        "setstate": _outcome(remote_module.__setstate__, {}),
        "still works": remote_module.forward(torch.ones(1), 2)[1],
    }


def test_pickling_outside_rpc_raises_as_in_torch(cluster, no_rrefs_left_behind):
    got = cluster.run(_pickled_outside_rpc)
    for way in ("pickle", "torch.save", "copy", "deepcopy"):
        assert got[way] == CANNOT_PICKLE, way
    assert got["setstate"] == (
        "RuntimeError",
        "Cannot unpickle RemoteModule in python pickler. "
        "RemoteModule can only be unpickled when using RPC",
    )
    assert got["still works"] == 2


def _sent_to_a_third_worker():
    args = (torch.ones(1), 2, "3")
    remote_module = RemoteModule("worker1/cpu", Echo, args=(1,))
    attributes = rrpc.rpc_sync("worker2", _attributes, args=(remote_module,))
    got = {
        "keys": list(attributes),
        "values": {name: attributes[name] for name in ("on", "device", "is_device_map_set")},
        "is_scriptable": attributes["is_scriptable"],
        "forward there": rrpc.rpc_sync("worker2", _forward_there, args=(remote_module, args)),
        "forward_async there": rrpc.rpc_sync(
            "worker2", _forward_async_there, args=(remote_module, args)
        ),
    }
    remote_module.new_attr = 1
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        attributes = rrpc.rpc_sync("worker2", _attributes, args=(remote_module,))
    got["new attribute sent"] = "new_attr" in attributes
    got["note"] = stderr.getvalue()
    # Made on worker2 and returned: usable here.
    returned = rrpc.rpc_sync("worker2", _make_remote_module, args=("worker1/cpu",))
    got["returned"] = (type(returned).__name__, returned.on, returned.forward(*args))
    return got


def test_a_remote_module_sent_to_a_third_worker_runs_forward_on_its_owner(
    cluster, no_rrefs_left_behind
):
    got = cluster.run(_sent_to_a_third_worker)
    # torch's expectation: the pickled attributes, then the two installed methods.
    assert got["keys"] == [*_REMOTE_MODULE_PICKLED_ATTRIBUTES, "forward_async", "forward"]
    assert got["values"] == {"on": "worker1", "device": "cpu", "is_device_map_set": False}
    assert got["is_scriptable"] is False
    assert got["forward there"] == got["forward_async there"] == ("3", 2, torch.ones(1))
    assert got["new attribute sent"] is False
    assert "The new attribute ``new_attr`` of RemoteModule is ignored" in got["note"]
    assert got["returned"] == ("RemoteModule", "worker1", ("3", 2, torch.ones(1)))


def _from_module_rref():
    x = _inputs(3, 4)
    remote_mlp = RemoteModule("worker1/cpu", _mlp)
    on_worker2 = rrpc.rpc_sync(
        "worker2", RemoteModule.init_from_module_rref, args=("worker2", remote_mlp.module_rref)
    )
    here = RemoteModule.init_from_module_rref("worker1/cpu", remote_mlp.get_module_rref())
    here.eval()  # one module behind both: the original sees it
    flags = _flags(remote_mlp.get_module_rref())
    return {
        "types": (type(on_worker2).__name__, type(here).__name__),
        "keys": list(here.__dict__),
        "on": (on_worker2.on, here.on),
        "forward": [
            remote_mlp.forward(x).detach(),
            rrpc.rpc_sync("worker2", _forward_there, args=(on_worker2, (x,))).detach(),
            on_worker2.forward(x).detach(),
            here.forward(x).detach(),
        ],
        "local": _mlp()(x).detach(),
        "parameters": [len(on_worker2.remote_parameters()), len(here.remote_parameters())],
        "owner after eval": flags,
    }


def test_init_from_module_rref_shares_the_remote_module(cluster, no_rrefs_left_behind):
    got = cluster.run(_from_module_rref)
    assert got["types"] == ("RemoteModule", "RemoteModule")
    assert got["keys"] == [*_REMOTE_MODULE_PICKLED_ATTRIBUTES, "forward_async", "forward"]
    assert got["on"] == ("worker2", "worker1")
    for out in got["forward"]:
        assert torch.equal(out, got["local"])
    # torch asks `on` (worker2) for the parameters and fails; rrpc asks the owner.
    assert got["parameters"] == [4, 4]
    assert got["owner after eval"] == [False, False, False, False]
