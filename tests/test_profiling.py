"""Profiling: RPC events in torch's profilers, with each worker's work in the caller's trace.

The shared world of three workers (conftest's `cluster`) runs each scenario on
worker0, which profiles calls to worker1 (and, nested, to worker2) and returns
what its profile holds; restricted mode gets a world of its own. torch's own
profiler tests run on rrpc in the conformance suite (conformance/subset.py);
these add what torch does not test: traces exported under both profilers,
Kineto, nesting through three workers, errors, restricted mode, and that a
profile without RPCs is torch's own.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading

import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

import rrpc
from harness import run_workers

pytestmark = pytest.mark.timeout(120)

REMOTE_OP = "#remote_op: "


# -- Functions the workers run -------------------------------------------------


def _ops():
    """Known operators, so that the callee's events can be named in advance."""
    t = torch.ones(3)
    return torch.sigmoid(torch.relu(t * 2)).sum()


def _ops_through(to):
    """Runs on worker1: its own operator, then a nested call to ``to``."""
    torch.zeros(2)
    return rrpc.rpc_sync(to, _ops)


def _fail():
    raise ValueError("expected failure inside a profile")


def _key(mode, func, callee, caller="worker0"):
    """torch's name for an RPC's event (torch.distributed.rpc.internal._build_rpc_profiling_key)."""
    return f"rpc_{mode}#{func}({caller} -> {callee})"


def _names_and_nodes(events):
    return {(event.name, event.node_id, event.is_remote) for event in events}


# -- Scenarios run on worker0 ----------------------------------------------------


def _legacy_profile_of_each_kind_of_call():
    with legacy_profile() as profile:
        rrpc.rpc_sync("worker1", _ops)
        rrpc.rpc_async("worker1", _ops).wait()
        rref = rrpc.remote("worker1", _ops)
        rref.to_here()
        rref._get_profiling_future().wait()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as file:
            trace_names = {entry["name"] for entry in json.load(file)}
    return _names_and_nodes(profile.function_events), trace_names


def test_each_call_is_an_event_on_the_caller_with_the_callees_operators_under_it(cluster):
    events, trace_names = cluster.run(_legacy_profile_of_each_kind_of_call)
    for mode in ("sync", "async", "remote"):
        key = _key(mode, "_ops", "worker1")
        assert (key, 0, False) in events, f"{key} on node 0 missing from {sorted(events)}"
        for operator in ("aten::ones", "aten::mul", "aten::relu", "aten::sigmoid", "aten::sum"):
            remote = (key + REMOTE_OP + operator, 1, True)
            assert remote in events, f"{remote} missing"
            assert remote[0] in trace_names  # export_chrome_trace writes both workers' events
        assert key in trace_names
    # Nothing of worker1's is claimed to be worker0's, and nothing is unnamed.
    assert all(node == 1 for name, node, remote in events if remote)
    assert all(REMOTE_OP in name for name, node, remote in events if remote)


def _kineto_trace_and_averages():
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        rrpc.rpc_sync("worker1", _ops)
    averages = {average.key for average in profile.key_averages()}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)["traceEvents"]
    spans = [(e["name"], e["pid"], e.get("args", {}).get("Node Id")) for e in trace if "ph" in e]
    names = [e for e in trace if e.get("name") == "process_name" and "args" in e]
    process_names = {e["pid"]: e["args"]["name"] for e in names}
    return averages, spans, process_names, os.getpid()


def test_kineto_trace_holds_the_rpc_and_the_callees_operators_as_a_process_of_their_own(cluster):
    # torch records no RPC event under torch.profiler (Kineto); rrpc records the same as legacy.
    averages, spans, process_names, own_pid = cluster.run(_kineto_trace_and_averages)
    key = _key("sync", "_ops", "worker1")
    remote_add = key + REMOTE_OP + "aten::mul"
    assert key in averages and remote_add in averages
    assert any(name == key and pid == own_pid for name, pid, _ in spans)
    remote_pids = {pid for name, pid, node in spans if name == remote_add and node == 1}
    assert len(remote_pids) == 1
    assert process_names[remote_pids.pop()] == "rrpc node 1"


def _nested_profile():
    with legacy_profile() as profile:
        rrpc.rpc_sync("worker1", _ops_through, args=("worker2",))
    return _names_and_nodes(profile.function_events)


def test_nested_calls_attribute_each_operator_to_the_worker_that_ran_it(cluster):
    events = cluster.run(_nested_profile)
    outer = _key("sync", "_ops_through", "worker1")
    inner = _key("sync", "_ops", "worker2", caller="worker1")
    assert (outer, 0, False) in events
    assert (outer + REMOTE_OP + "aten::zeros", 1, True) in events
    assert (outer + REMOTE_OP + inner, 1, True) in events  # worker1's own call, as worker1's
    assert (outer + REMOTE_OP + inner + REMOTE_OP + "aten::relu", 2, True) in events


def _error_inside_a_profile():
    with legacy_profile() as profile:
        try:
            rrpc.rpc_sync("worker1", _fail)
        except ValueError as error:
            raised = str(error)
        rrpc.rpc_sync("worker1", _ops)
    return raised, _names_and_nodes(profile.function_events)


def test_a_call_that_raises_under_the_profiler_raises_as_without_and_is_still_an_event(cluster):
    raised, events = cluster.run(_error_inside_a_profile)
    assert raised == "expected failure inside a profile"
    assert (_key("sync", "_fail", "worker1"), 0, False) in events
    assert (_key("sync", "_ops", "worker1") + REMOTE_OP + "aten::relu", 1, True) in events


def _local_profile_names():
    with legacy_profile() as legacy:
        _ops()
    with torch.autograd.profiler.profile() as kineto:
        _ops()
    return [e.name for e in legacy.function_events], [e.name for e in kineto.function_events]


def test_a_profile_without_rpcs_is_exactly_torchs(cluster):
    # rrpc wraps torch's profilers once (at init_rpc); without RPCs they give what torch gives.
    legacy, kineto = cluster.run(_local_profile_names)
    expected = ["aten::ones", "aten::mul", "aten::relu", "aten::sigmoid", "aten::sum"]
    assert [name for name in legacy if name in expected] == expected
    assert [name for name in kineto if name in expected] == expected
    assert not any("rpc" in name for name in legacy + kineto)


def _backward_profile():
    with rrpc.autograd.context() as context_id:
        t1 = torch.rand(3, 3, requires_grad=True)
        t2 = torch.rand(3, 3, requires_grad=True)
        loss = rrpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        with torch.autograd.profiler.profile() as profile:
            rrpc.autograd.backward(context_id, [loss])
    return [(e.name, e.time_range.start, e.time_range.end) for e in profile.function_events]


def test_distributed_backward_shows_the_pass_of_the_send_record_it_caused(cluster):
    events = cluster.run(_backward_profile)
    (backward,) = [e for e in events if e[0] == "torch::distributed::autograd::backward"]
    sends = [e for e in events if e[0] == "torch::distributed::autograd::SendRpcBackward"]
    assert len(sends) == 1  # worker1 sent the gradients of t1 and t2 back here
    assert backward[1] <= sends[0][1] and sends[0][2] <= backward[2]
    assert any("RecvRpcBackward" in e[0] for e in events)


def _profiles_stopped_on_another_thread():
    from rrpc import profiling

    chains = []
    for _ in range(5):
        profile = torch.profiler.profile()
        profile.start()  # started here ...
        rrpc.rpc_sync("worker1", _ops)
        stopper = threading.Thread(target=profile.stop)  # ... stopped there
        stopper.start()
        stopper.join()
        assert any(_key("sync", "_ops", "worker1") in e.name for e in profile.events())
        del profile
        session, chain = profiling.local.session, 0
        while session is not None:
            chain, session = chain + 1, session.previous
        chains.append(chain)
    rrpc.rpc_sync("worker1", _ops)  # the thread's next call looks at its session
    return chains, profiling.local.session is None


def test_profiles_stopped_on_another_thread_keep_no_events_alive_here(cluster):
    chains, none_left = cluster.run(_profiles_stopped_on_another_thread)
    assert max(chains) <= 1  # the last one, dropped at the next look (was 1, 2, ... 5)
    assert none_left


@rrpc.functions.expose
def _exposed_ops():
    return _ops()


def _profile_in_restricted_mode(rank, world_size):
    if rank != 0:
        return None
    with legacy_profile() as profile:
        rrpc.rpc_sync("worker1", _exposed_ops)
    return _names_and_nodes(profile.function_events)


def test_profiled_calls_and_their_events_pass_restricted_mode():
    # The profiled request and its reply's events are plain data: the restricted
    # unpickler takes them, and the callee checks the function as without profiling.
    options = rrpc.RpcBackendOptions(restricted=True)
    events = run_workers(_profile_in_restricted_mode, 2, backend_options=options, timeout=60)[0]
    key = _key("sync", "_exposed_ops", "worker1")
    assert (key, 0, False) in events
    assert (key + REMOTE_OP + "aten::relu", 1, True) in events
