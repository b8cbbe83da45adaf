"""Side-by-side benchmark: rrpc against torch.distributed.rpc (TensorPipe).

Run from the repository root:

    python benchmarks/bench.py                       # everything, ~7 min on 2 idle vCPUs
    python benchmarks/bench.py --quick               # fewer repeats and calls, ~2.5 min
    python benchmarks/bench.py --only noop_sync,echo_16m --quick
    python benchmarks/bench.py --only veth_echo_16m      # two "hosts"; needs root
    python benchmarks/bench.py --frameworks torch    # reference numbers only
    python benchmarks/bench.py --json results.json
    python benchmarks/bench.py --overhead            # rrpc's stats and profiler hook, per call

How it measures. Every workload runs in fresh processes: two (a "client" that
drives the measurement and a "server" it calls) or, for `param_server` and
`rl_steps`, three. They are started with the multiprocessing spawn context on a
free port of 127.0.0.1 and talk through the framework under test; the driver
sends its numbers back over a multiprocessing queue. For each workload the
frameworks alternate (torch, rrpc, rrpc, torch, ...) for R repeats and the table
shows the median over the repeats, so drift on the machine hits both sides alike.

The workloads. `noop_sync` (latency of an empty call), `async_64` (64 calls in
flight), `threads_64` (64 threads calling), `echo_*` (a tensor there and back,
the same tensor every call, each result dropped), `echo_fresh_*` (a new tensor
every call, the last 4 results kept alive: what a real loop does, and no
buffer of one call can serve the next), `veth_noop_sync` and `veth_echo_*`
(below), `remote_to_here`, `rref_arg` (a call that passes a user RRef to its
owner, the `_call_method(method, rref, ...)` idiom of torch's examples),
`dist_autograd` (a step of distributed autograd and DistributedOptimizer),
`param_server` (two trainers, one server), `rl_steps` (examples/rl_agents: an
agent and two observers playing CartPole, seeded, so both frameworks play the
very same steps), `peak_mem_128m` (memory of one 128 MiB round trip).

Two "hosts". The `veth_*` workloads put the client and the server in two network
namespaces joined by a veth pair (`netns.py`; created once per benchmark run and
removed at its end), so their only way to each other is TCP over that link, as
between two machines: rrpc with `RRPC_SHM=0` and `RRPC_LANE=0`, TensorPipe with
its default transports and channels less `cma` (which would read the peer's
memory with process_vm_readv, across namespaces): `mpt_uv` and `basic` over
`uv`. Each run checks the veth's byte counters: at least the payloads it timed
must have crossed the link, or the run fails. Without root or `ip`, these rows
read "n/a (needs root and ip netns)".

Floors. Some rows also run the same round trips on a bare transport, in the
same interleaved repeats, as a "floor" column: how far above it each framework
is. "grpcio" (`floor.py`, beside `noop_sync` and `echo_4k`, and over the veth
beside `veth_noop_sync`): a bare grpcio bidi stream, what rrpc's gRPC path is
built on. "uds" (`stream_floor.py`, the same
rows): a Unix socket on which the calling thread writes and reads its own
reply, the floor under rrpc's same-host lane. "tcp" (`stream_floor.py`, the
`veth_*` rows): a TCP stream over the same link, `sendall` and `recv_into` a
buffer allocated once: the floor under any transport between two hosts.

How to read it. Each row is one metric; "speedup" is rrpc's advantage over
torch: rrpc ÷ torch for rates (calls/s, GB/s), torch ÷ rrpc for times and
memory. Above 1 means rrpc is better, below 1 means torch is. A cell reading
"n/a (...)" means that run failed; the message says why (tracebacks go to
stderr). Expect ±20-40 % noise between runs on a small VM; the header prints the
load average, and when it is above the CPU count other work is competing and the
numbers mean little.

Both frameworks are driven through the same code: a workload receives the
framework's modules (rpc, autograd, DistributedOptimizer) and cannot tell which
one it has, which is also a check that rrpc's API mirrors PyTorch's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import importlib
import json
import multiprocessing
import os
import platform
import queue
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import floor  # benchmarks/floor.py: the bare-grpcio floor
import netns  # benchmarks/netns.py, beside this file (sys.path[0], also in the workers)
import numpy as np
import stream_floor  # benchmarks/stream_floor.py: the bare-socket floor
import torch

# examples/, for `rl_steps` (it runs examples/rl_agents/main.py as `rl_agents.main`);
# set at import, so every worker process, which imports this file, has it too.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)

MiB = 1024 * 1024
ECHO_SIZES = {
    "echo_4k": 4 * 1024,
    "echo_512k": MiB // 2,
    "echo_1m": MiB,
    "echo_16m": 16 * MiB,
    "echo_128m": 128 * MiB,
    "echo_fresh_512k": MiB // 2,
    "echo_fresh_1m": MiB,
    "echo_fresh_16m": 16 * MiB,
    "echo_fresh_128m": 128 * MiB,
    "veth_echo_16m": 16 * MiB,
    "veth_echo_128m": 128 * MiB,
}
ECHO_WARMUP = 2
FRESH_KEPT = 4  # results an `echo_fresh_*` caller keeps alive
PEAK_MEM_PAYLOAD = 128 * MiB
PARAM_SERVER_BYTES = 4 * MiB
RUN_TIMEOUT_S = 90.0  # one process group for one workload; a hang becomes "n/a (timeout ...)"


# --- the framework under test -------------------------------------------------------

# Set in each worker process before any RPC arrives, so that functions run on the
# server (which must be module-level to be picklable) reach the same framework.
FW: Framework


class Framework:
    """The framework's modules, under the names both frameworks share.

    `autograd` and `DistributedOptimizer` are imported on first use: a framework
    without them still runs the other workloads, and torch.distributed.optim alone
    takes ~1.3 s to import here, which every process of every run would pay.
    """

    def __init__(self, name: str):
        if name not in ("torch", "rrpc"):
            raise ValueError(f"unknown framework {name!r}; expected 'torch' or 'rrpc'")
        self.name = name
        self.rpc = importlib.import_module("torch.distributed.rpc" if name == "torch" else "rrpc")

    @property
    def autograd(self) -> Any:
        return importlib.import_module(f"{self._package}.autograd")

    @property
    def DistributedOptimizer(self) -> type:
        return importlib.import_module(f"{self._package}.optim").DistributedOptimizer

    @property
    def _package(self) -> str:
        return "torch.distributed" if self.name == "torch" else "rrpc"


# --- functions the server runs -------------------------------------------------------


def noop() -> None:
    return None


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


def make_small_tensor() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32)


def param_rrefs(module_rref: Any) -> list:
    return [FW.rpc.RRef(p) for p in module_rref.local_value().parameters()]


_ps_lock = threading.Lock()
_ps_params: torch.Tensor | None = None


def ps_update(grad: torch.Tensor) -> torch.Tensor:
    """Add a trainer's gradient into the server's parameters; return a snapshot of them."""
    global _ps_params
    with _ps_lock:
        if _ps_params is None:
            _ps_params = torch.zeros_like(grad)
        _ps_params.add_(grad)
        # A copy, because the reply is serialized after the lock is released.
        return _ps_params.clone()


# --- workloads: each runs on the driver rank(s) and returns its metrics --------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def timed_calls(call: Callable[[], Any], n: int, warmup: int) -> list[float]:
    """Seconds taken by each of n sequential calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def noop_sync(fw: Framework, n: int) -> dict:
    times = timed_calls(lambda: fw.rpc.rpc_sync("server", noop), n, warmup=max(50, n // 10))
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def async_64(fw: Framework, n: int, window: int = 64) -> dict:
    """A sliding window: a new call is issued as soon as one of the 64 in flight completes."""
    slots = threading.Semaphore(window)
    errors: list[BaseException] = []

    def release(fut: Any) -> None:
        try:
            fut.wait()
        except BaseException as e:  # recorded and raised on the driver thread
            errors.append(e)
        slots.release()

    def run(calls: int) -> None:
        for _ in range(calls):
            slots.acquire()
            fw.rpc.rpc_async("server", noop).add_done_callback(release)
        for _ in range(window):  # wait for the last calls in flight
            slots.acquire()
        for _ in range(window):
            slots.release()
        if errors:
            raise errors[0]

    run(window * 4)
    start = time.perf_counter()
    run(n)
    return {"calls_per_s": n / (time.perf_counter() - start)}


def threads_64(fw: Framework, n: int, threads: int = 64) -> dict:
    per_thread = max(1, n // threads)
    start_together = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            fw.rpc.rpc_sync("server", noop)  # warm-up: each thread's first call
            start_together.wait()
            for _ in range(per_thread):
                fw.rpc.rpc_sync("server", noop)
        except BaseException as e:
            errors.append(e)
            start_together.abort()  # so that nobody waits for this thread at the start

    pool = [threading.Thread(target=caller) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        start_together.wait()
    except threading.BrokenBarrierError:
        pass  # a caller failed; its error is raised below
    start = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return {"calls_per_s": threads * per_thread / elapsed}


def echo_tensor(fw: Framework, n: int, nbytes: int) -> dict:
    t = torch.rand(nbytes // 4)
    times = timed_calls(lambda: fw.rpc.rpc_sync("server", echo, args=(t,)), n, ECHO_WARMUP)
    median = statistics.median(times)
    return {"ms": median * 1e3, "gb_per_s": 2 * nbytes / median / 1e9}


def echo_fresh(fw: Framework, n: int, nbytes: int) -> dict:
    """Like `echo_tensor`, but a new tensor every call, and the last results kept alive.

    What a training or inference loop does: the tensor it sends was just made
    (new pages, just written, never sent before) and it holds on to what came
    back for a while (here the last FRESH_KEPT results). `echo_tensor` sends
    one tensor again and again and drops each result: the kindest case for a
    transport that keeps buffers (e.g. a pool of pre-faulted shared-memory
    slots). Each tensor is made and written, and the oldest kept result
    dropped, outside the timed call.
    """
    kept: collections.deque[torch.Tensor] = collections.deque(maxlen=FRESH_KEPT)
    times = []
    for i in range(ECHO_WARMUP + n):
        t = torch.empty(nbytes // 4).fill_(i)
        start = time.perf_counter()
        result = fw.rpc.rpc_sync("server", echo, args=(t,))
        times.append(time.perf_counter() - start)
        kept.append(result)
        del t, result
    median = statistics.median(times[ECHO_WARMUP:])
    return {"ms": median * 1e3, "gb_per_s": 2 * nbytes / median / 1e9}


def floor_noop(bare: Floor, address: Any, n: int) -> dict:
    times = bare.round_trips(address, n, floor.NOOP_BYTES, max(50, n // 10))
    return {"p50_us": percentile(times, 50) * 1e6, "p99_us": percentile(times, 99) * 1e6}


def floor_echo(bare: Floor, address: Any, n: int, nbytes: int) -> dict:
    median = statistics.median(bare.round_trips(address, n, nbytes, ECHO_WARMUP))
    return {"ms": median * 1e3, "gb_per_s": 2 * nbytes / median / 1e9}


def remote_to_here(fw: Framework, n: int) -> dict:
    times = timed_calls(
        lambda: fw.rpc.remote("server", make_small_tensor).to_here(), n, warmup=max(20, n // 10)
    )
    return {"p50_us": percentile(times, 50) * 1e6}


def rref_tag(rref: Any) -> int:
    return len(rref.local_value())


def rref_arg(fw: Framework, n: int) -> dict:
    rref = fw.rpc.remote("server", make_small_tensor)
    times = timed_calls(
        lambda: fw.rpc.rpc_sync("server", rref_tag, args=(rref,)), n, warmup=max(20, n // 10)
    )
    return {"p50_us": percentile(times, 50) * 1e6}


def dist_autograd(fw: Framework, n: int) -> dict:
    module = fw.rpc.remote("server", torch.nn.Linear, args=(512, 512))
    params = fw.rpc.rpc_sync("server", param_rrefs, args=(module,))
    optimizer = fw.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(32, 512)

    def step() -> None:
        with fw.autograd.context() as context_id:
            loss = module.rpc_sync().forward(x).sum()
            fw.autograd.backward(context_id, [loss])
            optimizer.step(context_id)

    times = timed_calls(step, n, warmup=5)
    return {"steps_per_s": n / sum(times)}


def single_threaded() -> None:
    """One intra-op thread, as the RL example sets on every rank (its network is tiny)."""
    torch.set_num_threads(1)


def rl_steps(fw: Framework, n: int) -> dict:
    """examples/rl_agents: an agent and two observers playing CartPole, `n` episodes.

    The example's own `Agent` and `Observer` (its module's `rpc` set to the
    framework under test), driven as its `train` does, without the printing:
    each episode the agent tells each observer to play one (`rpc_async` on an
    RRef); the observer asks the agent for every action (`rpc_sync` on the
    agent's RRef: 4 floats in, an int back, nested inside the first call);
    then the agent makes its REINFORCE update. Seeds as in the example, so both
    frameworks play the very same episodes: the same number of steps, shown
    beside the rate. The first episode (connections, imports) is not timed.
    """
    import rl_agents.main as rl  # examples/rl_agents/main.py (EXAMPLES is on sys.path)

    rl.rpc = fw.rpc
    for rank in (1, 2):
        fw.rpc.rpc_sync(f"observer{rank}", single_threaded)
    single_threaded()
    torch.manual_seed(0)
    agent = rl.Agent(3, argparse.Namespace(seed=0, lr=1e-2, gamma=0.99))  # its defaults
    agent.finish_episode(agent.run_episode())
    steps = 0
    start = time.perf_counter()
    for _ in range(n):
        rewards = agent.run_episode()
        agent.finish_episode(rewards)
        steps += sum(len(r) for r in rewards.values())
    return {"steps_per_s": steps / (time.perf_counter() - start), "steps": steps}


def param_server(fw: Framework, n: int) -> dict:
    """Runs on each trainer; the two trainers' spans are merged by `combine_trainers`."""
    grad = torch.full((PARAM_SERVER_BYTES // 4,), 1e-3)
    for _ in range(3):
        fw.rpc.rpc_sync("server", ps_update, args=(grad,))
    start = time.monotonic()  # CLOCK_MONOTONIC: comparable between processes
    for _ in range(n):
        fw.rpc.rpc_sync("server", ps_update, args=(grad,))
    return {"updates": n, "start": start, "end": time.monotonic()}


# --- memory: RSS now, and the peak since a mark ---------------------------------------
#
# The peak is the kernel's high-water mark of this process's RSS (VmHWM), which
# `mark_rss` resets to the current RSS (writing 5 to /proc/self/clear_refs).
# Not getrusage's ru_maxrss: it cannot be reset, and in a spawned process it
# starts at the *parent's* peak (the fork's copy of the parent's address space
# is accounted when the child execs), so it says nothing below the driver's own
# RSS. Each process keeps the peak it had before the mark, for the whole-process rows.

_peak_before_mark = 0


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak RSS in bytes since it started, or since `mark_rss`."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def mark_rss() -> int:
    """Reset the peak to the current RSS, and return that RSS; runs on either side."""
    global _peak_before_mark
    _peak_before_mark = max(_peak_before_mark, peak_rss())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_now()


def whole_process_peak_rss() -> int:
    return max(_peak_before_mark, peak_rss())


def peak_mem(fw: Framework, n: int) -> dict:
    """Peak RSS of one 128 MiB round trip, minus the RSS right before it, on each side.

    The server's "before" is taken in the server, by a small call just before
    the big one: that is when the server has finished starting (its gRPC or
    TensorPipe threads and buffers exist) and waits, idle, for the payload. Taken
    earlier, e.g. in `worker_main` before `init_rpc`, it would count the
    framework's start-up as the transfer's cost. The client's "before" includes
    the payload it is about to send: that tensor is the caller's, not the
    transfer's. The ideal rise is then 1 × payload on each side (the client's
    received reply, the server's received argument); anything above is copies.
    The whole-process peaks (with ~250 MiB of Python and torch) come from
    `worker_main` at exit.
    """
    payload = torch.rand(PEAK_MEM_PAYLOAD // 4)
    server_before = fw.rpc.rpc_sync("server", mark_rss)
    client_before = mark_rss()
    fw.rpc.rpc_sync("server", echo, args=(payload,))
    client_peak = peak_rss()
    server_peak = fw.rpc.rpc_sync("server", peak_rss)
    return {
        "client_rise": client_peak - client_before,
        "server_rise": server_peak - server_before,
    }


def combine_trainers(per_rank: list[dict]) -> dict:
    trainers = [r["metrics"] for r in per_rank if r["metrics"]]
    span = max(t["end"] for t in trainers) - min(t["start"] for t in trainers)
    return {"updates_per_s": sum(t["updates"] for t in trainers) / span}


def combine_peak_rss(per_rank: list[dict]) -> dict:
    client, server = (r["peak_rss_bytes"] for r in per_rank)
    rise = per_rank[0]["metrics"]
    return {
        "client_x": client / PEAK_MEM_PAYLOAD,
        "server_x": server / PEAK_MEM_PAYLOAD,
        "client_mib": client / MiB,
        "server_mib": server / MiB,
        "client_rise_x": rise["client_rise"] / PEAK_MEM_PAYLOAD,
        "server_rise_x": rise["server_rise"] / PEAK_MEM_PAYLOAD,
        "client_rise_mib": rise["client_rise"] / MiB,
        "server_rise_mib": rise["server_rise"] / MiB,
    }


# --- the catalogue ---------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    metric: str  # key in the workload's metrics
    label: str
    unit: str
    higher_is_better: bool
    extra: str | None = None  # a second metric shown in the same cell, e.g. GB/s beside ms
    extra_unit: str = ""


def loopback_port(pair: netns.VethPair | None) -> tuple[str, int]:
    return "127.0.0.1", free_port()


def abstract_unix_name(pair: netns.VethPair | None) -> str:
    # Linux's abstract namespace (the leading NUL): nothing to remove afterwards.
    return f"\0rrpc-bench-floor-{os.getpid()}-{time.monotonic_ns()}"


def veth_port(pair: netns.VethPair | None) -> tuple[str, int]:
    assert pair is not None
    return pair.b.address, pair.b.free_port()


@dataclass(frozen=True)
class Floor:
    """A bare transport doing a workload's round trips: a column beside the frameworks."""

    name: str  # its key in the results, beside "torch" and "rrpc"
    serve: Callable[[Any, Any, Any], None]  # (address, ready, stop): the echo server's process
    round_trips: Callable[[Any, int, int, int], list[float]]  # (address, n, nbytes, warmup)
    address: Callable[[netns.VethPair | None], Any]  # where the server listens, for one run
    about: str  # its line under the table


GRPCIO_FLOOR = Floor(
    "grpcio floor",
    floor.serve,
    floor.round_trips,
    loopback_port,
    "the same round trip on a bare grpcio bidi stream (floor.py)",
)
UDS_FLOOR = Floor(
    "uds floor",
    stream_floor.serve,
    stream_floor.round_trips,
    abstract_unix_name,
    "on a bare Unix socket, the calling thread doing its own I/O (stream_floor.py):"
    " the floor under rrpc's same-host lane",
)
TCP_FLOOR = Floor(
    "tcp floor",
    stream_floor.serve,
    stream_floor.round_trips,
    veth_port,
    "on a bare TCP stream over the same veth link, sendall and recv_into (stream_floor.py)",
)
GRPCIO_VETH_FLOOR = Floor(
    "grpcio floor",
    floor.serve,
    floor.round_trips,
    veth_port,
    "the same round trip on a bare grpcio bidi stream (floor.py)",
)
ALL_FLOORS = (GRPCIO_FLOOR, UDS_FLOOR, TCP_FLOOR, GRPCIO_VETH_FLOOR)


@dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[..., dict]  # (fw, n) -> metrics, on each driver rank
    n: int  # calls/steps per run
    n_quick: int
    rows: tuple[Row, ...]
    roles: tuple[str, ...] = ("client", "server")  # worker names by rank; the last one is called
    drivers: tuple[int, ...] = (0,)
    combine: Callable[[list[dict]], dict] | None = None  # default: the first driver's metrics
    kwargs: dict = field(default_factory=dict)
    veth: bool = False  # client and server on two "hosts" (network namespaces), TCP only
    # The same work on each of `floors`: (floor, address, n, **kwargs) -> the same metrics.
    floor: Callable[..., dict] | None = None
    floors: tuple[Floor, ...] = ()


SIDES = ("client", "server")


def _echo(name: str, n: int, n_quick: int, veth: bool = False, fresh: bool = False) -> Workload:
    row = Row("ms", "round trip", "ms", higher_is_better=False, extra="gb_per_s", extra_unit="GB/s")
    kwargs = {"nbytes": ECHO_SIZES[name]}
    floors = {"echo_4k": (GRPCIO_FLOOR, UDS_FLOOR)}.get(name, (TCP_FLOOR,) if veth else ())
    return Workload(
        name,
        echo_fresh if fresh else echo_tensor,
        n,
        n_quick,
        (row,),
        kwargs=kwargs,
        veth=veth,
        floor=floor_echo if floors else None,
        floors=floors,
    )


def _noop(name: str, floors: tuple[Floor, ...], veth: bool = False) -> Workload:
    rows = (Row("p50_us", "rpc_sync p50", "µs", False), Row("p99_us", "rpc_sync p99", "µs", False))
    return Workload(name, noop_sync, 2000, 500, rows, veth=veth, floor=floor_noop, floors=floors)


WORKLOADS = [
    _noop("noop_sync", (GRPCIO_FLOOR, UDS_FLOOR)),
    Workload(
        "async_64", async_64, 4000, 1500, (Row("calls_per_s", "64 in flight", "calls/s", True),)
    ),
    Workload(
        "threads_64", threads_64, 2560, 1280, (Row("calls_per_s", "64 threads", "calls/s", True),)
    ),
    _echo("echo_4k", 500, 200),
    _echo("echo_512k", 200, 80),
    _echo("echo_1m", 100, 40),
    _echo("echo_16m", 20, 8),
    _echo("echo_128m", 4, 2),
    _echo("echo_fresh_512k", 200, 80, fresh=True),
    _echo("echo_fresh_1m", 100, 40, fresh=True),
    _echo("echo_fresh_16m", 20, 8, fresh=True),
    _echo("echo_fresh_128m", 4, 2, fresh=True),
    _noop("veth_noop_sync", (GRPCIO_VETH_FLOOR,), veth=True),
    _echo("veth_echo_16m", 20, 8, veth=True),
    _echo("veth_echo_128m", 4, 2, veth=True),
    Workload(
        "remote_to_here",
        remote_to_here,
        500,
        200,
        (Row("p50_us", "remote().to_here() p50", "µs", False),),
    ),
    Workload(
        "rref_arg",
        rref_arg,
        1000,
        300,
        (Row("p50_us", "rpc_sync(owner, f, (rref,)) p50", "µs", False),),
    ),
    Workload(
        "dist_autograd",
        dist_autograd,
        500,
        50,
        (Row("steps_per_s", "Linear(512,512) step", "steps/s", True),),
    ),
    Workload(
        "param_server",
        param_server,
        200,
        15,
        (Row("updates_per_s", "2 trainers, 4 MiB", "updates/s", True),),
        roles=("trainer0", "trainer1", "server"),
        drivers=(0, 1),
        combine=combine_trainers,
    ),
    Workload(
        "rl_steps",
        rl_steps,
        25,
        10,
        (Row("steps_per_s", "CartPole, 2 observers", "steps/s", True, "steps", "steps"),),
        roles=("agent", "observer1", "observer2"),
    ),
    Workload(
        "peak_mem_128m",
        peak_mem,
        1,
        1,
        (
            *(Row(f"{s}_x", f"peak RSS {s}", "× payload", False, f"{s}_mib", "MiB") for s in SIDES),
            *(
                Row(f"{s}_rise_x", f"peak − before {s}", "× payload", False, f"{s}_rise_mib", "MiB")
                for s in SIDES
            ),
        ),
        combine=combine_peak_rss,
    ),
]


# --- observability overhead (rrpc only: --overhead) -------------------------------------
#
# What rrpc's stats (always on) and its profiler hook (one check per call) cost a
# no-op rpc_sync. The first three variants run in blocks, in every order, within
# one pair of processes, so drift hits them alike; each is the median of its
# blocks' p50s. "stats off" replaces the bookkeeping by no-ops on both sides (a
# measurement switch, not an option); "inactive profiler" runs inside a
# torch.profiler.profile still in its schedule's wait phase. "profiler on"
# (inside a recording legacy profiler) runs after them: the garbage a profile
# leaves would slow whichever block came next.

_saved_metrics: dict[str, Any] = {}
_METRIC_HOOKS = ("answered", "undecodable", "ended", "late", "replied")


class _NoMetrics:
    """Stands for an agent's Metrics with the bookkeeping removed. Its row is a
    dummy, for the calls that straddle a switch (counted by the real hooks)."""

    def __init__(self) -> None:
        from rrpc.metrics import Row

        self._row = Row()

    def sent(self, *args: Any) -> Any:
        return self._row

    served = sent

    def late_row(self, name: str) -> Any:
        return self._row


def _no_hook(*args: Any, **kwargs: Any) -> None:
    return None


def set_stats(on: bool) -> None:
    """Turn this process's stats bookkeeping on or off (for --overhead only)."""
    from rrpc import agent as agent_module
    from rrpc import metrics

    agent = agent_module.current_agent()
    if not on and not _saved_metrics:
        _saved_metrics.update({name: getattr(metrics, name) for name in _METRIC_HOOKS})
        _saved_metrics["object"] = agent.metrics
        for name in _METRIC_HOOKS:
            setattr(metrics, name, _no_hook)
        agent.metrics = _NoMetrics()  # type: ignore[assignment]
    elif on and _saved_metrics:
        agent.metrics = _saved_metrics.pop("object")
        for name in _METRIC_HOOKS:
            setattr(metrics, name, _saved_metrics.pop(name))


OVERHEAD_VARIANTS = ("default", "stats off", "inactive profiler", "profiler on")


def overhead(fw: Framework, n: int, rounds: int = 6) -> dict:
    """p50 of a no-op rpc_sync per variant, and the bookkeeping's own cost per call."""
    from torch.autograd.profiler_legacy import profile as legacy_profile

    from rrpc import metrics, profiling
    from rrpc.messages import CALL

    def p50_of(variant: str, calls: int) -> float:
        on = variant != "stats off"
        set_stats(on)
        fw.rpc.rpc_sync("server", set_stats, args=(on,))
        if variant == "inactive profiler":
            schedule = torch.profiler.schedule(wait=1 << 30, warmup=0, active=1)
            context: Any = torch.profiler.profile(schedule=schedule)
        elif variant == "profiler on":
            context = legacy_profile()
        else:
            context = contextlib.nullcontext()
        with context:
            times = timed_calls(lambda: fw.rpc.rpc_sync("server", noop), calls, warmup=20)
        return percentile(times, 50) * 1e6

    block = max(100, n // rounds)
    p50s: dict[str, list[float]] = {variant: [] for variant in OVERHEAD_VARIANTS}
    # Every order of the three, so that none always follows the same other, and
    # each first as often early as late; after a block that warms both
    # processes up (the first seconds of a process are slower).
    a, b, c = OVERHEAD_VARIANTS[:-1]
    orders = [(a, b, c), (b, c, a), (c, a, b), (c, b, a), (b, a, c), (a, c, b)]
    p50_of(a, block)
    for round_ in range(rounds):
        for variant in orders[round_ % len(orders)]:
            gc.collect()
            p50s[variant].append(p50_of(variant, block))
    for _ in range(rounds):
        p50s["profiler on"].append(p50_of("profiler on", block // 4))
    result = {variant: statistics.median(values) for variant, values in p50s.items()}
    # The same bookkeeping, alone in this process: the caller's and the callee's share.
    table, payload, loops = metrics.Metrics(), (noop, (), {}), 100_000
    start = time.perf_counter()
    for _ in range(loops):
        metrics.answered(table.sent("server", CALL, payload, 300, 0), 200, 0, 2e-4, False)
        metrics.replied(table.served("client", CALL, payload, 300, 0), 200, 0, False)
    result["bookkeeping_us"] = (time.perf_counter() - start) / loops * 1e6
    check = profiling.profiler_enabled
    start = time.perf_counter()
    for _ in range(loops):
        check()
    result["check_ns"] = (time.perf_counter() - start) / loops * 1e9
    return result


OVERHEAD = Workload("overhead", overhead, 16000, 4000, ())


def run_overhead(quick: bool, repeats: int) -> dict:
    """--overhead: run it `repeats` times in fresh processes and print the ratios."""
    n = OVERHEAD.n_quick if quick else OVERHEAD.n
    runs = []
    for repeat in range(repeats):
        result = run_once("rrpc", OVERHEAD, n)
        if "error" in result:
            print(f"overhead: n/a ({result['error']})")
            return result
        runs.append(result)
        print(f"  overhead #{repeat + 1}: {_summary(result)}", file=sys.stderr, flush=True)
    result = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    default = result["default"]
    print(
        f"\nobservability cost on a no-op rpc_sync (rrpc; median of {repeats} run(s), each the "
        f"median of 6 blocks of {n // 6} calls, the first three in every order)"
    )
    print(f"  {'variant':<20} {'p50 µs':>9} {'÷ default':>10}")
    for variant in OVERHEAD_VARIANTS:
        print(f"  {variant:<20} {result[variant]:>9.1f} {result[variant] / default:>10.3f}")
    stats_share = (default - result["stats off"]) / result["stats off"]
    print(
        f"  stats, end to end: {100 * stats_share:+.1f} % of a call (stats off -> default); "
        f"their bookkeeping alone: {result['bookkeeping_us']:.2f} µs per call, both sides "
        f"= {100 * result['bookkeeping_us'] / default:.1f} % of the default p50"
    )
    print(
        f"  profiler, not recording: {100 * (result['inactive profiler'] / default - 1):+.1f} % "
        f"end to end; the per-call check alone: {result['check_ns']:.0f} ns"
    )
    return result


# --- processes -----------------------------------------------------------------------


def worker_main(
    framework: str,
    workload: Workload,
    n: int,
    rank: int,
    port: int,
    results: Any,
    host: netns.Host | None = None,
    master_addr: str = "127.0.0.1",
    others_reported: Any = None,
) -> None:
    """One process of one run: join the group, drive the workload if this rank drives, report.

    With `host`, this process is that "host": it moves into its network namespace
    before anything opens a socket (importing torch, done by now, opens none),
    and both frameworks are held to TCP on its veth address. Rank 0 hosts the
    rendezvous store: it exits only once every other rank has reported
    (`others_reported`), after its own shutdown. TensorPipe's shutdown ends on
    the store, and a store gone first failed 1 in ~6 of torch's 3-process
    runs with "Connection reset by peer" (rrpc's shutdown does not use it).
    """
    global FW
    report: dict = {"rank": rank, "metrics": None, "error": None}
    options = None
    if host is not None:
        try:
            if netns.open_sockets():
                raise RuntimeError("a socket was opened before entering the namespace")
            netns.enter(host.netns)
            options = _tcp_only(framework, host)
        except Exception as e:
            report["error"] = _short_error(e)
            _exit_with(report, results)
    # torch's own deprecation notices, printed by every run otherwise.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    try:
        FW = Framework(framework)
        FW.rpc.init_rpc(
            workload.roles[rank],
            rank=rank,
            world_size=len(workload.roles),
            rpc_backend_options=options,
        )
        try:
            if rank in workload.drivers:
                report["metrics"] = workload.run(FW, n, **workload.kwargs)
        except Exception as e:
            report["error"] = _short_error(e)
            traceback.print_exc(file=sys.stderr)
        finally:
            FW.rpc.shutdown()
    except Exception as e:
        report["error"] = report["error"] or _short_error(e)
    report["peak_rss_bytes"] = whole_process_peak_rss()
    _exit_with(report, results, others_reported if rank == 0 else None)


def _exit_with(report: dict, results: Any, wait_for: Any = None) -> None:
    results.put(report)
    if wait_for is not None:
        wait_for.wait(RUN_TIMEOUT_S)
    # Skip the interpreter's teardown (torch's and gRPC's finalizers): it is not what
    # is measured, and it added seconds to every run. The report is flushed first.
    results.close()
    results.join_thread()
    os._exit(0)


# TensorPipe's CPU channels in this torch build, by its own priority (cma 1200,
# mpt_uv 1100, basic 1000 in torch/csrc/distributed/rpc/tensorpipe_agent.h; the
# names are the keys of TensorPipeChannelRegistry, visible in libtorch_cpu.so).
# A list given as `_channels` is in priority order, first the highest.
TENSORPIPE_DEFAULT_CHANNELS = ("cma", "mpt_uv", "basic")


def _tcp_only(framework: str, host: netns.Host) -> Any:
    """Hold `framework` to TCP on `host`'s veth address; its backend options.

    rrpc: no shared memory and no same-host lane (/dev/shm is shared across
    network namespaces, and with shared memory on the veth carried ~4 KiB for
    five 16 MiB round trips); listen on and advertise the veth address.
    torch: TensorPipe with its default transports and channels, less `cma`,
    which copies tensors with process_vm_readv, and that works across network
    namespaces: with `_transports=["uv"]` alone the veth carried ~16 KiB for
    five 16 MiB round trips. What remains is what it would use between two
    machines: `mpt_uv` (a tensor split over several TCP connections, each
    driven by its own libuv thread) and `basic`, over the `uv` transport (its
    `shm` transport requires the same network namespace, so it steps aside by
    itself). TP_SOCKET_IFNAME makes TensorPipe listen on and advertise the
    veth address, GLOO_SOCKET_IFNAME does the same for the Gloo group torch's
    init_rpc builds for its barriers. Without either, init fails: both
    advertise the address of the hostname, 127.0.0.1 here, which inside a
    namespace is that namespace's own loopback.
    `run_once` checks the link's byte counters on every run: at least the
    payloads timed must have crossed it, each way.
    """
    if framework == "rrpc":
        os.environ.update(RRPC_SHM="0", RRPC_LANE="0", RRPC_ADVERTISE_HOST=host.address)
        return None
    os.environ.update(TP_SOCKET_IFNAME=host.ifname, GLOO_SOCKET_IFNAME=host.ifname)
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    channels = [c for c in TENSORPIPE_DEFAULT_CHANNELS if c != "cma"]
    return TensorPipeRpcBackendOptions(_channels=channels)


def _short_error(e: BaseException) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first_line}"
    return text if len(text) <= 70 else text[:69] + "…"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def floor_serve_main(
    bare: Floor, address: Any, ready: Any, stop: Any, host: netns.Host | None
) -> None:
    """The floor's echo server process, on `host` if given."""
    if host is not None:
        netns.enter(host.netns)
    bare.serve(address, ready, stop)


def floor_main(
    workload: Workload,
    bare: Floor,
    n: int,
    address: Any,
    results: Any,
    host: netns.Host | None,
) -> None:
    """The floor's client process: the workload's floor against the echo server at `address`."""
    report: dict = {"rank": 0, "metrics": None, "error": None}
    try:
        if host is not None:
            netns.enter(host.netns)
        report["metrics"] = workload.floor(bare, address, n, **workload.kwargs)  # type: ignore[misc]
    except Exception as e:
        report["error"] = _short_error(e)
        traceback.print_exc(file=sys.stderr)
    _exit_with(report, results)


def run_floor(workload: Workload, bare: Floor, n: int, pair: netns.VethPair | None) -> dict:
    """The workload's floor `bare` in two fresh processes (echo server, client); its metrics.

    For a `veth` workload, the client runs on host A of `pair` and the server on
    host B, as the frameworks' do, and the link's counters are checked alike.
    """
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ready, stop = spawn.Event(), spawn.Event()
    address = bare.address(pair)
    hosts = (pair.a, pair.b) if workload.veth and pair is not None else (None, None)
    server = spawn.Process(
        target=floor_serve_main, args=(bare, address, ready, stop, hosts[1]), daemon=True
    )
    client = spawn.Process(
        target=floor_main, args=(workload, bare, n, address, results, hosts[0]), daemon=True
    )
    link_before = pair.link_bytes() if workload.veth and pair is not None else None
    try:
        server.start()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ready.wait(0.5):
            if not server.is_alive() or time.monotonic() > deadline:
                return {"error": f"the {bare.name}'s echo server did not start"}
        client.start()
        reports = collect_reports([client], results)
    finally:
        stop.set()
        for p in (client, server):
            if p.pid is None:
                continue  # never started
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if isinstance(reports, str):
        return {"error": reports}
    if reports[0]["error"]:
        return {"error": reports[0]["error"]}
    if link_before is not None:
        assert pair is not None
        nbytes = workload.kwargs.get("nbytes", floor.NOOP_BYTES)
        return check_link(reports[0]["metrics"], pair, link_before, nbytes, n)
    return reports[0]["metrics"]


def run_once(
    framework: str, workload: Workload, n: int, pair: netns.VethPair | None = None
) -> dict:
    """Run one workload on one framework in fresh processes; its metrics, or {"error": ...}.

    A `veth` workload runs its client (rank 0, which also hosts the rendezvous
    store) on host A of `pair` and its server on host B.
    """
    for bare in workload.floors:
        if framework == bare.name:
            return run_floor(workload, bare, n, pair)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    others_reported = spawn.Event()  # rank 0 (the store's host) waits for it to exit
    hosts: list[netns.Host | None] = [None] * len(workload.roles)
    master_addr = "127.0.0.1"
    if workload.veth:
        assert pair is not None and len(workload.roles) == 2
        hosts = [pair.a, pair.b]
        master_addr = pair.a.address
        port = pair.a.free_port()
        link_before = pair.link_bytes()
    else:
        port = free_port()
    procs = [
        spawn.Process(
            target=worker_main,
            args=(
                framework,
                workload,
                n,
                rank,
                port,
                results,
                hosts[rank],
                master_addr,
                others_reported,
            ),
            daemon=True,
        )
        for rank in range(len(workload.roles))
    ]
    try:
        for p in procs:
            p.start()
        per_rank = collect_reports(procs, results, others_reported)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if isinstance(per_rank, str):
        return {"error": per_rank}
    errors = [r["error"] for r in per_rank if r["error"]]
    if errors:
        return {"error": errors[0]}
    if workload.combine:
        return workload.combine(per_rank)
    metrics = per_rank[workload.drivers[0]]["metrics"]
    if workload.veth:
        assert pair is not None
        nbytes = workload.kwargs.get("nbytes", floor.NOOP_BYTES)
        return check_link(metrics, pair, link_before, nbytes, n)
    return metrics


def check_link(
    metrics: dict, pair: netns.VethPair, before: tuple[int, int], nbytes: int, n: int
) -> dict:
    """The metrics, with the veth's bytes per call; or an error if the payloads did not
    cross the link (a transport that found another way, e.g. shared memory)."""
    rx, tx = (after - was for after, was in zip(pair.link_bytes(), before, strict=True))
    calls = n + ECHO_WARMUP
    if min(rx, tx) < nbytes * calls:
        return {
            "error": f"only {rx / MiB:.1f}/{tx / MiB:.1f} MiB crossed the veth"
            f" for {calls} × {nbytes / MiB:.0f} MiB each way"
        }
    return {**metrics, "link_bytes_per_call": (rx + tx) / calls}


def collect_reports(procs: list, results: Any, others_reported: Any = None) -> list[dict] | str:
    """Every rank's report, by rank; or why not: a rank that died, or the time
    limit. Sets `others_reported` once every rank but 0 has reported."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    reports: list[dict] = []
    while len(reports) < len(procs):
        try:
            reports.append(results.get(timeout=0.5))
            if (
                others_reported is not None
                and sum(r["rank"] != 0 for r in reports) == len(procs) - 1
            ):
                others_reported.set()
            continue
        except queue.Empty:
            pass
        reported = {r["rank"] for r in reports}
        for rank, p in enumerate(procs):
            # A rank that reported exits 0 right after; any other exit is a crash.
            if rank not in reported and p.exitcode not in (None, 0):
                return f"rank {rank} died with exit code {p.exitcode}"
        if time.monotonic() > deadline:
            return f"timeout after {RUN_TIMEOUT_S:.0f} s"
    return sorted(reports, key=lambda r: r["rank"])


def benchmark(
    workload: Workload,
    frameworks: list[str],
    repeats: int,
    quick: bool,
    broken: dict,
    hosts: netns.VethPair | str | None = None,
) -> dict:
    """Median of each metric over `repeats` interleaved runs, per framework (or an error).

    A framework whose run fails is not run again for this workload: the error is
    its result, and repeating a failure (or a timeout) only costs time. `hosts`
    is the veth pair for `veth` workloads, or why there is none.
    """
    if workload.veth and not isinstance(hosts, netns.VethPair):
        reason = hosts or "no veth pair"
        print(f"  {workload.name:<15} n/a ({reason})", file=sys.stderr, flush=True)
        return {fw: {"unavailable": reason} for fw in frameworks}
    pair = hosts if isinstance(hosts, netns.VethPair) else None
    n = workload.n_quick if quick else workload.n
    if frameworks:
        # The floors are measured in the same interleaved repeats.
        frameworks = [*frameworks, *(bare.name for bare in workload.floors)]
    runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
    failed = dict(broken)
    for repeat in range(repeats):
        order = frameworks if repeat % 2 == 0 else frameworks[::-1]
        for fw in order:
            if fw in failed:
                continue
            started = time.monotonic()
            result = run_once(fw, workload, n, pair)
            if "error" in result:
                failed[fw] = result["error"]
            else:
                runs[fw].append(result)
            print(
                f"  {workload.name:<15} {fw:<6} #{repeat + 1}"
                f" ({time.monotonic() - started:.1f} s): {_summary(result)}",
                file=sys.stderr,
                flush=True,
            )
    medians: dict[str, dict] = {}
    for fw, results in runs.items():
        if fw in failed:
            medians[fw] = {"error": failed[fw]}
        else:
            medians[fw] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    return medians


def _summary(result: dict) -> str:
    if "error" in result:
        return "n/a (" + result["error"] + ")"
    return ", ".join(f"{k}={v:.4g}" for k, v in result.items())


# --- report --------------------------------------------------------------------------


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


# Same-host echoes whose round-trip bandwidth is set against memcpy's.
MEMCPY_ROWS = ("echo_16m", "echo_128m", "echo_fresh_16m", "echo_fresh_128m")


@functools.cache
def memcpy_gb_per_s(nbytes: int) -> float:
    """One thread's memcpy here: bytes copied per second between two buffers
    of ``nbytes`` already touched (median of several copies)."""
    source = np.full(nbytes, 7, dtype=np.uint8)
    target = np.ones_like(source)
    times = []
    for _ in range(max(5, (1 << 30) // nbytes)):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def print_memcpy_shares(results: dict[str, dict], memcpy: dict[str, float]) -> None:
    """The echoes' round-trip bandwidth (2 × bytes ÷ round trip) as a share of memcpy's."""
    parts = []
    for name, bandwidth in memcpy.items():
        shares = [
            f"{fw} {100 * result['gb_per_s'] / bandwidth:.0f} %"
            for fw, result in results.get(name, {}).items()
            if "gb_per_s" in result
        ]
        parts.append(f"{name} ({_number(bandwidth)} GB/s): {', '.join(shares) or 'n/a'}")
    print("round trip as a share of one thread's memcpy of that size, this run:", "; ".join(parts))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def format_cell(result: dict, row: Row) -> str:
    if "unavailable" in result:
        return f"n/a ({result['unavailable']})"
    if "error" in result:
        return f"n/a (error: {result['error']})"
    text = f"{_number(result[row.metric])} {row.unit}"
    if row.extra:
        text += f" ({_number(result[row.extra])} {row.extra_unit})"
    return text


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.1:
        return f"{value:.2f}"
    return f"{value:.2g}"


def speedup(torch_result: dict, rrpc_result: dict, row: Row) -> float | None:
    if any(k in r for k in ("error", "unavailable") for r in (torch_result, rrpc_result)):
        return None
    ratio = rrpc_result[row.metric] / torch_result[row.metric]
    return ratio if row.higher_is_better else 1 / ratio


def print_table(results: dict[str, dict], frameworks: list[str]) -> None:
    """One line per row of each workload run; a row with several floors gets one
    more line per floor after the first, its framework cells left blank."""
    header = ["workload", "metric", *frameworks]
    both = frameworks == ["torch", "rrpc"] or frameworks == ["rrpc", "torch"]
    if both:
        header = ["workload", "metric", "torch", "rrpc", "speedup (>1 = rrpc better)"]
    floors_shown = [
        bare
        for bare in ALL_FLOORS
        if any(bare.name in results.get(w.name, {}) for w in WORKLOADS if bare in w.floors)
    ]
    if floors_shown:
        header += ["floor", "rrpc ÷ floor", "torch ÷ floor"]
    lines = []
    for workload in WORKLOADS:
        if workload.name not in results:
            continue
        by_fw = results[workload.name]
        for row in workload.rows:
            cells = [workload.name, row.label]
            if both:
                ratio = speedup(by_fw["torch"], by_fw["rrpc"], row)
                cells += [format_cell(by_fw["torch"], row), format_cell(by_fw["rrpc"], row)]
                cells.append("" if ratio is None else f"{ratio:.2f}×")
            else:
                cells += [format_cell(by_fw[fw], row) for fw in frameworks]
            measured = [bare for bare in workload.floors if bare.name in by_fw]
            for i, bare in enumerate(measured):
                if i > 0:
                    lines.append(cells)
                    cells = [""] * (len(header) - 3)
                kind = bare.name.removesuffix(" floor")
                cells.append(f"{kind}: {format_cell(by_fw[bare.name], row)}")
                for fw in ("rrpc", "torch"):
                    ratio = speedup(by_fw[bare.name], by_fw[fw], row) if fw in by_fw else None
                    cells.append("" if ratio is None else f"{1 / ratio:.2f}×")
            if floors_shown and not measured:
                cells += ["", "", ""]
            lines.append(cells)
    widths = [max(len(str(cells[i])) for cells in [header, *lines]) for i in range(len(header))]
    for i, cells in enumerate([header, *lines]):
        print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for about in dict.fromkeys(f"{bare.name}: {bare.about}" for bare in floors_shown):
        print(about)
    if floors_shown:
        print("÷ floor: time over the floor's time (1.00× = nothing above that bare transport)")


# --- main ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [w.name for w in WORKLOADS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default="torch,rrpc", help="comma-separated: torch, rrpc")
    parser.add_argument("--only", help="comma-separated workloads: " + ", ".join(names))
    parser.add_argument("--quick", action="store_true", help="1 repeat and fewer calls per run")
    parser.add_argument(
        "--repeats", type=int, help="runs per framework and workload (default 3, --quick 1)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="rrpc only: what its stats and profiler hook cost a no-op rpc_sync, as ratios",
    )
    args = parser.parse_args(argv)
    args.frameworks = args.frameworks.split(",")
    for fw in args.frameworks:
        if fw not in ("torch", "rrpc"):
            parser.error(f"unknown framework {fw!r}; choose from torch, rrpc")
    args.only = args.only.split(",") if args.only else names
    for name in args.only:
        if name not in names:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(names)}")
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def unavailable_frameworks(frameworks: list[str]) -> dict[str, str]:
    """Frameworks that cannot even be imported here, so their runs are skipped, not spawned."""
    broken = {}
    for fw in frameworks:
        try:
            Framework(fw)
        except Exception as e:
            broken[fw] = _short_error(e)
    return broken


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Inherited by the workers: torch's C++ warnings (c10d store retries and poll
    # timeouts while peers start or stop) would bury the progress lines.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    broken = unavailable_frameworks(args.frameworks)
    machine = machine_description()
    print(f"rrpc benchmark — {machine}")
    print(f"load average before: {_load()} (above {os.cpu_count()} means other work competes)")
    print(
        f"median of {args.repeats} interleaved run(s) per cell, each in fresh processes"
        f"{' (--quick)' if args.quick else ''}; speedup > 1 means rrpc is better"
    )
    for fw, error in broken.items():
        print(f"note: {fw} is not importable ({error}); its cells read n/a")
    if args.overhead:
        run_overhead(args.quick, args.repeats)
        return
    started = time.monotonic()
    results = {}
    selected = [w for w in WORKLOADS if w.name in args.only]
    # SIGTERM as an exception, so that the veth pair is removed on it too.
    memcpy = {
        w.name: memcpy_gb_per_s(ECHO_SIZES[w.name]) for w in selected if w.name in MEMCPY_ROWS
    }
    with netns.terminate_as_exit(), contextlib.ExitStack() as cleanup:
        hosts: netns.VethPair | str | None = None
        if any(w.veth for w in selected):
            try:
                hosts = cleanup.enter_context(netns.VethPair.create())
            except (RuntimeError, OSError) as e:
                hosts = str(e)
        for workload in selected:
            results[workload.name] = benchmark(
                workload, args.frameworks, args.repeats, args.quick, broken, hosts
            )
    print()
    print_table(results, args.frameworks)
    if memcpy:
        print()
        print_memcpy_shares(results, memcpy)
    print(f"\n{time.monotonic() - started:.0f} s; load average after: {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "repeats": args.repeats,
                    "quick": args.quick,
                    "memcpy_gb_per_s": memcpy,
                    "results": results,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
