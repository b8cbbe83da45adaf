"""Fault injection (``rrpc.FaultyRpcBackendOptions``, rrpc/faults.py): dropped
and delayed messages between real workers, and how each one is named.

One world of three workers:
- worker0 drops its ``PYTHON_CALL`` and ``PYTHON_REMOTE_CALL`` messages, each
  twice (``num_fail_sends=2``) before it goes through;
- worker2 delays its ``PYTHON_CALL`` messages by ``DELAY`` seconds;
- worker1 has plain options and records every value its ``_record`` receives.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rrpc
from harness import outcome as _outcome
from harness import run_workers
from rrpc import codec, faults
from rrpc.messages import (
    AUTOGRAD_RELEASE,
    CALL,
    RREF_CREATE,
    RREF_DELETE,
    RREF_FETCH,
    RREF_FORK,
    thread_state,
)

DELAY = 2.0

_records: list = []
_recorded_at: dict = {}  # value -> wall-clock time the callee ran it
_recorded = threading.Condition()


def _record(value):
    with _recorded:
        _records.append(value)
        _recorded_at.setdefault(value, time.time())
        _recorded.notify_all()
    return value


def _faulty_world(rank, world_size):
    options = {
        0: rrpc.FaultyRpcBackendOptions(
            messages_to_fail=["PYTHON_CALL", "PYTHON_REMOTE_CALL"], num_fail_sends=2
        ),
        1: rrpc.RpcBackendOptions(),
        2: rrpc.FaultyRpcBackendOptions(messages_to_delay={"PYTHON_CALL": DELAY}),
    }[rank]
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {"injector": rrpc.agent.current_agent().faults is not None}
    if rank == 0:
        seen["same call"] = [_outcome(rrpc.rpc_sync, "worker1", _record, ("a",)) for _ in range(3)]
        seen["other call"] = _outcome(rrpc.rpc_sync, "worker1", _record, ("b",))
        seen["builtin"] = _outcome(rrpc.rpc_sync, "worker1", torch.add, (1, 2))
        rref = rrpc.remote("worker1", _record, ("c",))
        seen["remote"] = _outcome(rref.to_here)
        del rref
        stats = rrpc.stats()["worker1"]
        seen["in flight, errors"] = (stats["in_flight"], stats["errors"])
    elif rank == 2:
        seen["past its timeout"] = _outcome(
            rrpc.rpc_sync, "worker1", _record, ("late",), timeout=DELAY / 4
        )
        seen["within its timeout"] = _outcome(rrpc.rpc_sync, "worker1", _record, ("slow",))
        seen["builtin"] = _outcome(rrpc.rpc_sync, "worker1", torch.add, (1, 2))
    rrpc.shutdown()  # waits for every worker: worker1's records are complete after it
    if rank == 1:
        seen["records"] = list(_records)
        seen["recorded at"] = dict(_recorded_at)
    return seen


@pytest.fixture(scope="module")
def world():
    seen = run_workers(_faulty_world, 3, init=False, timeout=90)
    for rank in (0, 2):
        for what, outcome in seen[rank].items():
            for one in outcome if isinstance(outcome, list) else [outcome]:
                if isinstance(one, dict):
                    print(f"worker{rank} {what}: {one.get('type', 'ok')} in {one['elapsed']:.3f} s")
    return seen


# -- Dropped messages ----------------------------------------------------------


def test_a_dropped_call_fails_at_once_naming_the_message_and_the_attempt(world):
    first, second, _ = world[0]["same call"]
    for attempt, seen in enumerate((first, second), 1):
        assert seen["type"] == "InjectedFailure", seen
        assert "call of" in seen["message"] and "_record" in seen["message"], seen
        assert "worker1" in seen["message"]
        assert "(PYTHON_CALL) was dropped on purpose" in seen["message"]
        assert f"send {attempt} of the num_fail_sends=2 that fail" in seen["message"]
        assert seen["elapsed"] < 10  # at once, not at the 60 s default timeout


def test_a_dropped_call_counts_as_an_error_and_is_no_longer_in_flight(world):
    # Four dropped (two sends of "a", the first of "b", the remote()'s): each
    # ended, as a call that fails any other way (they stayed in flight, uncounted).
    assert world[0]["in flight, errors"] == (0, 4)


def test_the_same_message_goes_through_after_num_fail_sends_failures(world):
    assert world[0]["same call"][2]["value"] == "a"


def test_a_message_of_another_content_counts_its_own_failures(world):
    assert world[0]["other call"]["type"] == "InjectedFailure"
    assert "send 1 of" in world[0]["other call"]["message"]


def test_a_kind_not_chosen_is_not_dropped(world):
    assert world[0]["builtin"]["value"] == 3  # a SCRIPT_CALL, not a PYTHON_CALL


def test_a_dropped_remote_fails_the_rref_naming_its_creation(world):
    seen = world[0]["remote"]
    assert seen["type"] == "InjectedFailure", seen
    assert "RRef creation message (PYTHON_REMOTE_CALL) was dropped" in seen["message"]
    assert "remote() of" in seen["message"]


def test_dropped_messages_never_reach_the_callee(world):
    records = world[1]["records"]
    assert records.count("a") == 1
    assert "b" not in records and "c" not in records


# -- Delayed messages ----------------------------------------------------------


def test_a_delayed_call_times_out_on_time_and_the_caller_does_not_wait_for_the_delay(world):
    seen = world[2]["past its timeout"]
    assert seen["type"] == "RpcTimeoutError", seen
    assert "RPC ran for more than" in seen["message"]
    assert seen["elapsed"] >= DELAY / 4
    # The caller gave up before its call, held back by the delay, even ran.
    assert seen["finished at"] < world[1]["recorded at"]["late"]


def test_a_delayed_call_within_its_timeout_returns_after_the_delay(world):
    seen = world[2]["within its timeout"]
    assert seen["value"] == "slow"
    assert DELAY <= seen["elapsed"] < DELAY + 2.0


def test_a_delayed_message_still_reaches_the_callee_after_its_caller_gave_up(world):
    records = world[1]["records"]
    assert records.index("late") < records.index("slow")


def test_kinds_not_delayed_go_at_once(world):
    assert world[2]["builtin"]["value"] == 3
    assert world[2]["builtin"]["elapsed"] < DELAY / 2


def test_plain_options_have_no_injector_so_the_send_path_is_unchanged(world):
    assert [seen["injector"] for seen in world] == [True, False, True]


# -- Names and options (no processes) -------------------------------------------


def _user_function():
    return None


@pytest.mark.parametrize(
    "kind, obj, what, name",
    [
        (CALL, (_user_function, (), {}), "call of _user_function", "PYTHON_CALL"),
        (CALL, (torch.add, (1, 2), {}), "call of torch.add", "SCRIPT_CALL"),
        (CALL, (_user_function, (), {}), "remote() of _user_function", "PYTHON_REMOTE_CALL"),
        (RREF_CREATE, ((0, 1), (0, 2), torch.add, (), {}), "remote() of add", "SCRIPT_REMOTE_CALL"),
        (RREF_CREATE, ((0, 1), (0, 2), _user_function, (), {}), "x", "PYTHON_REMOTE_CALL"),
        (RREF_FETCH, ((0, 1),), "to_here()", "PYTHON_RREF_FETCH_CALL"),
        (RREF_FORK, ((0, 1), (2, 3)), "x", "RREF_FORK_REQUEST"),
        (RREF_DELETE, (((0, 1), (2, 3)),), "x", "RREF_USER_DELETE"),
        (AUTOGRAD_RELEASE, (5,), "x", "CLEANUP_AUTOGRAD_CONTEXT_REQ"),
    ],
)
def test_each_message_is_named_as_torch_names_it(kind, obj, what, name):
    assert faults.torch_name(kind, obj, what, requires_grad=False) == name


def test_a_call_carrying_gradients_in_an_autograd_context_is_not_a_target(monkeypatch):
    # torch sends it as FORWARD_AUTOGRAD_REQ, which its faulty agent cannot target.
    call = (torch.add, (), {})
    assert faults.torch_name(CALL, call, "call", requires_grad=True) == "SCRIPT_CALL"
    monkeypatch.setattr(thread_state, "autograd_context_id", 5)  # inside a context
    assert faults.torch_name(CALL, call, "call", requires_grad=True) is None
    assert faults.torch_name(CALL, call, "call", requires_grad=False) == "SCRIPT_CALL"


def test_both_fetch_names_select_the_fetch_and_the_longer_delay_wins():
    injector = faults.Injector(
        ["SCRIPT_RREF_FETCH_CALL"],
        1,
        {"PYTHON_RREF_FETCH_CALL": 0.5, "SCRIPT_RREF_FETCH_CALL": 2},
        scheduler=None,  # nothing is sent
    )
    assert "PYTHON_RREF_FETCH_CALL" in injector.failing
    assert injector.delays["PYTHON_RREF_FETCH_CALL"] == 2


def test_options_mirror_torchs_and_refuse_unknown_names_and_bad_values():
    options = rrpc.FaultyRpcBackendOptions(
        num_worker_threads=8,
        messages_to_fail=["RREF_FORK_REQUEST"],
        messages_to_delay={"SCRIPT_CALL": 1.5},
        num_fail_sends=3,
    )
    assert (options.num_worker_threads, options.num_fail_sends) == (8, 3)
    assert options.messages_to_delay == {"SCRIPT_CALL": 1.5}
    with pytest.raises(ValueError, match="no message type 'PYTHON_RET'.*known: CLEANUP_AUTOGRAD"):
        rrpc.FaultyRpcBackendOptions(messages_to_fail=["PYTHON_RET"])
    with pytest.raises(ValueError, match=r"messages_to_delay\['PYTHON_CALL'\] must be seconds"):
        rrpc.FaultyRpcBackendOptions(messages_to_delay={"PYTHON_CALL": -1})
    with pytest.raises(ValueError, match="num_fail_sends must be >= 0"):
        rrpc.FaultyRpcBackendOptions(num_fail_sends=-1)
    with pytest.raises(TypeError, match="num_fail_sends must be an int"):
        rrpc.FaultyRpcBackendOptions(num_fail_sends=1.5)


def test_options_that_inject_nothing_give_no_injector():
    def injector(options):
        return faults.injector(options, scheduler=None)  # nothing is sent

    assert injector(rrpc.RpcBackendOptions()) is None
    assert injector(rrpc.FaultyRpcBackendOptions()) is None
    assert injector(rrpc.FaultyRpcBackendOptions(messages_to_fail=["PYTHON_CALL"])) is None
    delayed = rrpc.FaultyRpcBackendOptions(messages_to_delay={"PYTHON_CALL": 0.1})
    assert injector(delayed) is not None


def test_failures_are_counted_per_message_name_and_payload_not_per_request_id():
    injector = faults.Injector(["SCRIPT_CALL"], 2, {}, scheduler=None)
    same = [codec.encode(CALL, request_id, (torch.add, (1, 2), {})) for request_id in (1, 2, 3)]
    other = codec.encode(CALL, 4, (torch.add, (1, 3), {}))
    counts = [injector._count_failure("SCRIPT_CALL", out) for out in same]
    assert counts == [1, 2, 0]
    assert injector._count_failure("SCRIPT_CALL", other) == 1


# -- Protocol messages that never left are sent again -----------------------------

# torch's faulty-agent fixture: these four, each failing 3 times before it goes through.
_PROTOCOL = [
    "RREF_FORK_REQUEST",
    "RREF_CHILD_ACCEPT",
    "RREF_USER_DELETE",
    "CLEANUP_AUTOGRAD_CONTEXT_REQ",
]


def _add_rref_to_value(rref, value):
    return rref.to_here() + value


def _bookkeeping():
    autograd = {f"autograd {key}": n for key, n in rrpc.autograd._debug_info().items()}
    return {**rrpc.rref_debug_info(), **autograd}


def _settled(worker):
    """Poll ``worker`` until its RRef and autograd tables are empty (or 20 s)."""
    deadline = time.monotonic() + 20
    pause = threading.Event()
    while True:
        seen = rrpc.rpc_sync(worker, _bookkeeping)
        if not any(seen.values()) or time.monotonic() > deadline:
            return seen
        pause.wait(0.05)


def _dropped_protocol_world(rank, world_size):
    options = rrpc.FaultyRpcBackendOptions(messages_to_fail=_PROTOCOL, num_fail_sends=3)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = None
    if rank == 0:
        start = time.monotonic()
        # torch's test_check_failed_messages: an RRef on worker1, forked to worker2.
        rref = rrpc.remote("worker1", torch.add, args=(torch.ones(2, 2), torch.ones(2, 2)))
        other = rrpc.remote("worker2", _add_rref_to_value, args=(rref, torch.ones(2, 2)))
        seen = {"value": rref.to_here(), "forked": other.to_here()}
        with rrpc.autograd.context() as context_id:
            x = torch.ones(2, requires_grad=True)
            loss = rrpc.rpc_sync("worker1", torch.mul, args=(x, 2)).sum()
            rrpc.autograd.backward(context_id, [loss])
            seen["grad"] = rrpc.autograd.get_gradients(context_id)[x]
        del rref, other
        seen["worker1"], seen["worker2"] = _settled("worker1"), _settled("worker2")
        seen["seconds"] = time.monotonic() - start
        seen["dropped"] = sorted(rrpc.agent.current_agent().faults._failed.values())
    rrpc.shutdown()
    return seen


def test_dropped_rref_and_autograd_messages_are_sent_again_and_nothing_leaks():
    start = time.monotonic()
    seen = run_workers(_dropped_protocol_world, 3, init=False, timeout=90)[0]
    print(seen, f"{time.monotonic() - start:.1f} s with start and shutdown")
    assert torch.equal(seen["value"], torch.full((2, 2), 2.0))
    assert torch.equal(seen["forked"], torch.full((2, 2), 3.0))
    assert torch.equal(seen["grad"], torch.full((2,), 2.0))
    # The owner freed the value, and the autograd context is gone on worker1, as on
    # torch, whose agent retries these: without resends, worker1 kept both.
    for worker in ("worker1", "worker2"):
        assert not any(seen[worker].values()), (worker, seen[worker])
    assert seen["dropped"] and set(seen["dropped"]) == {3}  # each was dropped 3 times first
