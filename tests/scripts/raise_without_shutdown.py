"""A worker script that fails: rank 0 raises after its first call, never
calling shutdown(); rank 1 calls shutdown() as usual.

    RANK=<r> WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=<p> python raise_without_shutdown.py

Both processes must end: rank 0 with its error, rank 1 printing "SHUT DOWN"
once it noticed that rank 0 is gone.
"""

import os

import rrpc


def where():
    return rrpc.get_worker_info().name


def main():
    rank = int(os.environ["RANK"])
    rrpc.init_rpc(f"worker{rank}")
    print("CALLED", rrpc.rpc_sync(f"worker{1 - rank}", where), flush=True)
    if rank == 0:
        raise RuntimeError("boom, without shutdown")
    rrpc.shutdown()
    print("SHUT DOWN", flush=True)


if __name__ == "__main__":
    main()
