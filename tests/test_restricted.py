"""Restricted mode (issue #14): peers run only what a worker exposed, and send only safe types.

One world for the whole file (``world``): worker0 and worker1 run in
restricted mode, worker2 does not (the control). Every scenario runs on
worker0 and records what it saw; the tests read those records. Hostile
frames go through a raw gRPC client that knows the auth token, as an
authenticated but untrusted peer would.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch
from test_security import _CreatesFile, _encoded_call, _raw_exchange

import rrpc
from harness import run_command, run_workers
from rrpc import codec, restricted
from rrpc.functions import async_execution, expose
from rrpc.messages import ERROR, REPLY

TOKEN = "restricted-token"
expose(torch.mul)  # a torch builtin, exposed by a call; torch.add stays unexposed


# -- What peers may call ---------------------------------------------------------
@expose
def echo(value):
    return value


@expose
def whoami():
    return rrpc.get_worker_info().name


@expose
def my_address():
    return rrpc.agent.current_agent().address


@expose
def fork_value(rref):
    return rref.to_here()


def not_exposed(x):
    return x


@expose
@async_execution
def async_outer(x):
    future = torch.futures.Future()
    future.set_result(x + 1)
    return future


@async_execution
@expose
def async_inner(x):
    return rrpc.rpc_async("worker1", echo, args=(x * 2,))


@expose
class Counter:
    def __init__(self, start=0):
        self.count = start

    def increment(self, by=1):
        self.count += by
        return self.count

    def _secret(self):
        return "secret"

    def make_hidden(self):
        return Hidden()

    @staticmethod
    @expose
    @async_execution
    def static_async(x):
        future = torch.futures.Future()
        future.set_result(x * 10)
        return future

    @classmethod
    @expose
    def named(cls, start):
        return cls(start).count


class Hidden:
    def peek(self):
        return "peeked"

    @expose
    def allowed(self):
        return "allowed"


@expose
def make_hidden():
    return Hidden()


class NotExposedError(ValueError):
    pass


@expose
class ExposedError(ValueError):
    pass


@expose
def raise_builtin():
    raise KeyError("missing key")


@expose
def raise_custom():
    raise NotExposedError("custom text")


@expose
def raise_exposed():
    raise ExposedError("exposed text")


# -- Hostile pickles -------------------------------------------------------------
class _RunsShell:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Evals:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (eval, (f"open({self.path!r}, 'w')",))


HOSTILE = {"open": _CreatesFile, "os.system": _RunsShell, "eval": _Evals}


def _reply(frame):
    if frame.envelope.kind == ERROR:
        _blob, type_name, message, _text, _where = codec.loads(frame)
        return {"error": type_name, "message": message}
    assert frame.envelope.kind == REPLY
    return {"value": codec.loads(frame)}


def _outcome(call, *args, **kwargs):
    try:
        return {"value": call(*args, **kwargs)}
    except Exception as exc:
        kind = type(exc)
        return {"exc_type": f"{kind.__module__}.{kind.__qualname__}", "message": str(exc)}


def _hostile(marker_dir):
    seen = {}
    for target, rank in (("worker1", 1), ("worker2", 2)):
        address = rrpc.rpc_sync(target, my_address)
        for name, maker in HOSTILE.items():
            marker = os.path.join(marker_dir, f"{target}-{name}")
            packet = _encoded_call(echo, (maker(marker),))
            frames, error = _raw_exchange(
                address, [packet], [("rrpc-rank", "0")], token=TOKEN, callee_rank=rank
            )
            seen[(target, name)] = {
                "grpc error": error,
                "replies": [_reply(f) for f in frames],
                "marker exists": os.path.exists(marker),
            }
        # A cloudpickled lambda (code by value) and a non-exposed function.
        packet = _encoded_call(lambda: 1, ())
        frames, _ = _raw_exchange(
            address, [packet], [("rrpc-rank", "0")], token=TOKEN, callee_rank=rank
        )
        seen[(target, "lambda")] = [_reply(f) for f in frames]
    return seen


def _calls():
    seen = {}
    seen["not exposed"] = _outcome(rrpc.rpc_sync, "worker1", not_exposed, args=(1,))
    seen["not exposed, unrestricted callee"] = _outcome(
        rrpc.rpc_sync, "worker2", not_exposed, args=(1,)
    )
    seen["torch.add"] = _outcome(rrpc.rpc_sync, "worker1", torch.add, args=(torch.ones(2), 1))
    seen["torch.mul"] = _outcome(rrpc.rpc_sync, "worker1", torch.mul, args=(torch.ones(2), 3))
    seen["builtin dict"] = _outcome(rrpc.rpc_sync, "worker1", dict, kwargs={"a": 1})
    seen["exposed"] = _outcome(rrpc.rpc_sync, "worker1", whoami)
    seen["async outer"] = _outcome(rrpc.rpc_sync, "worker1", async_outer, args=(1,))
    seen["async inner"] = _outcome(rrpc.rpc_sync, "worker1", async_inner, args=(3,))
    seen["static async"] = _outcome(rrpc.rpc_sync, "worker1", Counter.static_async, args=(2,))
    seen["classmethod"] = _outcome(rrpc.rpc_sync, "worker1", Counter.named, args=(7,))
    seen["lambda"] = _outcome(rrpc.rpc_sync, "worker1", lambda: 1)

    counter = rrpc.remote("worker1", Counter, args=(5,))
    seen["proxy rpc_sync"] = _outcome(lambda: counter.rpc_sync().increment(2))
    seen["proxy rpc_async"] = _outcome(lambda: counter.rpc_async().increment(3).wait())
    seen["proxy remote"] = _outcome(lambda: counter.remote().increment(1).to_here())
    seen["proxy private"] = _outcome(lambda: counter.rpc_sync()._secret())
    seen["owner value"] = _outcome(lambda: counter.to_here().count)
    hidden = rrpc.remote("worker1", make_hidden)
    seen["hidden public"] = _outcome(lambda: hidden.rpc_sync().peek())
    seen["hidden exposed method"] = _outcome(lambda: hidden.rpc_sync().allowed())
    seen["remote not exposed"] = _outcome(
        lambda: rrpc.remote("worker1", not_exposed, args=(1,)).to_here()
    )
    seen["remote of dict"] = _outcome(lambda: rrpc.remote("worker1", dict).to_here())
    seen["remote class not exposed"] = _outcome(lambda: rrpc.remote("worker1", Hidden).to_here())
    seen["after refusals"] = _outcome(rrpc.rpc_sync, "worker1", whoami)
    return seen


def _types():
    seen = {}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    values = {
        "tensor": base,
        "strided view": base[:, 1::2],
        "parameter": torch.nn.Parameter(torch.ones(3)),
        "sparse": torch.eye(3).to_sparse(),
        "int tensor": torch.arange(5),
        "containers": (
            [1, 2.5, "s", b"b", None, True, 1 + 2j],
            {"k": (1, 2)},
            {1, 2},
            frozenset({3}),
            slice(1, 5, 2),
            range(3),
            bytearray(b"ba"),
            collections.OrderedDict(a=1),
        ),
        "torch types": (torch.float16, torch.device("cpu"), torch.Size([2, 3]), torch.strided),
        "worker info": rrpc.get_worker_info("worker2"),
    }
    for name, value in values.items():
        seen[name] = (value, _outcome(rrpc.rpc_sync, "worker1", echo, args=(value,)))
    # An RRef owned by worker2, sent to worker1 and read there; and one coming back.
    rref = rrpc.remote("worker2", echo, args=(torch.ones(2),))
    seen["rref"] = _outcome(rrpc.rpc_sync, "worker1", fork_value, args=(rref,))
    back = rrpc.rpc_sync("worker1", echo, args=(rref,))
    seen["rref back"] = {"owner": back.owner().name, "value": back.to_here()}
    seen["not exposed instance"] = _outcome(rrpc.rpc_sync, "worker1", echo, args=(Hidden(),))
    seen["not exposed instance back"] = _outcome(rrpc.rpc_sync, "worker1", make_hidden)
    seen["builtin error"] = _outcome(rrpc.rpc_sync, "worker1", raise_builtin)
    seen["custom error"] = _outcome(rrpc.rpc_sync, "worker1", raise_custom)
    seen["exposed error"] = _outcome(rrpc.rpc_sync, "worker1", raise_exposed)
    seen["custom error via remote"] = _outcome(
        lambda: rrpc.remote("worker1", raise_custom).to_here()
    )
    seen["custom error, unrestricted callee"] = _outcome(rrpc.rpc_sync, "worker2", raise_custom)
    return seen


def _restricted_world(rank, world_size, marker_dir):
    options = rrpc.RpcBackendOptions(auth_token=TOKEN, restricted=rank != 2)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = None
    if rank == 0:
        seen = {"hostile": _hostile(marker_dir), "calls": _calls(), "types": _types()}
    rrpc.shutdown()
    return seen


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    marker_dir = str(tmp_path_factory.mktemp("markers"))
    return run_workers(_restricted_world, 3, args=(marker_dir,), init=False, timeout=90)[0]


# -- Hostile pickles ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_pickle_that_runs_code_is_refused_even_with_the_right_token(world, name):
    seen = world["hostile"][("worker1", name)]
    assert seen["grpc error"] is None  # authenticated: the frame was read, then refused
    assert not seen["marker exists"]
    [reply] = seen["replies"]
    assert reply["error"] == "rrpc.messages.SerializationError"
    global_name = {"open": "io.open", "os.system": "posix.system", "eval": "builtins.eval"}
    assert f"the global {global_name[name]}" in reply["message"]
    assert "restricted mode refuses" in reply["message"]


@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_same_frame_runs_without_restricted_mode(world, name):
    seen = world["hostile"][("worker2", name)]
    assert seen["marker exists"]  # the control: the default mode trusts authenticated peers


def test_code_sent_by_value_is_refused(world):
    [reply] = world["hostile"][("worker1", "lambda")]
    assert reply["error"] == "rrpc.messages.SerializationError"
    assert "cloudpickle" in reply["message"]
    assert world["hostile"][("worker2", "lambda")] == [{"value": 1}]


# -- Calls -------------------------------------------------------------------------


def test_a_function_not_exposed_is_refused_with_how_to_expose_it(world):
    calls = world["calls"]
    refused = calls["not exposed"]
    assert refused["exc_type"] == "rrpc.messages.SerializationError"
    assert "test_restricted.not_exposed" in refused["message"]
    assert "@rrpc.functions.expose" in refused["message"]
    assert calls["not exposed, unrestricted callee"] == {"value": 1}
    assert "torch._C._VariableFunctionsClass.add" in calls["torch.add"]["message"]
    assert calls["torch.mul"]["value"].tolist() == [3.0, 3.0]
    # A safe type may travel, but is not callable unless exposed.
    assert calls["builtin dict"]["exc_type"] == "rrpc.functions.NotExposedError"
    assert "builtins.dict is not exposed" in calls["builtin dict"]["message"]
    assert calls["lambda"]["exc_type"] == "rrpc.messages.SerializationError"
    assert calls["after refusals"] == {"value": "worker1"}


def test_exposed_functions_run_including_async_static_and_class_methods(world):
    calls = world["calls"]
    assert calls["exposed"] == {"value": "worker1"}
    assert calls["async outer"] == {"value": 2}
    assert calls["async inner"] == {"value": 6}
    assert calls["static async"] == {"value": 20}
    assert calls["classmethod"] == {"value": 7}


def test_rref_of_an_exposed_class_and_its_proxies(world):
    calls = world["calls"]
    assert calls["proxy rpc_sync"] == {"value": 7}
    assert calls["proxy rpc_async"] == {"value": 10}
    assert calls["proxy remote"] == {"value": 11}
    assert calls["owner value"] == {"value": 11}  # an exposed class's instance travels


def test_proxies_refuse_private_methods_and_classes_not_exposed(world):
    calls = world["calls"]
    assert calls["proxy private"]["exc_type"] == "rrpc.functions.NotExposedError"
    assert "'_secret'" in calls["proxy private"]["message"]
    assert calls["hidden public"]["exc_type"] == "rrpc.functions.NotExposedError"
    assert "test_restricted.Hidden" in calls["hidden public"]["message"]
    assert calls["hidden exposed method"] == {"value": "allowed"}
    assert calls["remote not exposed"]["exc_type"] == "rrpc.messages.SerializationError"
    assert "the global test_restricted.not_exposed" in calls["remote not exposed"]["message"]
    assert calls["remote of dict"]["exc_type"] == "rrpc.functions.NotExposedError"
    assert "builtins.dict is not exposed" in calls["remote of dict"]["message"]
    # A class not exposed does not even unpickle: refused before anything runs.
    refused_class = calls["remote class not exposed"]
    assert refused_class["exc_type"] == "rrpc.messages.SerializationError"
    assert "the global test_restricted.Hidden" in refused_class["message"]


# -- Types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["tensor", "strided view", "parameter", "sparse", "int tensor", "containers", "torch types",
     "worker info"],
)  # fmt: skip
def test_safe_types_travel(world, name):
    sent, received = world["types"][name]
    assert "value" in received, received
    value = received["value"]
    if isinstance(sent, torch.Tensor):
        assert type(value) is type(sent)
        assert torch.equal(value.to_dense(), sent.to_dense())
    else:
        assert value == sent
        if isinstance(sent, tuple):
            assert [type(v) for v in value] == [type(v) for v in sent]


def test_rrefs_travel(world):
    types = world["types"]
    assert types["rref"]["value"].tolist() == [1.0, 1.0]
    assert types["rref back"]["owner"] == "worker2"
    assert types["rref back"]["value"].tolist() == [1.0, 1.0]


def test_instances_of_classes_not_exposed_are_refused_both_ways(world):
    types = world["types"]
    assert "the global test_restricted.Hidden" in types["not exposed instance"]["message"]
    back = types["not exposed instance back"]
    assert back["exc_type"] == "rrpc.messages.SerializationError"
    assert "the global test_restricted.Hidden" in back["message"]


def test_exceptions_come_back_builtin_and_exposed_as_themselves_others_as_remote_error(world):
    types = world["types"]
    assert types["builtin error"]["exc_type"] == "builtins.KeyError"
    assert "missing key" in types["builtin error"]["message"]
    assert types["exposed error"]["exc_type"] == "test_restricted.ExposedError"
    for name in ("custom error", "custom error via remote", "custom error, unrestricted callee"):
        error = types[name]
        assert error["exc_type"] == "rrpc.messages.RemoteError", (name, error)
        assert "test_restricted.NotExposedError" in error["message"]
        assert "custom text" in error["message"]


# -- The parameter-server example, restricted ---------------------------------------

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "param_server" / "main.py"


@pytest.mark.timeout(270)
def test_the_parameter_server_example_runs_in_restricted_mode(tmp_path):
    env = {**os.environ, "RRPC_RESTRICTED": "1"}
    command = [sys.executable, str(EXAMPLE), "--smoke", "--mode", "sync", "--out", str(tmp_path)]
    run = run_command(command, timeout=240, env=env)
    assert run.returncode == 0, run.stdout[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["restricted"] is True
    assert (metrics["framework"], metrics["mode"], metrics["trainers"]) == ("rrpc", "sync", 2)
    history = metrics["history"]
    assert [h["epoch"] for h in history] == list(range(1, metrics["epochs"] + 1))
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert metrics["final_test_accuracy"] >= 0.93, run.stdout[-3000:]


# -- Resources a pickle can claim --------------------------------------------------


@pytest.mark.parametrize("opcode", [b"r", b"j"])  # LONG_BINPUT, LONG_BINGET
def test_a_nine_byte_pickle_naming_a_huge_memo_index_is_refused_before_unpickling(opcode):
    # CPython 3.11 grows its memo to twice the index and clears every slot, with
    # the GIL held: index 2**28 cost 8.9 s and 4 GiB of memory here.
    data = b"\x80\x05N" + opcode + (1 << 28).to_bytes(4, "little") + b"."
    start = time.monotonic()
    with pytest.raises(restricted.RefusedGlobalError, match="memo index 268435456"):
        restricted.loads(data)
    assert time.monotonic() - start < 1.0
    shared = {"a": (1, 2)}  # memoized once, named again: small indices pass
    value = [shared, shared, [3.0]]
    assert restricted.loads(pickle.dumps(value, protocol=2)) == value
