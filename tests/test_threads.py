"""Every thread rrpc starts is a row of ARCHITECTURE.md's threads table.

Three real workers run a workload that touches every feature (calls sync and
async, callbacks, nested calls, RRefs forked to a third worker, distributed
autograd and the optimizer, both profilers, ``async_execution``, stats and a
Prometheus scrape, fault injection, shared-memory tensors, large messages
that back a lane's writes up, membership callbacks), once over same-host
lanes and once over gRPC alone (``RRPC_LANE=0``). Each worker records the
name of every thread started in it (``threading.Thread.start``, wrapped
before ``init_rpc``) and, at points during the run and after ``shutdown``,
every thread alive (``threading.enumerate``: it also shows threads started
outside Python that ran Python code). The test fails naming each thread
whose name matches no row of the table (each row's name pattern, e.g.
``rrpc-serve-<rank>-{0,1}``, read as a regular expression) and is not on
``NOT_RRPCS`` below.
"""

from __future__ import annotations

import pathlib
import re
import threading
import urllib.request

import pytest
import torch

import rrpc
import rrpc.optim
from harness import free_port, run_workers

ARCHITECTURE = pathlib.Path(__file__).resolve().parent.parent / "ARCHITECTURE.md"

# Threads in a worker that rrpc does not start, each with why it is there.
NOT_RRPCS = {
    "MainThread": "the worker process's own thread: the user's, here the harness's",
    "harness-parent-watch": "tests/harness.py: ends the child when the test process dies",
}

_seen: dict[str, str] = {}  # thread name -> where it was first seen (in a worker)


# -- Recording, in each worker -----------------------------------------------------
def _record_starts() -> None:
    """From now on, every thread started in this process is recorded by name."""
    start = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        _seen.setdefault(self.name, "started")
        start(self)

    threading.Thread.start = recording_start  # type: ignore[method-assign]


def _snapshot(where: str) -> None:
    for thread in threading.enumerate():
        _seen.setdefault(thread.name, where)


def _snapshot_here(where: str) -> str:
    """Run on a peer: record its threads while it serves."""
    _snapshot(where)
    return rrpc.get_worker_info().name


# -- The workload's remote functions -------------------------------------------------
def _nested(to: str, x: torch.Tensor) -> torch.Tensor:
    return rrpc.rpc_sync(to, torch.add, args=(x, 1))


@rrpc.functions.async_execution
def _async_add(to: str, x: torch.Tensor) -> torch.futures.Future:
    return rrpc.rpc_async(to, torch.add, args=(x, 1)).then(lambda f: f.value() * 2)


def _param(seed: int) -> torch.Tensor:
    return torch.rand((4, 4), generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _forward(weight: rrpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight.local_value())


def _to_here(rref: rrpc.RRef) -> torch.Tensor:
    return rref.to_here()


def _echo(value: object) -> object:
    return value


def _metrics_port() -> int:
    return rrpc.agent.current_agent().exporter.port


def _workload(to: str, third: str) -> None:
    x = torch.ones(4)
    assert rrpc.rpc_sync(to, torch.add, args=(x, 1)).tolist() == [2.0] * 4
    # Many calls at once: batching, the lane's background reader, the pools.
    pending = [rrpc.rpc_async(to, torch.mul, args=(x, i)) for i in range(100)]
    assert [f.wait()[0].item() for f in pending] == [float(i) for i in range(100)]
    # A user callback that makes an RPC: it runs on a callback thread.
    chained = rrpc.rpc_async(to, torch.add, args=(x, 1)).then(
        lambda f: (_snapshot("callback"), rrpc.rpc_sync(third, torch.add, args=(f.value(), 1)))[1]
    )
    assert chained.wait().tolist() == [3.0] * 4
    # Nested calls deeper than the callee's pool (4 threads): extra pool threads.
    nested = [rrpc.rpc_async(to, _nested, args=(third, x)) for _ in range(12)]
    assert all(f.wait().tolist() == [2.0] * 4 for f in nested)
    assert rrpc.rpc_sync(to, _async_add, args=(third, x)).tolist() == [4.0] * 4
    # RRefs: created on one worker, forked to a third, methods through proxies.
    rref = rrpc.remote(to, torch.mul, args=(x, 3))
    assert rrpc.rpc_sync(third, _to_here, args=(rref,)).tolist() == [3.0] * 4
    assert rref.rpc_sync().size() == torch.Size([4])
    # Distributed autograd and the optimizer.
    weight = rrpc.remote(to, _param, args=(0,))
    optimizer = rrpc.optim.DistributedOptimizer(torch.optim.SGD, [weight], lr=0.1)
    with rrpc.autograd.context() as context_id:
        loss = rrpc.rpc_sync(to, _forward, args=(weight, torch.ones(2, 4))).sum()
        rrpc.autograd.backward(context_id, [loss])
        optimizer.step(context_id)
    # Both profilers.
    with torch.autograd.profiler_legacy.profile():
        rrpc.rpc_sync(to, torch.add, args=(x, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        rrpc.rpc_sync(to, torch.add, args=(x, 1))
    # Shared memory (tensors over 1 MiB), and messages that back a lane's writes up.
    big = torch.ones(1 << 19)  # 2 MiB
    assert rrpc.rpc_sync(to, torch.mul, args=(big, 2))[0].item() == 2.0
    blob = bytes(8 << 20)
    assert len(rrpc.rpc_sync(to, _echo, args=(blob,))) == len(blob)
    # Stats, and a scrape of the callee's Prometheus endpoint.
    assert rrpc.stats()[to]["calls_sent"] > 0
    assert rrpc.stats("worker")["in_flight"] >= 0
    port = rrpc.rpc_sync(to, _metrics_port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert b"rrpc_peer_calls_served_total" in response.read()
    # Fault injection (this worker's options): delayed and failed sends are retried.
    assert rrpc.rpc_sync(to, torch.add, args=(x, 1)).tolist() == [2.0] * 4
    rrpc.on_membership_change(lambda event: None)  # the callbacks' thread starts
    for peer in (to, third):
        rrpc.rpc_sync(peer, _snapshot_here, args=("serving",))
    _snapshot("calling")


def _worker(rank: int, world_size: int) -> dict[str, str]:
    _snapshot("before init_rpc")
    _record_starts()
    names = [f"worker{r}" for r in range(world_size)]
    options: rrpc.RpcBackendOptions = rrpc.RpcBackendOptions(
        num_worker_threads=4, metrics_port=free_port()
    )
    # Fault injection on worker2's sends (delayed sends go from the scheduler).
    if rank == 2:
        options = rrpc.FaultyRpcBackendOptions(
            num_worker_threads=4,
            metrics_port=free_port(),
            messages_to_delay={"PYTHON_CALL": 0.01},
            messages_to_fail=["RREF_FORK_REQUEST"],
            num_fail_sends=1,
        )
    rrpc.init_rpc(names[rank], rank=rank, world_size=world_size, rpc_backend_options=options)
    _snapshot("after init_rpc")
    if rank in (0, 2):  # two callers at once, each through both others
        _workload(names[(rank + 1) % 3], names[(rank + 2) % 3])
    rrpc.shutdown()
    _snapshot("after shutdown")
    return dict(_seen)


# -- The table -------------------------------------------------------------------------
def thread_patterns(workers: list[str]) -> dict[str, re.Pattern]:
    """ARCHITECTURE.md's threads table: each row's name patterns as regexes,
    keyed by the pattern. ``<peer>`` and ``<name>`` are one of ``workers``,
    any other ``<...>`` a number, ``{a,b}`` one of a and b."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Threads", 1)[1].split("\n## ", 1)[0]
    worker = "(?:" + "|".join(map(re.escape, workers)) + ")"
    patterns = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            regex = ""
            for piece in re.split(r"(<[a-z ]+>|\{[^}]*\})", name):
                if piece in ("<peer>", "<name>"):
                    regex += worker
                elif re.fullmatch(r"<[a-z ]+>", piece):
                    regex += r"\d+"
                elif piece.startswith("{"):
                    regex += "(?:" + "|".join(map(re.escape, piece[1:-1].split(","))) + ")"
                else:
                    regex += re.escape(piece)
            patterns[name] = re.compile(regex)
    return patterns


def test_the_table_reads_as_patterns():
    patterns = thread_patterns(["worker0", "worker1"])
    assert patterns["rrpc-serve-<rank>-{0,1}"].fullmatch("rrpc-serve-3-1")
    assert not patterns["rrpc-serve-<rank>-{0,1}"].fullmatch("rrpc-serve-3-2")
    assert patterns["rrpc-<name>-<i>"].fullmatch("rrpc-worker1-12")
    assert not patterns["rrpc-<name>-<i>"].fullmatch("rrpc-lane-7")
    assert patterns["rrpc-lane-send-<rank><-<caller rank>"].fullmatch("rrpc-lane-send-0<-2")
    assert patterns["rrpc-stream_<n>"].fullmatch("rrpc-stream_4")
    assert patterns["rrpc-send-<peer>"].fullmatch("rrpc-send-worker1")
    assert patterns["rrpc-scheduler"].fullmatch("rrpc-scheduler")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lane", ["1", "0"], ids=["lane", "grpc"])
def test_every_thread_a_worker_runs_is_in_the_architecture_table(lane):
    reports = run_workers(_worker, world_size=3, init=False, env={"RRPC_LANE": lane}, timeout=75)
    patterns = thread_patterns([f"worker{rank}" for rank in range(3)])
    unknown = []
    for rank, seen in enumerate(reports):
        for name, where in sorted(seen.items()):
            if name in NOT_RRPCS or any(p.fullmatch(name) for p in patterns.values()):
                continue
            unknown.append(f"worker{rank}: {name!r} (seen {where})")
    assert not unknown, "threads in no row of ARCHITECTURE.md's threads table:\n" + "\n".join(
        unknown
    )
    if lane == "1":  # the lane's own threads ran
        names = set().union(*reports)
        lane_rows = ["rrpc-lane-accept-<rank>", "rrpc-lane-serve-<rank>", "rrpc-lane-recv-<peer>"]
        lane_rows += ["rrpc-lane-send-<peer>", "rrpc-lane-send-<rank><-<caller rank>"]
        for row in lane_rows:
            assert any(patterns[row].fullmatch(n) for n in names), row
