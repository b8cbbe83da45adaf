"""rrpc in one screen: three workers call each other and move tensors.

    python examples/quickstart.py            # spawns 3 local workers
    torchrun --nproc-per-node 3 examples/quickstart.py

Worker 0 calls the others with a builtin, a lambda and a user function, holds
an object on worker 1 through an RRef, and sends a 64 MiB tensor round trip.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch  # noqa: E402

import rrpc  # noqa: E402


def whoami(x: torch.Tensor) -> str:
    return f"{rrpc.get_worker_info().name} got a {tuple(x.shape)} tensor summing to {x.sum():g}"


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int) -> int:
        self.count += n
        return self.count


def main(rank: int, world_size: int, args: object) -> None:
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        print(rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)))
        print(rrpc.rpc_async("worker2", lambda x: x * 2, args=(torch.arange(3),)).wait())
        futures = [rrpc.rpc_async(f"worker{r}", whoami, args=(torch.ones(r, 2),)) for r in (1, 2)]
        print(*torch.futures.wait_all(futures), sep="\n")

        counter = rrpc.remote("worker1", Counter)  # lives on worker1; we hold a reference
        counter.rpc_sync().add(3)
        print(f"counter on {counter.owner_name()}: {counter.rpc_sync().add(4)}")

        big = torch.randn(16 << 20)  # 64 MiB
        start = time.perf_counter()
        back = rrpc.rpc_sync("worker2", torch.clone, args=(big,))
        elapsed = time.perf_counter() - start
        print(f"64 MiB round trip in {elapsed * 1e3:.1f} ms, exact: {torch.equal(back, big)}")
        print("traffic:", {peer: int(s["bytes_sent"]) for peer, s in rrpc.stats().items()})
    rrpc.shutdown()


if __name__ == "__main__":
    launch(main, 3, None)
