"""Every fast path gives the same results on and off.

The whole suite also runs with a path off, e.g. ``RRPC_SHM=0 make test``; this
module runs the transfers most sensitive to the transport both ways in every
run: every dtype, views, tensors above and below the shared-memory threshold,
a tensor larger than the chunk size, and the received tensors' independence.
"""

import threading

import pytest
import torch

import rrpc
from harness import run_workers

MiB = 1 << 20
DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def echo(value):
    return value


def add_one_in_place(tensor):
    tensor += 1
    return tensor


def _payloads():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(3 * MiB // 4, generator=generator)  # 3 MiB: above the shm threshold
    small = {dtype: (torch.randn(64, generator=generator) * 50).to(dtype) for dtype in DTYPES}
    large = {dtype: (torch.randn(MiB, generator=generator) * 50).to(dtype) for dtype in DTYPES}
    return {
        "small": small,
        "large": large,
        "view_rows": base.view(768, 1024)[100:600:3],  # strided view of a large storage
        "view_slice": base[1000 : 1000 + MiB // 2],  # contiguous view, 2 MiB
        "beyond_chunk": torch.arange(5 * MiB, dtype=torch.int32),  # 20 MiB > chunk size
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
    }


def _round_trips(rank, world_size):
    if rank != 0:
        return None
    sent = _payloads()
    back = rrpc.rpc_sync("worker1", echo, args=(sent,))
    mismatches = []
    for group in ("small", "large"):
        for dtype in DTYPES:
            got, want = back[group][dtype], sent[group][dtype]
            if got.dtype != want.dtype or not torch.equal(got, want):
                mismatches.append(f"{group} {dtype}")
    for name in ("view_rows", "view_slice", "beyond_chunk", "scalar", "empty"):
        if back[name].shape != sent[name].shape or not torch.equal(back[name], sent[name]):
            mismatches.append(name)
    # A received tensor is the receiver's own: writing to it changes nothing here,
    # and two replies never share memory.
    original = sent["large"][torch.int64].clone()
    first = rrpc.rpc_sync("worker1", add_one_in_place, args=(sent["large"][torch.int64],))
    second = rrpc.rpc_sync("worker1", add_one_in_place, args=(sent["large"][torch.int64],))
    first += 100
    independent = (
        torch.equal(sent["large"][torch.int64], original)
        and torch.equal(second, original + 1)
        and torch.equal(first, original + 101)
    )
    return mismatches, independent, rrpc.stats()["worker1"]["bytes_sent"]


@pytest.mark.parametrize("fast_paths", ["1", "0"], ids=["fast_paths_on", "fast_paths_off"])
def test_transfers_are_exact_with_every_fast_path_on_and_off(fast_paths):
    env = {"RRPC_SHM": fast_paths, "RRPC_MALLOC_TUNING": fast_paths, "RRPC_INLINE": fast_paths}
    [(mismatches, independent, bytes_in_stream), _] = run_workers(
        _round_trips, 2, env=env, timeout=100
    )
    assert mismatches == []
    assert independent
    # With shared memory on, large buffers leave the stream: only descriptors cross gRPC.
    if fast_paths == "1":
        assert bytes_in_stream < 4 * MiB
    else:
        assert bytes_in_stream > 60 * MiB


def _many_in_flight(rank, world_size):
    if rank != 0:
        return None
    futures = [
        rrpc.rpc_async("worker1", echo, args=((i, torch.full((3,), i)),)) for i in range(500)
    ]
    replies = [future.wait() for future in futures]
    return all(n == i and torch.equal(t, torch.full((3,), i)) for i, (n, t) in enumerate(replies))


@pytest.mark.parametrize("delay", ["300e-6", "0"], ids=["lingering_on", "lingering_off"])
def test_hundreds_of_calls_in_flight_each_get_their_own_reply(delay):
    # 500 calls open on one stream: far above batch_min_open, so both senders
    # linger and pack many frames per gRPC message.
    [all_matched, _] = run_workers(_many_in_flight, 2, env={"RRPC_BATCH_DELAY": delay}, timeout=60)
    assert all_matched


def _thread_names(rank, world_size):
    if rank != 0:
        return None
    return {rrpc.rpc_sync("worker1", _thread_name) for _ in range(20)}


def _thread_name():
    return threading.current_thread().name


@pytest.mark.parametrize("inline", ["1", "0"], ids=["inline_on", "inline_off"])
def test_a_lone_call_runs_on_the_thread_that_read_it_unless_switched_off(inline):
    # One call at a time: the reader of its stream or lane runs it, with no hop
    # to a pool thread (rrpc-<name>-<i>).
    [names, _] = run_workers(_thread_names, 2, env={"RRPC_INLINE": inline}, timeout=60)
    on_reader = {name for name in names if name.startswith(("rrpc-serve-", "rrpc-lane-serve-"))}
    if inline == "1":
        assert names == on_reader, names
    else:
        assert not on_reader, names
