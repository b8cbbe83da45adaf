"""Large byte copies in parts (rrpc/copies.py): exact, whoever copies each part."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest
import torch

import rrpc
from harness import run_workers
from rrpc import copies

KiB = 1 << 10


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of 16 KiB and up, four of them where torch may use four threads."""
    monkeypatch.setattr(copies, "PARALLEL_MIN", 32 * KiB)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


def _bytes(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _copy_in_thread(target: np.ndarray, source) -> threading.Thread:
    copier = threading.Thread(target=copies.copy_bytes, args=(target, source), daemon=True)
    copier.start()
    copier.join(timeout=30)
    return copier


@pytest.mark.parametrize(
    "size",
    [0, 1, 32 * KiB - 1, 32 * KiB, 64 * KiB + 4095, 64 * KiB + 4097, 1 << 20, (1 << 20) + 13],
)
def test_a_copy_is_exact_at_every_size(small_parts, size):
    source = _bytes(size, size)
    for given in (source, memoryview(source), source.tobytes()):  # bytes: read-only
        target = np.zeros(size, dtype=np.uint8)
        copies.copy_bytes(target, given)
        assert np.array_equal(target, source)


def test_a_copy_goes_in_parts_page_aligned(small_parts, monkeypatch):
    handed: list[tuple[int, int]] = []
    hand = copies._helpers.hand

    def note(parts):
        handed.extend((len(part.target), part.target.ctypes.data) for part in parts)
        hand(parts)

    monkeypatch.setattr(copies._helpers, "hand", note)
    target = np.zeros((1 << 20) + 13, dtype=np.uint8)
    copies.copy_bytes(target, _bytes(len(target)))
    assert len(handed) == 3  # four parts: the caller copies the first
    first = len(target) - sum(size for size, _ in handed)
    assert first > 0 and first % 4096 == 0
    assert all((address - target.ctypes.data) % 4096 == 0 for _, address in handed)


def test_parts_no_helper_took_are_copied_by_the_caller(small_parts, monkeypatch):
    # Helpers all busy (or a forked process, whose helpers are not there): the
    # caller copies every part itself, rather than waiting for nobody.
    monkeypatch.setattr(copies._helpers, "hand", lambda parts: None)
    source = _bytes((1 << 20) + 7)
    target = np.zeros(len(source), dtype=np.uint8)
    assert not _copy_in_thread(target, source).is_alive()
    assert np.array_equal(target, source)


def test_a_helper_copies_a_part_handed_to_it_and_keeps_its_error_for_the_caller():
    source = _bytes(100 * KiB)
    part = copies._Part(np.zeros(len(source), dtype=np.uint8), source)
    target = part.target
    copies._helpers.hand([part])
    assert part.done.wait(30) and part.error is None
    assert np.array_equal(target, source)
    assert part.target is None and part.source is None  # a copied part holds no buffer
    assert not part.run()  # copied once, by the helper

    read_only = np.zeros(len(source), dtype=np.uint8)
    read_only.flags.writeable = False
    failing = copies._Part(read_only, source)
    copies._helpers.hand([failing])
    assert failing.done.wait(30)
    assert isinstance(failing.error, ValueError)


def _copy_in_child(size: int) -> bool:
    source = _bytes(size, 3)
    target = np.zeros(size, dtype=np.uint8)
    copies.copy_bytes(target, source)
    return np.array_equal(target, source) and copies._helpers._count > 0


def test_a_forked_child_copies_with_helpers_of_its_own(small_parts):
    copies.copy_bytes(np.zeros(1 << 20, dtype=np.uint8), _bytes(1 << 20))  # helpers here
    # Forked while another thread holds the helpers' lock: the child's copy
    # must neither wait for that lock nor for its parent's helper threads.
    with copies._helpers._lock, multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply_async(_copy_in_child, (1 << 20,)).get(timeout=60)


def test_an_error_in_a_part_is_raised_in_the_caller(small_parts, monkeypatch):
    class Unwritable(copies._Part):  # every part but the caller's own fails to copy
        def __init__(self, target, source):
            target = np.zeros(len(target), dtype=np.uint8)
            target.flags.writeable = False
            super().__init__(target, source)

    monkeypatch.setattr(copies, "_Part", Unwritable)
    with pytest.raises(ValueError, match="read-only"):
        copies.copy_bytes(np.zeros(1 << 20, dtype=np.uint8), _bytes(1 << 20))


def test_a_copy_between_buffers_of_two_sizes_is_refused():
    with pytest.raises(ValueError, match="copy of 5 bytes into 4"):
        copies.copy_bytes(np.zeros(4, dtype=np.uint8), b"12345")


# -- Workers: tensors of many MiB through shared-memory slots, both ways ---------
_kept: list = []


def _negated(tensor):
    return -tensor  # a new tensor: the reply is copied into a slot of worker1's


def _kept_and_returned(tensor):
    _kept.append(tensor)  # still mapped here: the caller takes its slot back as a copy
    return tensor


def _large_round_trips(rank, world_size):
    if rank != 0:
        return None
    generator = torch.Generator().manual_seed(7)
    sent = torch.randn((copies.PARALLEL_MIN // 4) + 3, generator=generator)  # 8 MiB + 12 bytes
    negated = rrpc.rpc_sync("worker1", _negated, args=(sent,))
    kept = rrpc.rpc_sync("worker1", _kept_and_returned, args=(sent,))
    return torch.equal(negated, -sent), torch.equal(kept, sent)


def test_tensors_of_many_mib_cross_shared_memory_exactly():
    assert run_workers(_large_round_trips, env={"RRPC_SHM": "1"})[0] == (True, True)
