"""A network partition between two "hosts": the veth link between two network
namespaces taken down while a call is pending, then brought back.

Worker0 and worker1 share host A (namespace A; worker0 hosts the store),
worker2 is alone on host B; the veth pair is their only way to each other
(benchmarks/netns.py). With the link down, nothing reaches worker2 and nothing
tells anyone: no RST, no FIN, packets vanish. rrpc must fail the call pending
on worker2 within ``peer_timeout`` naming it, keep worker0 ⇄ worker1 working
meanwhile, and reach worker2 again once the link is back. (torch's TensorPipe
agent has no keepalive: the same pending call fails at its RPC timeout, 60 s
by default.)

Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rrpc
from harness import WorkerGroup, mp_context

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns  # noqa: E402 -- benchmarks/netns.py, found through the path above

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
]

PEER_TIMEOUT = 3.0  # seconds; the default is 8


_release = []  # worker2's copy of the test's release Event


def _block():
    _release[0].wait(60)  # set by the test once the link is back
    return "released"


def _worker(rank, world_size, pair, partitioned, healed, release, results):
    _release.append(release)
    host = pair.b if rank == 2 else pair.a
    netns.enter(host.netns)  # before any socket is opened
    os.environ.update(MASTER_ADDR=pair.a.address, RRPC_ADVERTISE_HOST=host.address)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        assert rrpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 1)).sum().item() == 4
        pending = rrpc.rpc_async("worker2", _block, timeout=60)
        results.put(("pending", None))
        assert partitioned.wait(30)
        started = time.monotonic()
        # The link is down: the other host's worker is unreachable, this one's is not.
        assert rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 2)).sum().item() == 6
        try:
            pending.wait()
            results.put(("error", "the pending call to worker2 completed across a partition"))
        except rrpc.PeerUnavailableError as exc:
            results.put(("failed", (time.monotonic() - started, str(exc))))
        assert rrpc.rpc_sync("worker1", torch.mul, args=(torch.ones(2), 3)).sum().item() == 6
        assert healed.wait(30)
        release.set()
        # Reachable again: the next call opens a new stream.
        value = rrpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 5), timeout=20)
        results.put(("healed", value.sum().item()))
    rrpc.shutdown()


def _link(pair, state: str) -> None:
    """Host B's end of the link down or up. Host A keeps its end up and its route:
    what it sends to B is dropped without an error (the veth has no carrier), as
    across a real partition; only B's own sends fail at once (its link is down)."""
    subprocess.run(
        ["ip", "-n", pair.b.netns, "link", "set", pair.b.ifname, state],
        check=True,
        capture_output=True,
    )


def _next(results, group, timeout):
    """The next report of worker0, or the failure of any worker (raised by the harness)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            if any(process.exitcode not in (None, 0) for process in group.processes):
                group.wait(timeout=5)  # raises, describing each failed rank
    raise AssertionError(f"no report from worker0 within {timeout} s")


def test_a_partitioned_peer_fails_its_calls_within_peer_timeout_and_comes_back():
    partitioned, healed, release = mp_context.Event(), mp_context.Event(), mp_context.Event()
    results = mp_context.Queue()
    with netns.VethPair.create() as pair:
        env = {"RRPC_PEER_TIMEOUT": str(PEER_TIMEOUT), "RRPC_SHM": "0"}
        args = (pair, partitioned, healed, release, results)
        with WorkerGroup(_worker, 3, args=args, env=env, init=False) as group:
            assert _next(results, group, 60) == ("pending", None)
            _link(pair, "down")
            partitioned.set()
            kind, value = _next(results, group, PEER_TIMEOUT * 4)
            assert kind == "failed", value
            elapsed, message = value
            assert elapsed < PEER_TIMEOUT * 2, f"took {elapsed:.1f} s: {message}"
            assert "worker2" in message
            print(f"pending call failed {elapsed:.2f} s after the partition: {message}")
            _link(pair, "up")
            healed.set()
            assert _next(results, group, 40) == ("healed", 12.0)
            group.wait(timeout=60)
