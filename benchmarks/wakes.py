"""Thread wake-ups per call: which threads of the caller and the callee a workload wakes.

Run from the repository root: ``python benchmarks/wakes.py [workload] [seconds]``
(workloads: ``sync``, ``remote_to_here``, ``async_64``, ``threads_64``,
``autograd``: a distributed-autograd step as bench.py's, counted per step;
``--framework torch`` runs the same on ``torch.distributed.rpc``).

A thread hand-off costs tens of microseconds on a small VM, and on two vCPUs
a thread that wakes takes the CPU, or the GIL, from one that was working.
This counts them: each thread's voluntary context switches (a wait on a
lock, a condition, the GIL, a socket; ``/proc/<pid>/task/<tid>/status``)
over a few seconds of the workload, divided by the calls made, in both
processes. A sequential ``rpc_sync`` on rrpc's lane costs one per call on
each side (the caller waits for its reply, the callee for the next request);
anything more is a hand-off to look at. Threads are named as Python names
them (``rrpc-lane-recv-…``), else as the kernel does (torch's C++ threads).
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

WORKLOADS = ("sync", "remote_to_here", "async_64", "threads_64", "autograd")


def noop() -> None:
    return None


def thread_names() -> dict[int, str]:
    """This process's threads by kernel id: Python's names, else the kernel's."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names[int(tid)] = comm.read().strip()
    names.update({thread.native_id: thread.name for thread in threading.enumerate()})
    return names


def switches(pid: int) -> dict[int, int]:
    """Voluntary context switches so far, by thread of process ``pid``."""
    counts = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                text = status.read()
        except OSError:  # ended meanwhile
            continue
        counts[int(tid)] = int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return counts


def param_rrefs(module_rref):
    return [type(module_rref)(p) for p in module_rref.local_value().parameters()]


def autograd_step(rpc) -> Callable[[], None]:
    """bench.py's ``dist_autograd`` step: forward on a remote Linear, backward, optimizer step."""
    package = rpc.__name__.removesuffix(".rpc")
    dist_autograd = importlib.import_module(f"{package}.autograd")
    optim = importlib.import_module(f"{package}.optim")
    module = rpc.remote("server", torch.nn.Linear, args=(512, 512))
    params = rpc.rpc_sync("server", param_rrefs, args=(module,))
    optimizer = optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(32, 512)

    def step() -> None:
        with dist_autograd.context() as context_id:
            loss = module.rpc_sync().forward(x).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)

    return step


def workload(rpc, name: str) -> tuple[Callable[[], None], int]:
    """One round of ``name`` on ``rpc``, and the calls (steps) it makes."""
    if name == "autograd":
        return autograd_step(rpc), 1
    if name == "sync":
        return (lambda: rpc.rpc_sync("server", noop)), 1
    if name == "remote_to_here":
        return (lambda: rpc.remote("server", noop).to_here()), 1
    if name == "async_64":
        slots = threading.Semaphore(64)

        def window() -> None:  # 64 in flight, a new call as each completes
            for _ in range(64):
                slots.acquire()
                rpc.rpc_async("server", noop).add_done_callback(lambda _: slots.release())

        return window, 64
    callers = 64

    def threads() -> None:  # 64 threads, 8 sequential calls each
        pool = [
            threading.Thread(target=lambda: [rpc.rpc_sync("server", noop) for _ in range(8)])
            for _ in range(callers)
        ]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()

    return threads, callers * 8


def run(rank: int, port: int, framework: str, name: str, seconds: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc = importlib.import_module("rrpc" if framework == "rrpc" else "torch.distributed.rpc")
    rpc.init_rpc("client" if rank == 0 else "server", rank=rank, world_size=2)
    if rank == 0:
        one_round, calls_per_round = workload(rpc, name)
        for _ in range(max(2, 300 // calls_per_round)):  # warm-up: lanes, pools, caches
            one_round()
        server = rpc.rpc_sync("server", os.getpid)
        pids = {"caller": os.getpid(), "callee": server}
        before = {side: switches(pid) for side, pid in pids.items()}
        start, rounds = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            one_round()
            rounds += 1
        after = {side: switches(pid) for side, pid in pids.items()}
        names = {"caller": thread_names(), "callee": rpc.rpc_sync("server", thread_names)}
        calls = rounds * calls_per_round
        print(f"{framework} {name}: {calls / seconds:,.0f} calls/s")
        for side in pids:
            print(f"  {side}")
            for tid, count in sorted(after[side].items()):
                woke = (count - before[side].get(tid, 0)) / calls
                if woke >= 0.02:  # threads started meanwhile count from 0
                    print(f"    {names[side].get(tid, tid)!s:34} {woke:6.2f} per call")
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="sync", choices=WORKLOADS)
    parser.add_argument("seconds", nargs="?", type=float, default=3.0)
    parser.add_argument("--framework", default="rrpc", choices=("rrpc", "torch"))
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(run, args=(port, args.framework, args.workload, args.seconds), nprocs=2)


if __name__ == "__main__":
    main()
