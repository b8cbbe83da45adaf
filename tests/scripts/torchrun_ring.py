"""Run under torchrun: every worker calls the next one and prints what came back.

    python -m torch.distributed.run --nproc-per-node 3 tests/scripts/torchrun_ring.py

Nothing here names a rank, a world size or an address: init_rpc takes them
from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Each worker prints one line:

    RING rank=<r> world=<n> next=<name> sum=<value> self=<value> calls=<[1, 2]>
"""

import os
import sys
import threading

import torch

import rrpc

# State of this script's own module, as in PyTorch's parameter-server tutorial:
# a call must see the callee's, which only a function sent by name does (a
# copy sent by value could not even be pickled, with its lock).
_lock = threading.Lock()
_calls = 0


def count_call():
    global _calls
    with _lock:
        _calls += 1
        return _calls


def describe(x):
    return x.sum().item(), rrpc.get_worker_info().name


def main():
    rank = int(os.environ["RANK"])
    rrpc.init_rpc(f"worker{rank}")
    world_size = int(os.environ["WORLD_SIZE"])
    target = f"worker{(rank + 1) % world_size}"
    total, name = rrpc.rpc_sync(target, describe, args=(torch.arange(10.0) * rank,))
    here = rrpc.rpc_async(rrpc.get_worker_info(), torch.add, args=(rank, 100)).wait()
    calls = [rrpc.rpc_sync(target, count_call) for _ in range(2)]
    rrpc.shutdown()
    # One write with its newline (print writes the newline apart): the ranks
    # share torchrun's pipe, and a line under PIPE_BUF goes into it whole.
    sys.stdout.write(
        f"RING rank={rank} world={world_size} next={name} sum={total:g} self={here} calls={calls}\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
