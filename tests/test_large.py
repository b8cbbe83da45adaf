"""A tensor beyond 2 GiB (protobuf's message limit) crosses intact, both ways.

Slow: it moves 4 GiB per run. `make test-slow` runs it, once over the gRPC
stream and once through same-host shared memory.
"""

from __future__ import annotations

import pytest
import torch

import rrpc
from harness import run_workers

HUGE = (2 << 30) + 4099  # bytes: past 2 GiB, and not a multiple of any chunk size


def _checksum(tensor):
    # In 64 MiB chunks: summing all of it as int64 at once would take 8x its memory.
    return sum(int(chunk.sum(dtype=torch.int64)) for chunk in tensor.split(1 << 26))


def _sum_and_echo(tensor):
    return tensor.numel(), _checksum(tensor), tensor


def _round_trip_huge(rank, world_size):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank != 0:
        rrpc.shutdown(timeout=600)  # waits for worker0, however long it takes
        return None
    # Random bytes with a prime period: every 2 MiB chunk differs from its neighbours.
    period = 1_000_003
    generator = torch.Generator().manual_seed(2024)
    pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=generator)
    sent = pattern.repeat(HUGE // period + 1)[:HUGE]
    expected_sum = _checksum(sent)
    numel, remote_sum, back = rrpc.rpc_sync("worker1", _sum_and_echo, args=(sent,), timeout=0)
    stats = rrpc.stats()["worker1"]
    result = {
        "remote numel": numel,
        "remote sum matches": remote_sum == expected_sum,
        "back dtype": str(back.dtype),
        "back numel": back.numel(),
        "back equal": torch.equal(back, sent),
        "tensor bytes sent": stats["tensor_bytes_sent"],
        "tensor bytes received": stats["tensor_bytes_received"],
    }
    del sent, back
    rrpc.shutdown(timeout=600)
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shared_memory", ["0", "1"], ids=["stream", "shared-memory"])
def test_tensor_over_2gib_round_trips_exactly(shared_memory):
    (result, _) = run_workers(
        _round_trip_huge, 2, env={"RRPC_SHM": shared_memory}, init=False, timeout=840
    )
    assert result == {
        "remote numel": HUGE,
        "remote sum matches": True,
        "back dtype": "torch.uint8",
        "back numel": HUGE,
        "back equal": True,
        "tensor bytes sent": HUGE,
        "tensor bytes received": HUGE,
    }
