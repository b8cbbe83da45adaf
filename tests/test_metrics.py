"""Metrics: counters per peer and per function equal to the calls made; the Prometheus endpoint.

The multi-process tests start their own worlds (counts must start at zero) and
coordinate through multiprocessing events: a *gate* that a callee's function
waits on and the caller opens, so that "in flight", "timed out" and "how long
at least" are facts the test arranges, not timings it hopes for.
"""

from __future__ import annotations

import math
import random
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import rrpc
from harness import free_port, mp_context, run_workers
from rrpc import metrics
from rrpc.messages import CALL
from rrpc.pool import WorkerPool

pytestmark = pytest.mark.timeout(120)

GATE_WAIT = 30.0  # the longest a gated function or a rank waits for the other side

_events: dict[str, object] = {}  # the multiprocessing events of this world, per process


# -- Histogram and pool, in this process -------------------------------------------


def test_bucket_bounds_hold_the_latencies_they_are_given():
    for micros in [0.2, 1, 1.5, 2, 3, 7.9, 8, 1000, 123_456, 9e9, 1e12]:
        low, high = metrics.bucket_bounds(metrics.bucket_of(micros / 1e6))
        assert low <= micros < high


def test_every_bucket_holds_its_own_bounds_and_nothing_past_them():
    assert metrics.bucket_of(0.0) == 0
    for index in range(1, metrics.BUCKETS):
        low, high = metrics.bucket_bounds(index)
        assert metrics.bucket_of(low / 1e6) == index
        assert metrics.bucket_of(low * (1 - 1e-9) / 1e6) == index - 1
        if high != math.inf:
            assert metrics.bucket_of((low + high) / 2e6) == index


def test_percentiles_are_within_half_a_bucket_of_the_exact_sample():
    generator = random.Random(7)
    samples = [generator.lognormvariate(math.log(300e-6), 1.0) for _ in range(5000)]
    row = metrics.Row()
    for latency in samples:
        metrics.answered(row, 0, 0, latency, error=False)
    ordered = sorted(samples)
    for q in (0.5, 0.99):
        exact_us = 1e6 * ordered[math.ceil(q * len(samples)) - 1]
        assert abs(row.percentile_us(q) - exact_us) <= exact_us / (2 * metrics.SUB)
    assert row.replies == 5000 and row.in_flight == -5000  # answered without sent: only here


def test_rows_by_peer_and_by_function_are_the_sums_of_the_cells():
    table = metrics.Metrics()
    f, g, h = math.floor, math.ceil, math.sqrt
    for peer, function, latency in [("a", f, 1e-4), ("a", g, 2e-4), ("b", f, 4e-3)]:
        row = table.sent(peer, CALL, (function, (), {}), 100, 10)
        metrics.answered(row, 50, 0, latency, error=peer == "b")
    metrics.late(table.late_row("b"), 7, 0)
    served = table.served("b", CALL, (h, (), {}), 30, 0)
    metrics.replied(served, 20, 0, error=False)
    peers, functions = table.peers, table.functions
    assert peers["a"].calls_sent == 2 and peers["b"].calls_sent == 1
    assert peers["b"].bytes_received == 50 + 7 + 30 and peers["b"].errors == 1
    assert peers["b"].calls_served == 1 and peers["b"].bytes_sent == 100 + 20
    floor = functions["math.floor"]
    assert floor.replies == 2 and floor.latency_total == 1e-4 + 4e-3 and sum(floor.latency) == 2
    assert 150 < functions["math.ceil"].percentile_us(0.5) < 250
    assert set(functions) == {"math.floor", "math.ceil", "math.sqrt"}  # late: the peer's alone


def test_functions_past_the_bound_are_counted_under_other_functions(monkeypatch):
    monkeypatch.setattr(metrics, "MAX_FUNCTIONS", 2)
    table = metrics.Metrics()
    for peer in ("a", "b"):
        for function in (math.floor, math.ceil, math.sqrt, math.exp):
            table.sent(peer, CALL, (function, (), {}), 1, 0)
    functions = table.functions
    assert set(functions) == {"math.floor", "math.ceil", metrics.OTHER_FUNCTIONS}
    assert functions[metrics.OTHER_FUNCTIONS].calls_sent == 4  # sqrt and exp, from each peer
    assert functions["math.floor"].calls_sent == 2  # a function under the bound, from a new peer
    assert len(table.cells) == 6  # at most MAX_FUNCTIONS + 1 cells per peer


def test_worker_pool_counts_the_requests_waiting_for_a_thread():
    pool = WorkerPool(1, "rrpc-test-pool")
    started, release = threading.Event(), threading.Event()

    def blocked() -> None:
        started.set()
        release.wait(GATE_WAIT)

    try:
        pool.submit(blocked)
        assert started.wait(GATE_WAIT)
        for _ in range(3):
            pool.submit(lambda: None)
        assert pool.queued() == 3
    finally:
        release.set()
        pool.stop(5.0)
    assert pool.queued() == 0


def test_metrics_port_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RRPC_METRICS_PORT", "9464")
    assert rrpc.RpcBackendOptions().metrics_port == 9464
    monkeypatch.delenv("RRPC_METRICS_PORT")
    assert rrpc.RpcBackendOptions().metrics_port == 0
    with pytest.raises(ValueError, match="metrics_port"):
        rrpc.RpcBackendOptions(metrics_port=70000)


# -- Functions the workers run -------------------------------------------------------


def _add_one(t):
    return t + 1


def _raise(message):
    raise ValueError(message)


def _gated():
    """Tell the caller it runs, then wait until the caller opens the gate."""
    _events["started"].set()  # type: ignore[attr-defined]
    assert _events["gate"].wait(GATE_WAIT)  # type: ignore[attr-defined]
    _events["started"].clear()  # type: ignore[attr-defined]
    _events["gate"].clear()  # type: ignore[attr-defined]
    return "through"


def _make_tensor():
    return torch.zeros(4)


def _name(func) -> str:
    return f"{func.__module__}.{func.__qualname__}"


def _calls_of_every_outcome(rank, world_size, started, gate, done):
    _events.update(started=started, gate=gate)
    if rank == 1:  # the callee: report what it counted once the caller is done
        assert done.wait(GATE_WAIT)
        return rrpc.stats(), rrpc.stats("function")
    seen = {}
    tensor = torch.ones(256)  # 1 KiB each way per call
    for _ in range(5):
        rrpc.rpc_sync("worker1", _add_one, args=(tensor,))
    futures = [rrpc.rpc_async("worker1", _add_one, args=(tensor,)) for _ in range(3)]
    torch.futures.wait_all(futures)
    for message in ("one", "two"):
        with pytest.raises(ValueError):
            rrpc.rpc_sync("worker1", _raise, args=(message,))
    # A call in flight while the callee holds it.
    sent = time.monotonic()
    held = rrpc.rpc_async("worker1", _gated)
    assert started.wait(GATE_WAIT)
    seen["in flight"] = (
        rrpc.stats()["worker1"]["in_flight"],
        rrpc.stats("function")[_name(_gated)]["in_flight"],
        rrpc.stats("worker")["in_flight"],
    )
    held_at_least = time.monotonic() - sent
    gate.set()
    assert held.wait() == "through"
    # A call that times out while the callee holds it, answered late.
    with pytest.raises(rrpc.RpcTimeoutError):
        rrpc.rpc_sync("worker1", _gated, timeout=0.5)
    gate.set()
    seen["peer"] = rrpc.stats()["worker1"]
    seen["functions"] = rrpc.stats("function")
    seen["held at least"] = held_at_least
    # remote() and to_here() count under the function and the RREF_FETCH kind.
    rrefs = [rrpc.remote("worker1", _make_tensor) for _ in range(2)]
    for rref in rrefs:
        rref.to_here()
    seen["after remote"] = rrpc.stats("function")
    seen["worker"] = rrpc.stats("worker")
    del rrefs
    done.set()
    return seen


def test_counters_per_peer_and_per_function_equal_the_calls_made():
    started, gate, done = mp_context.Event(), mp_context.Event(), mp_context.Event()
    seen, (callee_peers, callee_functions) = run_workers(
        _calls_of_every_outcome, 2, args=(started, gate, done), timeout=90
    )
    add, fail, gated = _name(_add_one), _name(_raise), _name(_gated)

    assert seen["in flight"] == (1, 1, 1)
    peer, functions = seen["peer"], seen["functions"]
    # 8 answered, 2 raised, 1 answered after holding, 1 timed out: 12 sent, none left open.
    assert peer["calls_sent"] == 12
    assert peer["replies"] == 11
    assert peer["errors"] == 2
    assert peer["timeouts"] == 1
    assert peer["in_flight"] == 0
    assert functions[add]["calls_sent"] == 8 and functions[add]["replies"] == 8
    assert functions[add]["errors"] == functions[add]["timeouts"] == 0
    assert functions[add]["tensor_bytes_sent"] == 8 * 1024
    assert functions[add]["tensor_bytes_received"] == 8 * 1024
    assert functions[fail]["calls_sent"] == 2 and functions[fail]["errors"] == 2
    assert functions[gated]["calls_sent"] == 2
    assert functions[gated]["replies"] == 1 and functions[gated]["timeouts"] == 1
    # The held call's reply took at least as long as it was held.
    held = functions[gated]
    assert held["latency_p99_us"] >= 1e6 * seen["held at least"] * (1 - 1 / (2 * metrics.SUB))
    assert 0 < functions[add]["latency_p50_us"] <= functions[add]["latency_p99_us"]
    assert sum(row["calls_sent"] for row in functions.values()) == peer["calls_sent"]

    after = seen["after remote"]
    assert after[_name(_make_tensor)]["calls_sent"] == 2
    assert after["RREF_FETCH"]["calls_sent"] == 2 and after["RREF_FETCH"]["replies"] == 2
    assert seen["worker"]["num_user_rrefs"] == 2
    assert seen["worker"]["in_flight"] == 0 and seen["worker"]["queue_depth"] == 0

    # The callee counted the same requests from its side.
    assert callee_functions[add]["calls_served"] == 8
    assert callee_functions[add]["tensor_bytes_received"] == 8 * 1024
    assert callee_functions[add]["tensor_bytes_sent"] == 8 * 1024
    assert callee_functions[fail]["calls_served"] == 2
    assert callee_functions[fail]["errors_served"] == 2
    assert callee_functions[gated]["calls_served"] == 2
    assert callee_functions[_name(_make_tensor)]["calls_served"] == 2
    assert callee_peers["worker0"]["calls_served"] >= 12 + 2 + 2  # and RRef DELETEs, maybe


def _scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _serve_metrics(rank, world_size, port):
    options = rrpc.RpcBackendOptions(metrics_port=port if rank == 0 else 0)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    text = None
    if rank == 0:
        for i in range(7):
            rrpc.rpc_sync("worker1", _add_one, args=(torch.tensor(i),))
        with pytest.raises(ValueError):
            rrpc.rpc_sync("worker1", _raise, args=("scraped",))
        text = _scrape(port)
    rrpc.shutdown()
    if rank == 0:
        with pytest.raises(urllib.error.URLError):
            _scrape(port)  # the endpoint ends with the worker's RPC
    return text


def test_prometheus_endpoint_serves_the_counters_of_the_calls_made():
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    text = run_workers(_serve_metrics, 2, args=(port,), init=False, timeout=90)[0]
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name, **labels):
        return samples[(name, tuple(sorted({"worker": "worker0", **labels}.items())))]

    assert value("rrpc_peer_calls_sent_total", peer="worker1") == 8
    assert value("rrpc_peer_errors_total", peer="worker1") == 1
    assert value("rrpc_peer_in_flight", peer="worker1") == 0
    assert value("rrpc_function_calls_sent_total", function=_name(_add_one)) == 7
    assert value("rrpc_function_replies_total", function=_name(_add_one)) == 7
    assert value("rrpc_function_errors_total", function=_name(_raise)) == 1
    assert value("rrpc_function_latency_seconds_count", function=_name(_add_one)) == 7
    assert value("rrpc_function_latency_seconds_bucket", function=_name(_add_one), le="+Inf") == 7
    assert value("rrpc_worker_in_flight") == 0
    assert value("rrpc_worker_queue_depth") == 0


def _module_level_function():
    return None


def test_function_names_are_remembered_for_module_functions_but_no_closure_is_kept_alive():
    import gc
    import weakref

    from rrpc import metrics

    name = metrics.function_name(_module_level_function)
    assert name == "test_metrics._module_level_function"
    assert metrics._names[_module_level_function] == name

    def make(captured):
        return lambda: captured

    closure = make(torch.ones(1024))
    assert metrics.function_name(closure).endswith("make.<locals>.<lambda>")
    alive = weakref.ref(closure)
    del closure
    gc.collect()
    assert alive() is None  # the name cache does not hold what a call captured
