"""The same-host slot pool (``shm.SenderPool``): reuse, and slots of dead receivers."""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from rrpc import shm
from rrpc._proto.rrpc_pb2 import SharedBuffer

MiB = 1 << 20


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _payload(fill: int) -> memoryview:
    return memoryview(np.full(2 * MiB, fill, dtype=np.uint8))


def test_a_freed_slot_is_reused_and_a_busy_one_is_not():
    pool = shm.SenderPool()
    try:
        first = pool.place(_payload(1), holder=os.getpid())
        second = pool.place(_payload(2), holder=os.getpid())  # the first is still busy
        assert first.segment != second.segment
        # the receiver's tensor, freed at once: slot free
        shm.Attachments().bind(os.getpid(), pool.key)(first)
        third = pool.place(_payload(3), holder=os.getpid())
        assert third.segment == first.segment
        assert pool.debug_info() == {"segments": 2, "busy": 2}
    finally:
        pool.close()


def test_the_slot_of_a_receiver_that_died_without_freeing_it_is_taken_back():
    pool = shm.SenderPool()
    try:
        lost = pool.place(_payload(1), holder=_dead_pid())
        again = pool.place(_payload(2), holder=os.getpid())
        assert again.segment == lost.segment  # reclaimed, not a new segment
        assert pool.debug_info() == {"segments": 1, "busy": 1}
        attached = shm.Attachments().bind(os.getpid(), pool.key)(again)
        assert bool((attached == 2).all())  # the new payload, whole
    finally:
        pool.close()


def test_a_live_receivers_slot_is_never_taken_back():
    pool = shm.SenderPool()
    try:
        held = pool.place(_payload(1), holder=os.getpid())
        other = pool.place(_payload(2), holder=os.getpid())
        assert other.segment != held.segment
        assert pool.debug_info() == {"segments": 2, "busy": 2}
    finally:
        pool.close()


def test_a_zombie_counts_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
    try:
        assert not shm._alive(child.pid)
    finally:
        child.wait()
    assert shm._alive(os.getpid())


def test_a_receiver_maps_only_the_bound_peers_pool():
    # A descriptor names "<pid>/<fd>": only the peer's own process, and only a
    # segment whose header carries the peer's pool key, is ever mapped.
    pool, other = shm.SenderPool(), shm.SenderPool()
    try:
        mine = pool.place(_payload(1), holder=os.getpid())
        foreign = other.place(_payload(2), holder=os.getpid())
        attach = shm.Attachments().bind(os.getpid(), pool.key)
        assert bool((attach(mine) == 1).all())
        with pytest.raises(ValueError, match="not in the peer's pool"):
            attach(foreign)  # same process, another pool
        with pytest.raises(ValueError, match="not in the pool of the peer on this stream"):
            shm.Attachments().bind(os.getpid() + 1, pool.key)(mine)  # another process
        with tempfile.TemporaryFile() as victim:
            victim.write(b"x" * 4096)
            victim.flush()
            named = SharedBuffer(segment=f"{os.getpid()}/{victim.fileno()}", offset=64, size=16)
            with pytest.raises(ValueError, match="not in the peer's pool"):
                attach(named)  # an ordinary open file of the peer
    finally:
        pool.close()
        other.close()
