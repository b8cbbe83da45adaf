"""Core RPC between real worker processes: calls, values, futures, errors, nesting.

Most tests here share one world of three workers (the `cluster` fixture): the
test sends a module-level function to worker0, which runs it there (with rrpc
initialised) and sends back its return value. Starting processes costs seconds
each; a function call through the cluster costs milliseconds. Tests that need
their own options (one worker thread) start their own world.
"""

from __future__ import annotations

import gc
import operator
import threading
import weakref

import pytest
import torch

import rrpc
from harness import run_workers

# The shared world is conftest's `cluster` fixture (a harness.Cluster of 3).


# -- Functions the workers run -------------------------------------------------


def _whoami():
    return rrpc.get_worker_info().name


def _scale(x, factor=1, *, shift=0):
    return x * factor + shift


def _describe_kwargs(*args, **kwargs):
    return {"args": args, "kwargs": kwargs}


def _echo(value):
    return value


def _echo_with_caller(value):
    return value, rrpc.get_worker_info().name


def _call_through(path, x):
    """Call the next worker on `path` with the rest of the path; the last one adds its name."""
    here = rrpc.get_worker_info().name
    if not path:
        return [here], x + 1
    trail, value = rrpc.rpc_sync(path[0], _call_through, args=(path[1:], x * 2))
    return [here, *trail], value


# -- Builtins, user functions, arguments ---------------------------------------


def _builtins_and_user_functions():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
    return {
        "torch.add": rrpc.rpc_sync("worker1", torch.add, args=(a, b)),
        "torch.add alpha": rrpc.rpc_sync("worker1", torch.add, args=(a, b), kwargs={"alpha": 3}),
        "torch.matmul": rrpc.rpc_sync("worker2", torch.matmul, args=(a, b.t())),
        "operator.mul": rrpc.rpc_sync("worker1", operator.mul, args=(7, 6)),
        "builtin max": rrpc.rpc_sync("worker2", max, args=([3, 9, 4],)),
        "user": rrpc.rpc_sync("worker1", _whoami),
        "user kwargs": rrpc.rpc_sync(
            "worker2", _scale, args=(a,), kwargs={"factor": 2, "shift": 1}
        ),
        "kwargs only": rrpc.rpc_sync("worker1", _describe_kwargs, kwargs={"x": 1, "y": "z"}),
        "no args": rrpc.rpc_sync("worker1", _describe_kwargs),
        "lambda": rrpc.rpc_sync("worker2", lambda x: x.sum().item(), args=(a,)),
        "closure": rrpc.rpc_sync("worker1", (lambda offset: lambda x: x + offset)(100), args=(1,)),
        "async": rrpc.rpc_async("worker2", torch.sub, args=(a, b)).wait(),
    }


def test_builtins_user_functions_kwargs_and_lambdas_run_on_the_callee(cluster):
    got = cluster.run(_builtins_and_user_functions)
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)
    assert torch.equal(got["torch.add"], a + b)
    assert torch.equal(got["torch.add alpha"], a + 3 * b)
    assert torch.equal(got["torch.matmul"], a @ b.t())
    assert got["operator.mul"] == 42
    assert got["builtin max"] == 9
    assert got["user"] == "worker1"
    assert torch.equal(got["user kwargs"], a * 2 + 1)
    assert got["kwargs only"] == {"args": (), "kwargs": {"x": 1, "y": "z"}}
    assert got["no args"] == {"args": (), "kwargs": {}}
    assert got["lambda"] == 15.0
    assert got["closure"] == 101
    assert torch.equal(got["async"], a - b)


def _nested_containers():
    t1, t2 = torch.arange(4), torch.randn(2, 2, generator=torch.Generator().manual_seed(0))
    message = {
        "list": [t1, (t2, {"deep": [t1 * 2, None, "s"]})],
        "tuple": (1, 2.5, b"bytes"),
        "alias": t2,
        "empty": [],
    }
    back = rrpc.rpc_sync("worker1", _echo, args=(message,))
    return message, back


def test_nested_containers_of_tensors_round_trip_with_structure_and_values(cluster):
    sent, back = cluster.run(_nested_containers)
    assert set(back) == {"list", "tuple", "alias", "empty"}
    assert torch.equal(back["list"][0], sent["list"][0])
    assert isinstance(back["list"][1], tuple)
    assert torch.equal(back["list"][1][0], sent["list"][1][0])
    assert torch.equal(back["list"][1][1]["deep"][0], sent["list"][0] * 2)
    assert back["list"][1][1]["deep"][1:] == [None, "s"]
    assert back["tuple"] == (1, 2.5, b"bytes")
    assert back["empty"] == []
    # The same tensor twice in a message is one tensor on arrival, as with pickle.
    assert back["alias"] is back["list"][1][0]


# -- Addressing: names, ranks, WorkerInfo, self, unknown -----------------------


def _addressing():
    info1 = rrpc.get_worker_info("worker1")
    return {
        "self": rrpc.get_worker_info(),
        "by name": info1,
        "by rank": rrpc.get_worker_info(2),
        "call by name": rrpc.rpc_sync("worker2", _whoami),
        "call by rank": rrpc.rpc_sync(1, _whoami),
        "call by info": rrpc.rpc_sync(info1, _whoami),
        "self by name": rrpc.rpc_sync("worker0", _echo_with_caller, args=(torch.ones(2),)),
        "self by rank": rrpc.rpc_sync(0, torch.add, args=(torch.ones(2), 1)),
        "self async": rrpc.rpc_async(rrpc.get_worker_info(), _whoami).wait(),
    }


def _unknown_workers():
    errors = {}
    for to in ("nobody", 7, rrpc.WorkerInfo("ghost", 9)):
        try:
            rrpc.rpc_sync(to, _whoami)
            errors[repr(to)] = None
        except RuntimeError as exc:  # as torch
            errors[repr(to)] = str(exc)
    try:
        rrpc.get_worker_info("nobody")
        errors["get_worker_info"] = None
    except RuntimeError as exc:
        errors["get_worker_info"] = str(exc)
    for to in (1.5, None):  # names no worker at all: ValueError, as torch
        try:
            rrpc.rpc_sync(to, _whoami)
            errors[repr(to)] = None
        except ValueError as exc:
            errors[repr(to)] = type(exc).__name__
    errors["still serving"] = rrpc.rpc_sync("worker1", _whoami)
    return errors


def test_workers_are_addressed_by_name_rank_or_worker_info_including_self(cluster):
    got = cluster.run(_addressing)
    assert got["self"] == rrpc.WorkerInfo("worker0", 0)
    assert (got["self"].name, got["self"].id) == ("worker0", 0)
    assert got["by name"] == rrpc.WorkerInfo("worker1", 1)
    assert got["by rank"] == rrpc.WorkerInfo("worker2", 2)
    assert got["call by name"] == "worker2"
    assert got["call by rank"] == "worker1"
    assert got["call by info"] == "worker1"
    self_value, self_name = got["self by name"]
    assert torch.equal(self_value, torch.ones(2)) and self_name == "worker0"
    assert torch.equal(got["self by rank"], torch.full((2,), 2.0))
    assert got["self async"] == "worker0"


def test_unknown_worker_is_a_runtime_error_naming_it_and_the_known_workers(cluster):
    known = "(known workers: worker0, worker1, worker2)"
    missing = "could not find destination worker"
    assert cluster.run(_unknown_workers) == {
        "'nobody'": f"{missing} 'nobody' {known}",
        "7": f"{missing} 7 {known}",
        "WorkerInfo(id=9, name=ghost)": f"{missing} WorkerInfo(id=9, name=ghost) {known}",
        "get_worker_info": f"{missing} 'nobody' {known}",
        "1.5": "ValueError",
        "None": "ValueError",
        "still serving": "worker1",
    }


# -- Futures -------------------------------------------------------------------


def _futures_api():
    futures = [
        rrpc.rpc_async(f"worker{1 + i % 2}", torch.mul, args=(torch.ones(2), i)) for i in range(6)
    ]
    chained = futures[0].then(lambda fut: fut.wait() + 10)
    waited = torch.futures.wait_all(futures)
    collected = torch.futures.collect_all(futures[:2]).wait()
    is_future = isinstance(futures[0], torch.futures.Future)
    return {
        "is torch future": is_future,
        "wait_all": waited,
        "then": chained.wait(),
        "collect_all": [f.value() for f in collected],
        "done": all(f.done() for f in futures),
    }


def test_rpc_async_returns_a_torch_future_usable_with_then_wait_and_wait_all(cluster):
    got = cluster.run(_futures_api)
    assert got["is torch future"] is True
    assert len(got["wait_all"]) == 6
    for i, value in enumerate(got["wait_all"]):
        assert torch.equal(value, torch.full((2,), float(i)))
    assert torch.equal(got["then"], torch.full((2,), 10.0))
    assert torch.equal(got["collect_all"][1], torch.ones(2))
    assert got["done"] is True


def _collect_all_then_calls_the_same_peer():
    futures = [rrpc.rpc_async("worker1", torch.add, args=(torch.ones(2), i)) for i in range(2)]
    ran_on = []

    def callback(collected):
        ran_on.append(threading.current_thread().name)
        # Its reply is read by the thread that read the two above: the
        # callback must not run there (as torch, which runs it on a pool thread).
        return rrpc.rpc_sync("worker1", torch.add, args=(collected.value()[1].value(), 10))

    chained = torch.futures.collect_all(futures).then(callback)
    value = chained.wait()
    failing = [rrpc.rpc_async("worker1", _fail_one), futures[0]]
    try:
        torch.futures.collect_all(failing).wait()
        error = None
    except ValueError as exc:
        error = " ".join(map(str, exc.args))
    plain = torch.futures.collect_all([torch.futures.Future()])  # no rrpc future: torch's own
    return value, ran_on, error, not isinstance(plain, rrpc.futures.Future)


def _fail_one():
    raise ValueError("one of them failed")


def _collect_all_scenario(rank, world_size):
    return _collect_all_then_calls_the_same_peer() if rank == 0 else None


@pytest.mark.parametrize("lane", ["1", "0"])
def test_a_callback_on_collect_all_of_calls_may_call_the_same_peer(lane):
    value, ran_on, error, plain = run_workers(_collect_all_scenario, env={"RRPC_LANE": lane})[0]
    assert torch.equal(value, torch.full((2,), 12.0))
    assert ran_on[0].startswith("rrpc-callback-")
    assert "one of them failed" in error  # as torch's: the error of the one that failed
    assert plain


def _callbacks_on_a_done_future():
    future = rrpc.rpc_async("worker0", torch.add, args=(torch.ones(1), 1))
    future.wait()
    seen = []
    future.add_done_callback(lambda f: seen.append(threading.current_thread().name))
    future.then(lambda f: seen.append(threading.current_thread().name))
    return threading.current_thread().name, seen


def _done_future_callbacks(rank, world_size):
    return (
        [rrpc.rpc_sync("worker1", _callbacks_on_a_done_future) for _ in range(5)]
        if rank == 0
        else None
    )


@pytest.mark.parametrize("lane", ["1", "0"])
def test_a_callback_added_to_a_done_future_in_a_remote_function_runs_at_once_there(lane):
    # As torch: "if the Future is already completed, the callback runs inline",
    # also when the request runs on the thread that read it.
    for thread, seen in run_workers(_done_future_callbacks, env={"RRPC_LANE": lane})[0]:
        assert seen == [thread, thread]


def _negative_timeouts():
    seen = []
    for call in (rrpc.rpc_sync, rrpc.rpc_async):
        try:
            call("worker1", torch.add, args=(1, 2), timeout=-5)
        except ValueError as exc:
            seen.append(str(exc))
    return seen


def test_a_negative_timeout_other_than_the_default_is_refused_at_once(cluster):
    # A known difference: torch fails the call as timed out (a RuntimeError).
    seen = cluster.run(_negative_timeouts)
    assert seen == ["timeout must be >= 0 (0: none) or -1 (default), got -5"] * 2


def _fire_concurrently(count, targets):
    futures = [
        rrpc.rpc_async(
            targets[i % len(targets)],
            _scale,
            args=(torch.tensor([i]),),
            kwargs={"factor": 3, "shift": i},
        )
        for i in range(count)
    ]
    values = [f.wait() for f in futures]
    return [int(v.item()) for v in values]


def _thousand_concurrent_calls():
    # Worker1 fires its own 1000 at worker0 and worker2 while worker0 fires at both.
    theirs = rrpc.rpc_async("worker1", _fire_concurrently, args=(1000, ["worker0", "worker2"]))
    ours = _fire_concurrently(1000, ["worker1", "worker2"])
    return ours, theirs.wait()


def test_a_thousand_concurrent_rpc_async_calls_all_return_their_own_result(cluster):
    ours, theirs = cluster.run(_thousand_concurrent_calls)
    assert ours == [4 * i for i in range(1000)]
    assert theirs == [4 * i for i in range(1000)]


def _raise_value_error():
    raise ValueError("from worker1")


def _failed_call_frees_the_callers_frames():
    """An error raised out of rpc_sync must not keep the caller's frames (and
    their locals) alive: with the garbage collector off, refcounting frees them."""

    class Marker:
        pass

    def call(marker):
        rrpc.rpc_sync("worker1", _raise_value_error)

    gc.disable()
    try:
        marker = Marker()
        alive = weakref.ref(marker)
        try:
            call(marker)
        except ValueError:
            pass
        del marker
        return alive() is None
    finally:
        gc.enable()


def test_an_error_from_rpc_sync_leaves_no_reference_cycle_to_the_callers_frames(cluster):
    # (A torch Future that raises from wait() keeps its error, and so the
    # raising frames, alive from C++: rpc_sync must not go through one.)
    assert cluster.run(_failed_call_frees_the_callers_frames)


# -- Nesting -------------------------------------------------------------------


def test_nested_calls_back_to_the_caller_and_on_to_a_third_worker_complete(cluster):
    a_b_a = cluster.run(rrpc.rpc_sync, "worker1", _call_through, (["worker0"], 1))
    assert a_b_a == (["worker1", "worker0"], 3)
    a_b_c = cluster.run(_call_through, ["worker1", "worker2"], 1)
    assert a_b_c == (["worker0", "worker1", "worker2"], 5)
    a_b_c_a_b = cluster.run(_call_through, ["worker1", "worker2", "worker0", "worker1"], 1)
    assert a_b_c_a_b == (["worker0", "worker1", "worker2", "worker0", "worker1"], 17)


_release_events: dict[str, threading.Event] = {}


def _wait_for_release(key):
    event = _release_events.setdefault(key, threading.Event())
    return event.wait(timeout=20)


def _release(key):
    _release_events.setdefault(key, threading.Event()).set()
    return "released"


def _slow_call_does_not_stall_others():
    blocked = rrpc.rpc_async("worker1", _wait_for_release, args=("slow-1",))
    quick = rrpc.rpc_sync("worker1", _whoami)
    still_blocked = not blocked.done()
    released = rrpc.rpc_sync("worker1", _release, args=("slow-1",))
    return quick, still_blocked, released, blocked.wait()


def test_a_blocked_function_does_not_stall_other_calls_to_the_same_worker(cluster):
    assert cluster.run(_slow_call_does_not_stall_others) == ("worker1", True, "released", True)


# -- Dtypes, shapes, views -----------------------------------------------------

STANDARD_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
]  # fmt: skip
EXTRA_DTYPES = [
    torch.uint16, torch.uint32, torch.uint64, torch.complex32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
]  # fmt: skip


def _sample(dtype):
    generator = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, (4, 5), generator=generator).bool()
    if dtype in STANDARD_DTYPES or dtype in (torch.uint16, torch.uint32, torch.uint64):
        if dtype.is_floating_point or dtype.is_complex:
            values = torch.randn(4, 5, dtype=torch.float64, generator=generator) * 1000
            values[0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])
            return (torch.complex(values, values.flip(0)) if dtype.is_complex else values).to(dtype)
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(low, high, (4, 5), dtype=torch.int64, generator=generator).to(dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    return (
        torch.randint(0, 256, (4 * 5 * size,), dtype=torch.uint8, generator=generator)
        .view(dtype)
        .view(4, 5)
    )


def _raw_bytes(tensor):
    return bytes(tensor.contiguous().view(torch.uint8).numpy())


def _every_dtype_round_trip():
    failures = {}
    for dtype in STANDARD_DTYPES + EXTRA_DTYPES:
        sent = _sample(dtype)
        try:
            back = rrpc.rpc_sync("worker1", _echo, args=(sent,))
        except Exception as exc:
            failures[str(dtype)] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        if back.dtype != dtype or back.shape != sent.shape or _raw_bytes(back) != _raw_bytes(sent):
            failures[str(dtype)] = f"got {back.dtype} {tuple(back.shape)} with other bytes"
        elif dtype in STANDARD_DTYPES and not torch.equal(back, sent):
            failures[str(dtype)] = "torch.equal is False"
    return failures


def test_every_cpu_dtype_round_trips_exactly(cluster):
    assert cluster.run(_every_dtype_round_trip) == {}


def _tensor_bytes_sent(peer):
    return rrpc.stats().get(peer, {}).get("tensor_bytes_sent", 0)


def _tensor_bytes_received(peer):
    return rrpc.stats().get(peer, {}).get("tensor_bytes_received", 0)


def _bytes_on_the_wire(tensor):
    """A view keeps its strides over the storage between its first and last
    element when that span is small (< 64 KiB) or at most 4x its own bytes;
    otherwise only its elements travel."""
    if tensor.is_contiguous() or tensor.is_conj() or tensor.numel() == 0:
        return tensor.nbytes
    span = 1 + sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True))
    span_bytes = span * tensor.element_size()
    return span_bytes if span_bytes <= max(4 * tensor.nbytes, 64 << 10) else tensor.nbytes


def _special_shapes_and_views():
    big = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB of storage
    cases = {
        "0-dim": torch.tensor(3.25),
        "0-dim int": torch.tensor(-5, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty 3-d": torch.empty(3, 0, 2, dtype=torch.int16),
        "transposed": torch.arange(24.0).reshape(4, 6).t(),
        "column of big": big.view(1000, 1000)[:, 3],
        "slice of big": big[500_000:500_010],
        "strided slice": torch.arange(100, dtype=torch.int32)[5:60:7],
        "expanded": torch.arange(3.0).expand(4, 3),
        "conj view": torch.complex(torch.arange(3.0), torch.ones(3)).conj(),
        "channels last": torch.arange(120.0)
        .reshape(2, 3, 4, 5)
        .to(memory_format=torch.channels_last),
    }
    results = {}
    for name, tensor in cases.items():
        sent_before = _tensor_bytes_sent("worker1")
        received_before = _tensor_bytes_received("worker1")
        back = rrpc.rpc_sync("worker1", _echo, args=(tensor,))
        results[name] = {
            "sent": tensor,
            "back": back,
            "expected bytes": _bytes_on_the_wire(tensor),
            "bytes sent": _tensor_bytes_sent("worker1") - sent_before,
            "bytes received": _tensor_bytes_received("worker1") - received_before,
        }
    return results


def test_zero_dim_empty_non_contiguous_and_view_tensors_arrive_with_values_and_shape(cluster):
    results = cluster.run(_special_shapes_and_views)
    for name, result in results.items():
        sent, back = result["sent"], result["back"]
        assert back.shape == sent.shape, name
        assert back.dtype == sent.dtype, name
        assert torch.equal(back, sent.resolve_conj()), name
        if not sent.is_conj() and name != "column of big":  # as torch: a view stays a view
            assert back.stride() == sent.stride(), name


def test_a_view_sends_only_the_bytes_it_views_counted_by_the_agent(cluster):
    results = cluster.run(_special_shapes_and_views)
    counted = {name: (r["bytes sent"], r["bytes received"]) for name, r in results.items()}
    expected = {name: (r["expected bytes"],) * 2 for name, r in results.items()}
    assert counted == expected
    assert counted["column of big"] == (4000, 4000)  # not the 4 MB storage it views
    assert counted["slice of big"] == (40, 40)


def _large_tensors():
    generator = torch.Generator().manual_seed(11)
    single = torch.randn(5 << 18, generator=generator)  # 5 MiB, above gRPC's 4 MiB default
    several = [
        torch.randint(0, 2**31, (3 << 20,), dtype=torch.int32, generator=generator)
        for _ in range(4)
    ]
    back = rrpc.rpc_sync("worker1", _echo, args=(single,))
    # Several 12 MiB messages in flight at once to two peers, interleaved on the streams.
    futures = [
        rrpc.rpc_async(f"worker{1 + i % 2}", _echo, args=(t,)) for i, t in enumerate(several)
    ]
    return {
        "single": torch.equal(back, single),
        "single bytes": back.numel() * back.element_size(),
        "several": [torch.equal(f.wait(), t) for f, t in zip(futures, several, strict=True)],
    }


def test_tensors_larger_than_4mib_arrive_exact_even_several_at_once(cluster):
    assert cluster.run(_large_tensors) == {
        "single": True,
        "single bytes": 5 << 20,
        "several": [True, True, True, True],
    }


# -- async_execution (own world: one worker thread) ------------------------------

_running = {"now": 0, "most": 0, "order": []}
_running_lock = threading.Lock()


def _run_one(i):
    with _running_lock:
        _running["now"] += 1
        _running["most"] = max(_running["most"], _running["now"])
        _running["order"].append(i)
    sum(range(20_000))  # some work, holding nothing
    with _running_lock:
        _running["now"] -= 1
    return i


def _run_one_stats():
    return _running["most"], _running["order"]


def _many_calls_to_a_one_thread_worker(rank, world_size):
    if rank != 0:
        return None
    replies = [rrpc.rpc_async("worker1", _run_one, args=(i,)) for i in range(200)]
    replies += [rrpc.rpc_async("worker1", _run_one, args=(200 + i,)).wait() for i in range(50)]
    assert [r if isinstance(r, int) else r.wait() for r in replies] == list(range(250))
    return rrpc.rpc_sync("worker1", _run_one_stats)


def test_num_worker_threads_bounds_concurrency_and_keeps_arrival_order():
    # Requests may run on the stream's reader thread instead of the pool;
    # num_worker_threads=1 must still mean one at a time, in arrival order.
    options = rrpc.RpcBackendOptions(num_worker_threads=1)
    most, order = run_workers(
        _many_calls_to_a_one_thread_worker, 2, backend_options=options, timeout=60
    )[0]
    assert most == 1
    assert order == list(range(250))


_parked: list[torch.futures.Future] = []


@rrpc.functions.async_execution
def _park_a_future():
    future = torch.futures.Future()
    _parked.append(future)
    return future


def _count_parked():
    return len(_parked)


def _complete_parked(value):
    _parked.pop().set_result(value)
    return "completed"


@rrpc.functions.async_execution
def _add_via_own_worker(x):
    # Runs on the callee's only worker thread; the inner call to the same worker
    # needs that thread, which is free as soon as this function returns.
    me = rrpc.get_worker_info().name
    return rrpc.rpc_async(me, torch.add, args=(x, 1)).then(lambda fut: fut.wait() * 10)


@rrpc.functions.async_execution
def _ask_the_caller_back(caller, x):
    return rrpc.rpc_async(caller, _scale, args=(x,), kwargs={"factor": 2})


@rrpc.functions.async_execution
def _future_that_fails():
    future = torch.futures.Future()
    future.set_exception(KeyError("missing-key"))
    return future


@rrpc.functions.async_execution
def _not_a_future():
    return 42


class _AsyncMethods:
    @staticmethod
    @rrpc.functions.async_execution
    def static_add(x, y):
        future = torch.futures.Future()
        future.set_result(x + y)
        return future


def _exercise_async_execution(rank, world_size):
    if rank != 0:
        return None
    results = {}
    parked = rrpc.rpc_async("worker1", _park_a_future)
    # worker1 has one thread: each call below needs it while the first reply waits.
    results["parked before"] = rrpc.rpc_sync("worker1", _count_parked, timeout=10)
    results["done before completion"] = parked.done()
    results["complete"] = rrpc.rpc_sync(
        "worker1", _complete_parked, args=("the value",), timeout=10
    )
    results["parked reply"] = parked.wait()
    results["own worker"] = rrpc.rpc_sync(
        "worker1", _add_via_own_worker, args=(torch.ones(2),), timeout=10
    )
    results["caller back"] = rrpc.rpc_sync(
        "worker1", _ask_the_caller_back, args=("worker0", torch.ones(2)), timeout=10
    )
    results["static"] = rrpc.rpc_sync("worker1", _AsyncMethods.static_add, args=(2, 3), timeout=10)
    for name, fn in (("failed future", _future_that_fails), ("not a future", _not_a_future)):
        try:
            rrpc.rpc_sync("worker1", fn, timeout=10)
            results[name] = None
        except Exception as exc:
            results[name] = (type(exc).__name__, str(exc))
    return results


def test_async_execution_replies_when_the_future_completes_and_frees_the_worker_thread():
    options = rrpc.RpcBackendOptions(num_worker_threads=1)
    results = run_workers(_exercise_async_execution, 2, backend_options=options, timeout=60)[0]
    assert results["parked before"] == 1
    assert results["done before completion"] is False
    assert results["complete"] == "completed"
    assert results["parked reply"] == "the value"
    assert torch.equal(results["own worker"], torch.full((2,), 20.0))
    assert torch.equal(results["caller back"], torch.full((2,), 2.0))
    assert results["static"] == 5
    assert results["failed future"] == ("KeyError", "'missing-key'")
    # torch's type and wording: a RuntimeError.
    assert results["not a future"][0] == "RuntimeError"
    assert results["not a future"][1] == (
        "Functions decorated with @rpc.async_function must return a torch.futures.Future "
        "object, but got int: _not_a_future is marked async_execution"
    )


def _bounce(depth, x):
    """Call the other worker, which calls back, ``depth`` times: each worker
    holds about depth / 2 requests blocked in rpc_sync at the deepest point."""
    if depth == 0:
        return x
    me = rrpc.get_worker_info().id
    return rrpc.rpc_sync(1 - me, _bounce, args=(depth - 1, x + 1), timeout=20)


def _nested_deeper_than_the_pool(rank, world_size):
    if rank != 0:
        return None
    sync = rrpc.rpc_sync("worker1", _bounce, args=(9, 0), timeout=30)
    futures = [rrpc.rpc_async("worker1", _bounce, args=(7, i), timeout=30) for i in range(3)]
    return sync, [future.wait() for future in futures]


def test_nested_calls_deeper_than_num_worker_threads_complete():
    # A request blocked in an RPC of its own gives its worker permit back
    # meanwhile, so the pool bounds running functions, never waiting ones.
    options = rrpc.RpcBackendOptions(num_worker_threads=2)
    results = run_workers(_nested_deeper_than_the_pool, 2, backend_options=options, timeout=90)
    assert results[0] == (9, [7, 8, 9])
