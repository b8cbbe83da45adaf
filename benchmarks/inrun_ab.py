"""An A/B of two settings on rrpc's distributed-autograd step, inside one run.

On this project's VM a workload's speed drifts by 10-30 % from one run of a
process pair to the next, so two trees or two settings compared run against
run need many runs to tell a 5 % change from the drift. This runs one pair
of processes and switches between two settings, set by a snippet of Python
run on both (or one) of them, every block of steps: both settings see the
same machine state, and the block-by-block ratio says which is faster.

    python benchmarks/inrun_ab.py \\
        --a "import rrpc.lane_io as L; L.Reader.PROBE_MAX = 8" \\
        --b "import rrpc.lane_io as L; L.Reader.PROBE_MAX = 1024"

The step is `bench.py`'s `dist_autograd` (a `Linear(512, 512)` on the server,
its forward, the distributed backward, a `DistributedOptimizer` step), as
`wakes.py` builds it. Prints
each block's steps/s for A and B, their medians, and the median of B ÷ A
over the pairs of blocks (A then B, B then A, alternately). A snippet runs
once per block on each side it is meant for (`--side`), before that block's
warm-up steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.multiprocessing as mp
from bench import free_port
from wakes import autograd_step


def run_snippet(code: str) -> None:
    exec(code, {})  # a setting named on the command line of this benchmark


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    import rrpc

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    rrpc.init_rpc(["client", "server"][rank], rank=rank, world_size=2)
    if rank == 0:
        step = autograd_step(rrpc)

        def switch(code: str) -> None:
            if args.side in ("both", "client"):
                run_snippet(code)
            if args.side in ("both", "server"):
                rrpc.rpc_sync("server", run_snippet, args=(code,))

        for _ in range(50):
            step()
        speeds: dict[str, list[float]] = {"A": [], "B": []}
        settings = [("A", args.a), ("B", args.b)]
        for block in range(args.blocks):
            for label, code in settings if block % 2 == 0 else settings[::-1]:
                switch(code)
                for _ in range(10):
                    step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                speeds[label].append(args.steps / (time.perf_counter() - start))
        for label in "AB":
            blocks = " ".join(f"{speed:.0f}" for speed in speeds[label])
            print(f"{label}: {blocks}  median {statistics.median(speeds[label]):.0f} steps/s")
        ratios = [b / a for a, b in zip(speeds["A"], speeds["B"], strict=True)]
        wins = sum(ratio > 1 for ratio in ratios)
        print(f"B / A: median {statistics.median(ratios):.3f}, B faster in {wins} of {len(ratios)}")
    rrpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="", help="Python run for setting A")
    parser.add_argument("--b", default="", help="Python run for setting B")
    parser.add_argument("--side", choices=("both", "client", "server"), default="both")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each setting")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per block")
    args = parser.parse_args()
    mp.spawn(_worker, args=(free_port(), args), nprocs=2)


if __name__ == "__main__":
    main()
