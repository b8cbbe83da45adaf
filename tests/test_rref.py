"""RRefs between real worker processes: remote(), RRef methods, forks, lifetimes.

Most tests share one world of three workers (the `cluster` fixture): the test
sends a module-level function to worker0, which runs it there and sends back
its return value. worker1 usually owns the values, worker2 is the third
worker that RRefs are forked to. After each of those tests every worker's RRef
tables must be empty again (`no_rrefs_left_behind`).
"""

from __future__ import annotations

import gc
import logging
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import rrpc
from harness import WorkerGroup, mp_context, run_workers
from rrpc import agent as agent_hooks
from rrpc.messages import RREF_ACCEPT, RREF_CREATE_FAILED, RREF_DELETE, RREF_FETCH

WORKERS = ("worker0", "worker1", "worker2")
ZERO_DEBUG_INFO = {
    "num_owner_rrefs": 0,
    "num_owner_forks": 0,
    "num_user_rrefs": 0,
    "num_pending_confirmations": 0,
    "num_pending_forks": 0,
    "num_pending_children": 0,
    "num_pending_deletes": 0,
    "num_pending_accepts": 0,
}

# The shared world is conftest's `cluster` fixture (a harness.Cluster of 3).


@pytest.fixture
def no_rrefs_left_behind(cluster):
    yield
    infos = cluster.run(_wait_for_empty_tables)
    assert infos == [ZERO_DEBUG_INFO] * 3


# -- Helpers the workers run ---------------------------------------------------


def wait_until(condition, timeout=10.0, what="condition"):
    """Poll `condition()` until it returns a true value; return it, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} still false after {timeout} s")
        time.sleep(0.005)


def _collect_and_debug_info():
    gc.collect()
    return rrpc.rref_debug_info()


def _debug_infos():
    return [rrpc.rpc_sync(name, _collect_and_debug_info) for name in WORKERS]


def _wait_for_empty_tables(timeout=10.0):
    last = []

    def empty():
        last[:] = _debug_infos()
        return all(info == ZERO_DEBUG_INFO for info in last)

    try:
        wait_until(empty, timeout, "empty RRef tables")
    except AssertionError:
        pass
    return last


def _settle_messages(timeout=10.0):
    """Wait until no worker has an RRef message in flight or a fork unconfirmed."""

    def settled():
        infos = _debug_infos()
        return not any(v for info in infos for k, v in info.items() if k.startswith("num_pending"))

    wait_until(settled, timeout, "RRef messages settled")


def _raise(exc):
    raise exc


def _outcome(fn, *args, **kwargs):
    """(type name, message) of what fn raises, or ("returned", value)."""
    try:
        return "returned", fn(*args, **kwargs)
    except Exception as exc:
        # An error raised by torch.futures.Future.wait() (the user's own
        # rpc_async() future) has the Future in its traceback and the Future
        # holds the error: an uncollectable cycle that would keep this stack's
        # RRefs alive. rrpc's own calls raise copies and need no such care.
        exc.__traceback__ = None
        return type(exc).__name__, str(exc)


class Box:
    """A value with methods, owned by one worker and used through RRefs."""

    def __init__(self, value):
        self.value = value

    def add(self, x, *, times=1):
        self.value += x * times
        return self.value

    def where(self):
        return rrpc.get_worker_info().name

    def fail(self):
        raise KeyError("no such key in the box")

    def nap(self, seconds):
        time.sleep(seconds)

    @staticmethod
    @rrpc.functions.async_execution
    def later(x):
        future = torch.futures.Future()
        threading.Timer(0.05, lambda: future.set_result(x * 10)).start()
        return future

    @staticmethod
    @rrpc.functions.async_execution
    def later_then(x):
        return Box.later(x).then(lambda done: done.wait() + 1)  # a plain torch._C.Future

    @staticmethod
    @rrpc.functions.async_execution
    def not_a_future(x):
        return x  # breaks the promise: the caller gets torch's error


def _seeded_linear():
    torch.manual_seed(7)
    return torch.nn.Linear(4, 3)


_remembered: dict = {}


def _remember(key, value):
    _remembered[key] = value
    return value


def _forget(key):
    _remembered.pop(key, None)


def _is_remembered(rref, key):
    return rref.is_owner(), rref.local_value() is _remembered[key]


def _describe_rref(rref):
    return {
        "to_here": rref.to_here(),
        "is_owner": rref.is_owner(),
        "owner": rref.owner(),
        "owner_name": rref.owner_name(),
        "here": rrpc.get_worker_info().name,
    }


def _to_here_all(container):
    return {key: [r.to_here() for r in rrefs] for key, rrefs in container.items()}


def _make_rref_on(owner, value):
    return rrpc.remote(owner, Box, args=(value,))


def _make_local_rref(value):
    return rrpc.RRef(Box(value))


def _echo(value):
    return value


# -- Methods on the owner and on users -----------------------------------------


def _owner_rref_methods():
    box = Box(5)
    rref = rrpc.RRef(box)
    confirmed = rref.confirmed_by_owner()
    return {
        "is_owner": rref.is_owner(),
        "owner": rref.owner(),
        "owner_name": rref.owner_name(),
        "confirmed": confirmed,
        "local_value is box": rref.local_value() is box,
        "to_here is box": rref.to_here() is box,
        "rpc_sync": rref.rpc_sync().add(1),
        "rpc_async": rref.rpc_async().add(2, times=2).wait(),
        "remote is_owner": (made := rref.remote().add(10)).is_owner(),
        "remote to_here": made.to_here(),
        "box after": box.value,
        "where": rref.rpc_sync().where(),
        "repr": repr(rref).split("rref_id=")[0],
    }


def test_owner_rref_methods_act_on_the_local_value(cluster, no_rrefs_left_behind):
    got = cluster.run(_owner_rref_methods)
    assert got == {
        "is_owner": True,
        "owner": rrpc.WorkerInfo("worker0", 0),
        "owner_name": "worker0",
        "confirmed": True,
        "local_value is box": True,
        "to_here is box": True,
        "rpc_sync": 6,
        "rpc_async": 10,
        "remote is_owner": True,
        "remote to_here": 20,
        "box after": 20,
        "where": "worker0",
        "repr": "OwnerRRef(",
    }


def _proxy_calls_without_protocol_messages():
    rref = rrpc.remote("worker1", Box, args=(0,))
    rref.to_here()
    _settle_messages()
    served_before = rrpc.stats()["worker1"]["calls_served"]
    for _ in range(5):
        rref.rpc_sync().add(1)
    futures = [rref.rpc_async().add(1) for _ in range(5)]
    for future in futures:
        future.wait()
    del futures
    _settle_messages()
    value = rref.to_here().value
    served = rrpc.stats()["worker1"]["calls_served"] - served_before
    # Dropped at once after rpc_async: the pending call still holds the RRef,
    # so its DELETE cannot reach the owner before the call has run.
    dropped = rrpc.remote("worker1", Box, args=(7,))
    future = dropped.rpc_async().add(1)
    del dropped
    gc.collect()
    return value, served, future.wait()


def test_proxy_calls_on_a_user_rref_cost_no_protocol_messages(cluster, no_rrefs_left_behind):
    # The RRef goes by id, not as a fork the owner would confirm with an
    # ACCEPT sent back to this worker on every call.
    total, messages_from_owner, after_drop = cluster.run(_proxy_calls_without_protocol_messages)
    assert total == 10
    assert messages_from_owner == 0
    assert after_drop == 8


def _user_rref_methods():
    rref = rrpc.remote("worker1", Box, args=(5,))
    copy = rref.to_here()
    wait_until(rref.confirmed_by_owner, what="confirmation of the remote() RRef")
    made = rref.remote().add(10, times=2)
    made_value = made.to_here()
    return {
        "is_owner": rref.is_owner(),
        "owner": rref.owner(),
        "owner_name": rref.owner_name(),
        "to_here": (type(copy).__name__, copy.value),
        "local_value": _outcome(rref.local_value),
        "rpc_sync": rref.rpc_sync().add(1),
        "rpc_async": rref.rpc_async().add(2, times=2).wait(),
        "remote is_owner": made.is_owner(),
        "remote owner": made.owner_name(),
        "remote to_here": made_value,
        "value after": rref.to_here().value,
        "where": rref.rpc_sync().where(),
        "async_execution method": rref.rpc_sync().later(4),
        "async_execution method async": rref.rpc_async().later(5).wait(),
        "async_execution .then() via remote": rref.remote().later_then(6).to_here(),
        "no Future, rpc_sync": _outcome(lambda: rref.rpc_sync().not_a_future(7)),
        "no Future, rpc_async": _outcome(lambda: rref.rpc_async().not_a_future(8).wait()),
        "no Future, remote": _outcome(lambda: rref.remote().not_a_future(9).to_here()),
        "repr": repr(rref).split("rref_id=")[0],
        "type": rref._get_type(),
    }


def test_user_rref_methods_run_on_the_owner(cluster, no_rrefs_left_behind):
    got = cluster.run(_user_rref_methods)
    kind, message = got.pop("local_value")
    assert kind == "RuntimeError"
    assert "worker1" in message and "worker0" in message
    for mode in ("rpc_sync", "rpc_async", "remote"):
        kind, message = got.pop(f"no Future, {mode}")
        assert kind == "RuntimeError", (mode, kind, message)
        assert "must return a torch.futures.Future" in message and "not_a_future" in message
    assert got == {
        "is_owner": False,
        "owner": rrpc.WorkerInfo("worker1", 1),
        "owner_name": "worker1",
        "to_here": ("Box", 5),
        "rpc_sync": 26,
        "rpc_async": 30,
        "remote is_owner": False,
        "remote owner": "worker1",
        "remote to_here": 25,
        "value after": 30,
        "where": "worker1",
        "async_execution method": 40,
        "async_execution method async": 50,
        "async_execution .then() via remote": 61,
        "repr": "UserRRef(",
        "type": Box,
    }


def _remote_to_self():
    rref = rrpc.remote("worker0", torch.add, args=(torch.ones(2), 1))
    return rref.is_owner(), rref.owner_name(), rref.to_here(), rref.local_value()


def test_remote_to_self_returns_an_owner_rref(cluster, no_rrefs_left_behind):
    is_owner, owner_name, here, local = cluster.run(_remote_to_self)
    assert (is_owner, owner_name) == (True, "worker0")
    assert torch.equal(here, torch.full((2,), 2.0)) and torch.equal(local, here)


_KEPT = Box(0)


def _kept_box():
    return _KEPT


def _remote_to_self_keeps_the_object():
    rref = rrpc.remote("worker0", _kept_box)
    same = rref.local_value() is _KEPT
    rref.rpc_sync().add(5)  # acts on the object itself, not on a copy
    lock = rrpc.remote("worker0", threading.Lock)  # does not pickle: never pickled
    arg = torch.zeros(2)
    copied = rrpc.remote("worker0", _echo, args=(arg,)).local_value()
    return same, _KEPT.value, type(lock.local_value()).__name__, copied is arg


@pytest.mark.timeout(60)
def test_remote_to_self_keeps_the_very_object_returned_as_torch(cluster, no_rrefs_left_behind):
    """torch's OwnerRRef holds what the function returned; its arguments are
    copied (they travel in the request), the result is not."""
    same, value, lock_type, arg_is_same = cluster.run(_remote_to_self_keeps_the_object)
    assert (same, value, lock_type, arg_is_same) == (True, 5, "lock", False)


def _module_forward():
    x = torch.arange(8.0).reshape(2, 4)
    rref = rrpc.remote("worker1", _seeded_linear)
    remote_out = rref.rpc_sync().forward(x)
    async_out = rref.rpc_async().forward(x).wait()
    local_out = _seeded_linear()(x)
    copied_out = rref.to_here()(x)
    return remote_out, async_out, local_out, copied_out


def test_rref_of_a_module_runs_forward_on_the_owner_like_a_local_module(
    cluster, no_rrefs_left_behind
):
    remote_out, async_out, local_out, copied_out = cluster.run(_module_forward)
    assert remote_out.shape == (2, 3)
    assert torch.equal(remote_out, local_out)
    assert torch.equal(async_out, local_out)
    assert torch.equal(copied_out, local_out)


# -- RRefs travel --------------------------------------------------------------


def _pass_to_third_worker():
    rref = rrpc.remote("worker1", torch.mul, args=(torch.arange(3), 7))
    seen = rrpc.rpc_sync("worker2", _describe_rref, args=(rref,))
    local = rrpc.RRef(torch.tensor([1.5]))
    seen_local = rrpc.rpc_sync("worker2", _describe_rref, args=(local,))
    nested = {
        "a": [rrpc.remote("worker1", torch.ones, args=(2,)), rref],
        "b": [local, rrpc.remote("worker2", torch.zeros, args=(1,))],
    }
    return seen, seen_local, rrpc.rpc_sync("worker2", _to_here_all, args=(nested,))


def test_rref_passed_to_a_third_worker_fetches_the_owners_value(cluster, no_rrefs_left_behind):
    seen, seen_local, nested = cluster.run(_pass_to_third_worker)
    assert torch.equal(seen.pop("to_here"), torch.tensor([0, 7, 14]))
    assert seen == {
        "is_owner": False,
        "owner": rrpc.WorkerInfo("worker1", 1),
        "owner_name": "worker1",
        "here": "worker2",
    }
    assert torch.equal(seen_local.pop("to_here"), torch.tensor([1.5]))
    assert seen_local["owner_name"] == "worker0" and seen_local["is_owner"] is False
    assert [t.tolist() for t in nested["a"]] == [[1.0, 1.0], [0, 7, 14]]
    assert [t.tolist() for t in nested["b"]] == [[1.5], [0.0]]


def _returned_from_rpc():
    made_remotely = rrpc.rpc_sync("worker2", _make_rref_on, args=("worker1", 3))
    made_locally = rrpc.rpc_sync("worker2", _make_local_rref, args=(4,))
    return (
        (made_remotely.owner_name(), made_remotely.is_owner(), made_remotely.to_here().value),
        (made_locally.owner_name(), made_locally.is_owner(), made_locally.to_here().value),
        made_locally.rpc_sync().where(),
    )


def test_rrefs_returned_from_an_rpc_refer_to_their_owners_value(cluster, no_rrefs_left_behind):
    assert cluster.run(_returned_from_rpc) == (
        ("worker1", False, 3),
        ("worker2", False, 4),
        "worker2",
    )


def _round_trip_to_owner():
    box = Box(1)
    mine = rrpc.RRef(box)
    back = rrpc.rpc_sync("worker1", _echo, args=(mine,))
    via_two = rrpc.rpc_sync("worker1", rrpc.rpc_sync, args=("worker2", _echo, (mine,)))
    theirs = rrpc.remote("worker1", _remember, args=("round trip", Box(2)))
    owner_view = rrpc.rpc_sync("worker1", _is_remembered, args=(theirs, "round trip"))
    rrpc.rpc_sync("worker1", _forget, args=("round trip",))
    return back is mine, via_two is mine, back.local_value() is box, owner_view


def test_rref_sent_back_to_its_owner_is_the_owners_own_object(cluster, no_rrefs_left_behind):
    assert cluster.run(_round_trip_to_owner) == (True, True, True, (True, True))


_late_release = threading.Event()
_kept_for_later: list = []


def _keep_for_later(*rrefs):
    _kept_for_later.extend(rrefs)


def _return_kept_once_released():
    """On worker1: its own RRef and its user RRefs (to worker0's and worker2's
    values), returned once the caller has given up waiting for them."""
    assert _late_release.wait(30)
    _late_release.clear()
    kept = [*_kept_for_later, rrpc.RRef(Box(3))]
    _kept_for_later.clear()
    return kept


def _release_late_reply():
    _late_release.set()


def _here_and_on(name):
    return [_collect_and_debug_info(), rrpc.rpc_sync(name, _collect_and_debug_info)]


def _rrefs_in_a_late_reply():
    kept = (rrpc.RRef(Box(1)), rrpc.remote("worker2", Box, args=(2,)))
    rrpc.rpc_sync("worker1", _keep_for_later, args=kept)
    del kept
    late = _outcome(rrpc.rpc_sync, "worker1", _return_kept_once_released, timeout=0.5)
    # From here no call goes to worker1 but through worker2: on a same-host
    # lane, worker0's next call to worker1 would read the late reply itself.
    rrpc.rpc_sync("worker2", rrpc.rpc_sync, args=("worker1", _release_late_reply))
    infos: list = []

    def empty():
        infos[:] = [
            _collect_and_debug_info(),
            *rrpc.rpc_sync("worker2", _here_and_on, ("worker1",)),
        ]
        return all(info == ZERO_DEBUG_INFO for info in infos)

    try:
        wait_until(empty, timeout=20, what="empty RRef tables")
    except AssertionError:
        pass
    return late[0], infos


@pytest.mark.timeout(90)
def test_rrefs_in_a_reply_that_comes_after_its_timeout_are_counted_then_let_go(
    cluster, no_rrefs_left_behind
):
    # The late reply is read (on a lane too), decoded and dropped: each RRef in
    # it is counted by its owner and let go, and no fork of worker1 stays a
    # pending child (its graceful shutdown would wait for it).
    late, infos = cluster.run(_rrefs_in_a_late_reply)
    assert late == "RpcTimeoutError"
    assert infos == [ZERO_DEBUG_INFO] * 3


def _explode():
    raise ValueError("cannot be unpickled on the owner")


class _RefusedByTheOwner:
    """An argument that fails to unpickle on the owner: remote()'s CREATE never runs."""

    def __reduce__(self):
        return _explode, ()


_gate = threading.Event()
_create_failed_served = threading.Event()


def _wait_at_the_gate():
    assert _gate.wait(30)
    _gate.clear()


class _HeldAtTheGate:
    """Unpickles once ``_gate`` opens: what follows it in a message unpickles late."""

    def __reduce__(self):
        return _wait_at_the_gate, ()


def _open_the_gate():
    _gate.set()


def _keep_last(*values):
    _kept_for_later.append(values[-1])


def _note_the_next_create_failed():
    handlers = agent_hooks.current_agent().handlers
    real = handlers[RREF_CREATE_FAILED]

    def serve_create_failed(payload, caller):
        handlers[RREF_CREATE_FAILED] = real
        try:
            return real(payload, caller)
        finally:
            _create_failed_served.set()

    handlers[RREF_CREATE_FAILED] = serve_create_failed


def _wait_for_create_failed():
    assert _create_failed_served.wait(30)
    _create_failed_served.clear()


def _fetch_and_drop_kept():
    rref = _kept_for_later.pop()
    fetched = _outcome(rref.to_here, 5)
    del rref
    return fetched


def _fork_after_create_failed():
    rrpc.rpc_sync("worker1", _note_the_next_create_failed)
    rref = rrpc.remote("worker1", _echo, args=(_RefusedByTheOwner(),))
    # worker2 unpickles its copy (and sends its FORK) only once the gate opens.
    passing = rrpc.rpc_async("worker2", _keep_last, args=(_HeldAtTheGate(), rref))
    mine = _outcome(rref.to_here)
    rrpc.rpc_sync("worker1", _wait_for_create_failed)
    rrpc.rpc_sync("worker1", rrpc.rpc_sync, args=("worker2", _open_the_gate))
    passing.wait()
    del rref
    return mine[0], rrpc.rpc_sync("worker2", _fetch_and_drop_kept)


@pytest.mark.timeout(90)
def test_a_fork_that_reaches_the_owner_after_the_creation_failed_gets_its_error(
    cluster, no_rrefs_left_behind
):
    # The owner remembers the failure: worker2's FORK, coming after it, gets
    # a holder failed already (its to_here raises at once, no timeout), which
    # worker2's drop frees (no placeholder waits for a CREATE for ever).
    mine, (theirs, message) = cluster.run(_fork_after_create_failed)
    assert mine != "returned"
    assert theirs == "RpcError" and "before it ran" in str(message), message


# -- Errors --------------------------------------------------------------------


def _errors():
    failing = rrpc.remote("worker1", _raise, args=(ValueError("bad value on the owner"),))
    box = rrpc.remote("worker1", Box, args=(0,))
    return {
        "to_here": _outcome(failing.to_here),
        "proxy on failed": _outcome(lambda: failing.rpc_sync().where()),
        "method raises": _outcome(lambda: box.rpc_sync().fail()),
        "method raises async": _outcome(lambda: box.rpc_async().fail().wait()),
        "method raises remote": _outcome(lambda: box.remote().fail().to_here()),
        "pickle outside rpc": _outcome(pickle.dumps, box)[0],
        "timed out": _outcome(rrpc.remote("worker1", time.sleep, args=(1.0,), timeout=0.2).to_here),
        "proxy timed out": _outcome(lambda: box.rpc_sync(timeout=0.2).nap(1.0)),
        "fetch timed out": _outcome(
            rrpc.remote("worker1", time.sleep, args=(1.0,), timeout=0).to_here, 0.2
        ),
        "repr": repr(box),
    }


class _TwoArgError(Exception):
    """Pickles, and does not unpickle: its __init__ does not take its args back."""

    def __init__(self, what, when):
        super().__init__(f"{what} {when}")


_fetched = threading.Event()


def _raise_two_arg_error(when):
    raise _TwoArgError("made", when)


def _raise_two_arg_error_once_fetched():
    assert _fetched.wait(30)
    _fetched.clear()
    _raise_two_arg_error("late")


def _release_at_the_next_fetch():
    """The next fetch finds the value not made yet (its reply waits for it), then
    lets ``_raise_two_arg_error_once_fetched`` go on."""
    handlers = agent_hooks.current_agent().handlers
    real = handlers[RREF_FETCH]

    def serve_fetch(payload, caller):
        handlers[RREF_FETCH] = real
        try:
            return real(payload, caller)
        finally:
            _fetched.set()

    handlers[RREF_FETCH] = serve_fetch


def _errors_that_do_not_unpickle():
    rrpc.rpc_sync("worker1", _release_at_the_next_fetch)
    late = rrpc.remote("worker1", _raise_two_arg_error_once_fetched)
    fetched_first = _outcome(late.to_here)
    early = rrpc.remote("worker1", _raise_two_arg_error, args=("early",))
    rrpc.rpc_sync("worker1", time.sleep, args=(0.1,))  # most likely made by now; either way
    return fetched_first, _outcome(early.to_here)


def test_an_error_behind_remote_that_does_not_unpickle_is_one_remote_error_however_fetched(
    cluster, no_rrefs_left_behind
):
    # A fetch that came before the value was made got its error as a value, which
    # failed to unpickle ("cannot unpickle a message ...: TypeError"); one that
    # came after got the ERROR reply's RemoteError.
    fetched_first, made_first = cluster.run(_errors_that_do_not_unpickle)
    remote_side = "Original exception on remote side was test_rref._TwoArgError"
    assert fetched_first == ("RemoteError", f"{remote_side}: made late")
    assert made_first == ("RemoteError", f"{remote_side}: made early")


def test_errors_of_the_function_behind_remote_surface_with_their_own_type(
    cluster, no_rrefs_left_behind
):
    got = cluster.run(_errors)
    assert got["to_here"] == ("ValueError", "bad value on the owner")
    assert got["proxy on failed"] == ("ValueError", "bad value on the owner")
    assert got["method raises"] == ("KeyError", "'no such key in the box'")
    assert got["method raises async"] == ("KeyError", "'no such key in the box'")
    assert got["method raises remote"] == ("KeyError", "'no such key in the box'")
    assert got["pickle outside rpc"] == "RuntimeError"
    kind, message = got["timed out"]
    assert kind == "RpcTimeoutError" and "worker1" in message
    # The error names the method and the RRef (words put together only when it is raised).
    kind, message = got["proxy timed out"]
    assert kind == "RpcTimeoutError"
    assert message.startswith(f"nap() on the value of {got['repr']} on worker1 timed out after")
    kind, message = got["fetch timed out"]
    assert kind == "RpcTimeoutError"
    assert message.startswith("to_here() of UserRRef(rref_id=")
    assert "timed out after 0.2 s" in message


def _discarded_picklings():
    """Forks made while pickling a message that is then re-pickled or not sent."""
    theirs = rrpc.remote("worker1", Box, args=(1,))
    mine = rrpc.RRef(Box(2))
    # A lambda after the RRefs: the fast pickler gives up, cloudpickle starts over.
    with_lambda = rrpc.rpc_sync("worker2", _echo, args=((theirs, mine, lambda: 3),))
    retried = (with_lambda[0].to_here().value, with_lambda[1].to_here().value, with_lambda[2]())
    del with_lambda
    _settle_messages()
    before = rrpc.rref_debug_info()
    # An argument after the RRefs that cannot be pickled: nothing is sent.
    unpicklable = _outcome(rrpc.rpc_sync, "worker2", _echo, args=(theirs, mine, threading.Lock()))
    return retried, unpicklable[0], before, rrpc.rref_debug_info()


def _too_large_with_rrefs(rank, world_size):
    if rank != 0:
        return None
    owned = rrpc.RRef(torch.ones(2))
    used = rrpc.remote("worker1", torch.ones, args=(2,))
    used.to_here()
    big = torch.zeros(1 << 16)  # 256 KiB, over max_message_size
    refused = [
        _outcome(rrpc.rpc_sync, "worker1", _echo, args=((rref, big),))[0] for rref in (owned, used)
    ]
    del owned, used
    gc.collect()
    wait_until(lambda: rrpc.rref_debug_info() == ZERO_DEBUG_INFO, timeout=30, what="no RRef left")
    return refused


@pytest.mark.timeout(120)
def test_forks_of_a_message_refused_as_too_large_are_undone():
    """The size checks come after pickling, which counted each RRef's fork
    (on the owner) or made it a pending child (on a user): a refused message
    undoes them, or the value leaks and shutdown waits for the child."""
    options = rrpc.RpcBackendOptions(max_message_size=100_000)
    refused, _ = run_workers(_too_large_with_rrefs, world_size=2, backend_options=options)
    assert refused == ["MessageTooLargeError"] * 2


def test_forks_of_a_message_that_is_repickled_or_not_sent_are_undone(cluster, no_rrefs_left_behind):
    retried, unpicklable, before, after = cluster.run(_discarded_picklings)
    assert retried == (1, 2, 3)
    assert unpicklable == "SerializationError"
    assert before == after == {**ZERO_DEBUG_INFO, "num_user_rrefs": 1}


# -- Lifetimes -----------------------------------------------------------------


class Counted:
    """Counts, on its owner, how many were built and how many freed."""

    lock = threading.Lock()
    constructed = 0
    destroyed = 0

    def __init__(self, tag):
        self.tag = tag
        with Counted.lock:
            Counted.constructed += 1

    def __del__(self):
        with Counted.lock:
            Counted.destroyed += 1


def _counts():
    gc.collect()
    return Counted.constructed, Counted.destroyed


def _reset_counts():
    Counted.constructed = Counted.destroyed = 0


_kept: list = []


def _keep_some(rrefs, every):
    """On the third worker: keep every `every`-th RRef, drop the others at once."""
    _kept.extend(rrefs[::every])
    return len(_kept)


def _tags_of_kept():
    return sorted(r.to_here().tag for r in _kept)


def _drop_kept():
    _kept.clear()


def _settle(expected_destroyed, timeout=10.0):
    """Wait until the owner destroyed `expected_destroyed` and no RRef message is in flight."""
    last = {}

    def settled():
        last["counts"] = rrpc.rpc_sync("worker1", _counts)
        infos = _debug_infos()
        last["infos"] = infos
        in_flight = any(v for info in infos for k, v in info.items() if k.startswith("num_pending"))
        return last["counts"][1] >= expected_destroyed and not in_flight

    started = time.monotonic()
    try:
        wait_until(settled, timeout)
    except AssertionError:
        pass
    return time.monotonic() - started, last["counts"], last["infos"]


def _lifetime(threads):
    rrpc.rpc_sync("worker1", _reset_counts)
    total, forked_every, kept_here_every = 500, 5, 50

    def create_and_drop(start, stop, kept_here):
        mine = [rrpc.remote("worker1", Counted, args=(i,)) for i in range(start, stop)]
        rrpc.rpc_sync("worker2", _keep_some, args=(mine[::forked_every], 2))
        kept_here.extend(mine[1::kept_here_every])
        del mine

    kept_here: list = []
    if threads == 1:
        create_and_drop(0, total, kept_here)
    else:
        share = total // threads
        workers = [
            threading.Thread(target=create_and_drop, args=(i * share, (i + 1) * share, kept_here))
            for i in range(threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    forked_kept = rrpc.rpc_sync("worker2", _tags_of_kept)
    kept_tags = {r.to_here().tag for r in kept_here}
    alive = set(forked_kept) | kept_tags
    partly = _settle(total - len(alive))

    rrpc.rpc_sync("worker2", _drop_kept)
    del kept_here
    everything = _settle(total)
    return len(alive), partly, everything


@pytest.mark.parametrize("threads", [1, 5], ids=["one thread", "five threads"])
def test_owner_frees_every_value_within_seconds_of_its_last_reference(
    cluster, no_rrefs_left_behind, threads
):
    alive, partly, everything = cluster.run(_lifetime, threads)
    assert alive == 50 + 10  # forked to worker2 and kept, kept on worker0
    _, counts, infos = partly
    assert counts == (500, 500 - alive)  # exactly the referenced ones survive
    assert infos[1]["num_owner_rrefs"] == alive
    assert infos[0]["num_user_rrefs"] == 10 and infos[2]["num_user_rrefs"] == 50
    elapsed, counts, infos = everything
    assert counts == (500, 500)
    assert infos == [ZERO_DEBUG_INFO] * 3
    assert elapsed < 10.0


def _soak(cycles):
    rrpc.rpc_sync("worker1", _reset_counts)
    window = 200  # remote() calls in flight at most
    for start in range(0, cycles, window):
        batch = [rrpc.remote("worker1", Counted, args=(i,)) for i in range(start, start + window)]
        batch[-1].to_here()
        del batch
    return _settle(cycles, timeout=20.0)


def test_thousands_of_remote_and_drop_cycles_leave_nothing_behind(cluster, no_rrefs_left_behind):
    elapsed, counts, infos = cluster.run(_soak, 5000)
    assert counts == (5000, 5000)
    assert infos == [ZERO_DEBUG_INFO] * 3


def _watch_deletes():
    """On the owner: record how many forks each DELETE message names."""
    agent = agent_hooks.current_agent()
    serve = agent.handlers[RREF_DELETE]

    def counting(payload, caller):
        _deletes_seen.append(len(payload))
        return serve(payload, caller)

    agent.register(RREF_DELETE, counting)


_deletes_seen: list = []


def _deletes_so_far():
    return list(_deletes_seen)


def _wait_confirmed(rrefs):
    wait_until(lambda: all(rref.confirmed_by_owner() for rref in rrefs), what="confirmations")


def _drop_together(rank, world_size, count):
    if rank != 0:
        return None
    rrpc.rpc_sync("worker1", _watch_deletes)
    rrefs = [rrpc.remote("worker1", Counted, args=(i,)) for i in range(count)]
    _wait_confirmed(rrefs)
    del rrefs
    wait_until(
        lambda: rrpc.rpc_sync("worker1", rrpc.rref_debug_info)["num_owner_rrefs"] == 0,
        what=f"all {count} values freed",
    )
    return rrpc.rpc_sync("worker1", _deletes_so_far)


@pytest.mark.parametrize(
    "delay, count, expected",
    [(0.5, 20, [20]), (0.0, 20, [1] * 20), (0.5, 600, [256, 256, 88])],
    ids=["lingering", "off", "at most 256 per message"],
)
def test_rrefs_dropped_together_reach_their_owner_as_one_delete_unless_switched_off(
    delay, count, expected
):
    options = rrpc.RpcBackendOptions(rref_delete_delay=delay)
    user, _ = run_workers(_drop_together, world_size=2, args=(count,), backend_options=options)
    assert user == expected


def _value_of(rref):
    return rref.local_value().tag


def _pass_to_owner(rank, world_size, count):
    """Pass a user RRef to its owner ``count`` times; the sizes of the ACCEPT
    messages that came back (this worker is the parent of every pass)."""
    if rank != 0:
        return None
    agent = agent_hooks.current_agent()
    serve, seen = agent.handlers[RREF_ACCEPT], []

    def counting(payload, caller):
        seen.append(len(payload))
        return serve(payload, caller)

    agent.register(RREF_ACCEPT, counting)
    rref = rrpc.remote("worker1", Counted, args=(7,))
    values = [rrpc.rpc_sync("worker1", _value_of, args=(rref,)) for _ in range(count)]
    wait_until(
        lambda: rrpc.rref_debug_info()["num_pending_children"] == 0, what="every pass accepted"
    )
    return values, seen


@pytest.mark.parametrize("delay", [1.0, 0.0], ids=["lingering", "off"])
def test_rrefs_passed_to_their_owner_are_accepted_in_few_messages_unless_switched_off(delay):
    """Each pass of a user RRef to its owner is an ACCEPT back to the user;
    the owner's sender holds them as it holds DELETEs (a message per delay,
    no wake-up per call: a call that passes an RRef cost ~3x one that does
    not). Twenty calls take far less than the delay, unless the machine is
    loaded: then a few messages."""
    options = rrpc.RpcBackendOptions(rref_delete_delay=delay)
    user, _ = run_workers(_pass_to_owner, world_size=2, args=(20,), backend_options=options)
    values, seen = user
    assert values == [7] * 20
    assert sum(seen) == 20
    if delay:
        assert len(seen) <= 4, seen
    else:
        assert seen == [1] * 20


def test_an_accept_naming_an_unknown_child_fails_after_accepting_the_others():
    from types import SimpleNamespace

    from rrpc.rref_protocol import CONFIRMED, ProtocolError, UserFork, UserTable
    from rrpc.rref_service import RRefService

    users = UserTable(0)
    users.forks[(0, 1)] = UserFork((1, 5), (0, 1), owner=1, parent=None, state=CONFIRMED)
    users.fork_child((0, 1), (0, 2))
    users.fork_child((0, 1), (0, 3))
    posted: list = []
    service = SimpleNamespace(lock=threading.Lock(), users=users, post=posted.extend)
    with pytest.raises(ProtocolError, match="ACCEPT of child"):
        RRefService.serve_accept(service, ((0, 2), (9, 9), (0, 3)), None)
    assert users.pending_children == {} and users.forks[(0, 1)].children == set()


def test_a_delete_made_by_a_confirmation_is_pending_until_the_sender_counts_it():
    """A drain waits while ``pending()`` names anything. A fork dropped before
    its owner confirmed it owes a DELETE once the confirmation comes: from
    that moment (the table's change) the message must count as pending, or a
    drain that looks before the sender thread has counted it in flight ends
    with the DELETE unsent (the owner keeps the value; seen once in CI)."""
    from types import SimpleNamespace

    from rrpc.messages import WorkerInfo
    from rrpc.rref_service import RRefService

    agent = SimpleNamespace(
        info=WorkerInfo("worker0", 0),
        incarnation=0,
        options=SimpleNamespace(rref_delete_delay=0.005),
        stopped=False,
    )
    service = RRefService(agent, lambda service, rref_id: None)
    service.events.put(None)  # the sender thread ends: what is posted stays queued
    service._sender.join(timeout=10)
    service.created((1, 5), (0, 1), owner=1)  # remote() sent its CREATE
    with service.lock:
        assert service.users.dropped((0, 1)) == []  # unconfirmed: no DELETE yet
    assert service.pending() == {"pending confirmations": 1}
    service._confirmed((0, 1), None)  # the owner's answer: the DELETE is due
    assert service.pending() == {"protocol messages queued": 1}


# -- Shutdown ------------------------------------------------------------------


def _drop_then_shut_down(rank, world_size):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    at_stop = {}
    if rank == 1:
        # Read once the agent has stopped, before the RRef service forgets its tables.
        service = agent_hooks.current_agent().rrefs
        stop = service.stop

        def read_then_stop(*args):
            at_stop.update(info=rrpc.rref_debug_info(), counts=_counts())
            stop(*args)

        service.stop = read_then_stop
        rrpc.shutdown()
        return at_stop
    rrefs = [rrpc.remote("worker1", Counted, args=(i,)) for i in range(200)]
    kept = rrefs.pop()
    # Dropped in a reference cycle, with automatic collection off: only the
    # shutdown's drain collects them, and must then wait for their DELETEs.
    rrefs.append(rrefs)
    gc.disable()
    del rrefs
    rrpc.shutdown()
    gc.enable()
    after = {"to_here": _outcome(kept.to_here)[0]}
    del kept  # after shutdown: must neither raise nor hang
    gc.collect()
    return after


def test_graceful_shutdown_waits_for_the_deletes_of_dropped_rrefs():
    user, owner = run_workers(_drop_then_shut_down, world_size=2, init=False, timeout=90)
    assert user == {"to_here": "RpcError"}
    # When the owner stops, every dropped value is freed and the kept one is not.
    assert owner["counts"] == (200, 199)
    assert owner["info"] == {**ZERO_DEBUG_INFO, "num_owner_rrefs": 1, "num_owner_forks": 1}


# -- Owner death ---------------------------------------------------------------


def _owner_dies(rank, world_size, ready, owner_dead):
    rrpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rrpc.RpcBackendOptions(rpc_timeout=20.0),
    )
    try:
        if rank == 1:
            threading.Event().wait()  # until the test kills it
        rref = rrpc.remote("worker1", Box, args=(1,))
        wait_until(rref.confirmed_by_owner, what="confirmation")
        ready.set()
        assert owner_dead.acquire(timeout=30)
        started = time.monotonic()
        to_here = _outcome(rref.to_here)
        proxy = _outcome(rref.rpc_sync().where)
        elapsed = time.monotonic() - started
        del rref  # its DELETE cannot reach the owner: must neither raise nor hang
        gc.collect()
        return to_here, proxy, elapsed
    finally:
        rrpc.shutdown(graceful=False)


def test_to_here_on_an_rref_whose_owner_died_raises_naming_the_owner():
    # A semaphore, not an Event: setting an Event that a killed process waited on hangs.
    ready, owner_dead = mp_context.Event(), mp_context.Semaphore(0)
    with WorkerGroup(_owner_dies, world_size=2, args=(ready, owner_dead), init=False) as group:
        assert ready.wait(60)
        group.kill(1)
        owner_dead.release()
        results = group.wait(timeout=60, may_die={1})
    to_here, proxy, elapsed = results[0]
    assert to_here[0] == "PeerUnavailableError" and "worker1" in to_here[1], to_here
    assert proxy[0] == "PeerUnavailableError" and "worker1" in proxy[1], proxy
    assert elapsed < 10.0


# -- Receiver death ------------------------------------------------------------


def _pong():
    return "pong"


def _echo(x):
    return x


def _receiver_dies(rank, world_size, ready, dead):
    rrpc.init_rpc(
        f"worker{rank}",
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rrpc.RpcBackendOptions(rpc_timeout=20.0),
    )
    if rank == 2:
        rrpc.rpc_sync("worker0", _pong)  # worker0 knows it is up
        ready.set()
        threading.Event().wait()  # until the test kills it
    assert dead.acquire(timeout=60)
    result = None
    if rank == 0:
        rref = rrpc.remote("worker1", Box, args=(1,))
        rref.to_here()
        sent = _outcome(rrpc.rpc_sync, "worker2", _echo, args=(rref,))
        del rref  # its DELETE waits for the child sent to worker2, which is dead
        gc.collect()
        wait_until(  # the child settled, the DELETE sent and answered
            lambda: rrpc.rref_debug_info() == ZERO_DEBUG_INFO, timeout=30, what="no RRef left"
        )
        result = {"sent": sent[0], "info": rrpc.rref_debug_info()}
    started = time.monotonic()
    rrpc.shutdown()  # graceful: must not wait for worker2
    return result, time.monotonic() - started


@pytest.mark.timeout(180)
def test_an_rref_sent_to_a_dead_worker_is_let_go_and_graceful_shutdown_ends():
    """A user RRef pickled into a call to a worker that died is a child its
    receiver never ACCEPTs: once the receiver fails a liveness probe, the
    child is settled, the parent's DELETE goes, and shutdown does not wait."""
    ready, dead = mp_context.Event(), mp_context.Semaphore(0)
    with WorkerGroup(_receiver_dies, world_size=3, args=(ready, dead), init=False) as group:
        assert ready.wait(60)
        group.kill(2)
        dead.release()
        dead.release()
        results = group.wait(timeout=150, may_die={2})
    (sender, took), (_, owner_took) = results[0], results[1]
    assert sender["sent"] == "PeerUnavailableError", sender
    assert sender["info"] == ZERO_DEBUG_INFO, sender
    assert took < 30 and owner_took < 30, (took, owner_took)


@pytest.mark.timeout(60)
def test_a_drain_without_timeout_gives_up_after_its_limit_and_logs_what_is_pending(
    caplog, monkeypatch
):
    """As torch's (``kDeleteAllUsersTimeout``): a graceful shutdown with no
    timeout waits for the RRef protocol a bounded time, then goes on; a
    drain with a timeout of its own still raises."""
    import math
    from types import SimpleNamespace

    from rrpc import logs, rref_service
    from rrpc.messages import RpcError, WorkerInfo

    monkeypatch.setattr(rref_service, "DRAIN_LIMIT", 0.5, raising=False)
    monkeypatch.setattr(logs, "_last", {})
    agent = SimpleNamespace(
        info=WorkerInfo("worker0", 0),
        incarnation=0,
        options=SimpleNamespace(rref_delete_delay=0.005),
        stopped=False,
        suspects=set(),
    )
    service = rref_service.RRefService(agent, lambda service, rref_id: None)
    try:
        service.created((1, 5), (0, 1), owner=1)  # a CREATE its owner never answers
        with caplog.at_level(logging.WARNING, logger="rrpc"):
            drain = threading.Thread(target=service.drain, args=(math.inf,), daemon=True)
            drain.start()
            drain.join(timeout=30)
        assert not drain.is_alive(), "the drain still waits"
        assert "pending confirmations" in caplog.text, caplog.text
        with pytest.raises(RpcError, match="still waiting after 0.2 s"):
            service.drain(0.2)
    finally:
        service.stop()


@pytest.mark.slow
def test_owner_memory_stays_flat_over_100000_remote_and_drop_cycles():
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "rref_soak.py"
    run = subprocess.run(
        [sys.executable, str(script), "--cycles", "100000"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: the owner's memory stayed flat" in run.stdout


def _keywords(x, *, mode=0, timeout=0, method="", rref=None):
    return x, mode, timeout, method, rref


class Keywords:
    def call(self, x, **kwargs):
        return _keywords(x, **kwargs)


def _proxy_keywords_named_like_the_proxys_own():
    rref = rrpc.remote("worker1", Keywords)
    kwargs = {"mode": 1, "timeout": 2, "method": "m", "rref": "r"}
    return (
        rref.rpc_sync().call(0, **kwargs),
        rref.rpc_async().call(0, **kwargs).wait(),
        rref.remote().call(0, **kwargs).to_here(),
    )


def test_proxy_methods_take_keywords_named_mode_timeout_method_or_rref(
    cluster, no_rrefs_left_behind
):
    assert cluster.run(_proxy_keywords_named_like_the_proxys_own) == ((0, 1, 2, "m", "r"),) * 3


def _missing_method_through_each_proxy():
    rref = rrpc.remote("worker1", Box, args=(0,))
    raised = {}
    for mode in ("rpc_sync", "rpc_async", "remote"):
        try:
            result = getattr(rref, mode)().no_such_method()
            if mode == "rpc_async":
                result.wait()
        except AttributeError as error:
            raised[mode] = str(error)
    return raised


def test_a_missing_method_raises_attribute_error_through_every_proxy(cluster, no_rrefs_left_behind):
    # As torch: remote() raises at the call, the others when their result is read.
    raised = cluster.run(_missing_method_through_each_proxy)
    assert set(raised) == {"rpc_sync", "rpc_async", "remote"}
    assert all("has no attribute 'no_such_method'" in message for message in raised.values())


class _ForgedRRef:
    """Pickles as an RRef "owned" by worker1 and created by rank 148, which no worker has."""

    def __reduce__(self):
        from rrpc import rref as rref_module

        return rref_module._rebuild, ((148, 0), 1, (0, 12345))


def _call_with_a_forged_rref():
    try:
        rrpc.rpc_sync("worker1", _whoami_rref, args=(_ForgedRRef(),), timeout=20)
    except rrpc.RpcError as error:
        return type(error).__name__, str(error)
    return None


def _whoami_rref(rref):
    return rrpc.get_worker_info().name


def test_an_rref_id_from_a_rank_that_does_not_exist_is_refused_at_once(cluster):
    # It used to make the owner wait for a CREATE from rank 148: the call hung.
    kind, message = cluster.run(_call_with_a_forged_rref)
    assert kind == "SerializationError"
    assert "could not find destination worker 148" in message
