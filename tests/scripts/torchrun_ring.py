"""Run under torchrun: every worker calls the next one and prints what came back.

    python -m torch.distributed.run --nproc-per-node 3 tests/scripts/torchrun_ring.py

Nothing here names a rank, a world size or an address: init_rpc takes them
from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Each worker prints one line:

    RING rank=<r> world=<n> next=<name> sum=<value> caller=<name>
"""

import os

import torch

import rrpc


def describe(x):
    return x.sum().item(), rrpc.get_worker_info().name


def main():
    rank = int(os.environ["RANK"])
    rrpc.init_rpc(f"worker{rank}")
    world_size = int(os.environ["WORLD_SIZE"])
    target = f"worker{(rank + 1) % world_size}"
    total, name = rrpc.rpc_sync(target, describe, args=(torch.arange(10.0) * rank,))
    here = rrpc.rpc_async(rrpc.get_worker_info(), torch.add, args=(rank, 100)).wait()
    rrpc.shutdown()
    print(f"RING rank={rank} world={world_size} next={name} sum={total:g} self={here}", flush=True)


if __name__ == "__main__":
    main()
