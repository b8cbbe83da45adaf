"""Count the requests torch's own RPC sends for the steps tests/test_message_counts.py measures.

    python torch_message_counts.py STEPS

Prints one JSON line: {"remote_to_here": [sent, served], "autograd_step": [sent, served]}.

torch keeps no message counters (its agent's metrics are gauges), and its
protocol messages (RRef fetch and delete, autograd's) are sent from C++, out
of Python's reach. TensorPipe logs every message it is asked to write when
``TP_VERBOSE_LOGGING`` is set, naming the pipe: worker0's requests to worker1
are the writes on pipe ``worker0_to_worker1``, and worker1's requests to
worker0 arrive on worker0's pipe ``worker0[...]_from_worker1`` (replies travel
the other way on each). So worker0's own log, between two markers it prints,
counts both, as rrpc's ``stats()`` does on worker0.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import sys
import tempfile

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch.distributed.optim import DistributedOptimizer

WARM_UP = 3
SENT = re.compile(r"Pipe worker0_to_worker1 received a write request")
SERVED = re.compile(r"Pipe worker0\[[^\]]*\]_from_worker1 is calling a readDescriptor callback")


def _make_tensor():
    return torch.ones(4)


def _owner_rrefs():
    return int(rpc._rref_context_get_debug_info()["num_owner_rrefs"])


def _autograd_contexts():
    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _parameter_rrefs(module_rref):
    return [rpc.RRef(param) for param in module_rref.local_value().parameters()]


def _mark(label: str) -> None:
    sys.stderr.write(f"=== {label}\n")
    sys.stderr.flush()


def _settle(query, target) -> int:
    """Wait until worker1's ``query()`` gives ``target`` (the RRefs deleted,
    the contexts released); return how many requests that took."""
    polls = 1
    while rpc.rpc_sync("worker1", query) != target:
        polls += 1
    return polls


def _remote_to_here(steps: int) -> int:
    for _ in range(WARM_UP):
        rpc.remote("worker1", _make_tensor).to_here()
    gc.collect()
    _settle(_owner_rrefs, 0)
    _mark("START remote_to_here")
    for _ in range(steps):
        assert torch.equal(rpc.remote("worker1", _make_tensor).to_here(), torch.ones(4))
    gc.collect()
    polls = _settle(_owner_rrefs, 0)
    _mark("END remote_to_here")
    return polls


def _autograd_step(steps: int) -> int:
    torch.manual_seed(0)
    module = rpc.remote("worker1", torch.nn.Linear, args=(8, 8))
    params = rpc.rpc_sync("worker1", _parameter_rrefs, args=(module,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.randn(4, 8)

    def step():
        with dist_autograd.context() as context_id:
            loss = module.rpc_sync().forward(x).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)

    for _ in range(WARM_UP):
        step()
    _settle(_autograd_contexts, 0)
    _mark("START autograd_step")
    for _ in range(steps):
        step()
    polls = _settle(_autograd_contexts, 0)
    _mark("END autograd_step")
    return polls


def _worker(rank: int, port: int, steps: int, log_dir: str, results) -> None:
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 2)  # TensorPipe's log lines go to file descriptor 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    if rank == 0:
        results.put(
            {"remote_to_here": _remote_to_here(steps), "autograd_step": _autograd_step(steps)}
        )
    rpc.shutdown()


def _count(log: str, step: str, polls: int) -> list[int]:
    window = log.split(f"=== START {step}\n", 1)[1].split(f"=== END {step}\n", 1)[0]
    sent = len(SENT.findall(window)) - polls  # the polls that waited for worker1 to settle
    return [sent, len(SERVED.findall(window))]


def main() -> None:
    steps = int(sys.argv[1])
    os.environ["TP_VERBOSE_LOGGING"] = "1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as log_dir:
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        mp.start_processes(
            _worker, args=(port, steps, log_dir, results), nprocs=2, start_method="spawn"
        )
        polls = results.get()
        with open(os.path.join(log_dir, "rank0.log"), errors="replace") as f:
            log = f.read()
    counts = {step: _count(log, step, polls[step]) for step in polls}
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
