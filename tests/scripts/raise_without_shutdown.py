"""A worker script that fails: rank 0 raises after its first call, never
calling shutdown(); rank 1 calls shutdown() as usual.

    RANK=<r> WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=<p> python raise_without_shutdown.py

Both processes must end: rank 0 with its error, rank 1 printing "SHUT DOWN"
once it noticed that rank 0 is gone.
"""

import os
import threading

import rrpc

go = threading.Event()  # rank 0: rank 1 has had its answer


def release():
    go.set()


def where():
    return rrpc.get_worker_info().name


def main():
    rank = int(os.environ["RANK"])
    rrpc.init_rpc(f"worker{rank}")
    print("CALLED", rrpc.rpc_sync(f"worker{1 - rank}", where), flush=True)
    if rank == 0:
        assert go.wait(60)
        raise RuntimeError("boom, without shutdown")
    rrpc.rpc_async("worker0", release)  # not waited for: worker0 may be gone before it answers
    rrpc.shutdown()
    print("SHUT DOWN", flush=True)


if __name__ == "__main__":
    main()
