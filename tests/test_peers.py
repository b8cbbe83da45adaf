"""The peer directory (rrpc/peers.py), without processes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rrpc import codec, shm
from rrpc.messages import PeerUnavailableError, RpcError, WorkerInfo
from rrpc.peers import Directory

A = WorkerInfo("a", 0)
B = WorkerInfo("b", 1)


def _directory(*workers: WorkerInfo) -> Directory:
    directory = Directory(shm_pool=None)
    for info in workers:
        directory.add(info, f"127.0.0.1:{5000 + info.id}", {})
    return directory


def test_resolves_names_ranks_and_worker_infos_like_torch():
    directory = _directory(A, B)
    assert directory.resolve("b") == B
    assert directory.resolve(1) == B
    assert directory.resolve(WorkerInfo("b", 1)) == B
    assert directory.all() == [A, B]
    assert directory.address(1) == "127.0.0.1:5001"
    with pytest.raises(RpcError, match=r"could not find destination worker 'c'.*a, b"):
        directory.resolve("c")
    with pytest.raises(ValueError, match="pass a name, rank or WorkerInfo"):
        directory.resolve(1.0)
    with pytest.raises(ValueError):
        directory.resolve(True)  # a bool is not a rank


def test_a_worker_that_left_fails_with_why_and_a_rejoin_forgets_that():
    directory = _directory(A, B)
    directory.remove(B, "b left the group")
    for name in ("b", 1):
        with pytest.raises(PeerUnavailableError, match="b left the group"):
            directory.resolve(name)
    assert directory.known(1) is None and directory.address(1) is None
    directory.add(B, "127.0.0.1:6001", {})
    assert directory.resolve("b") == B and directory.address(1) == "127.0.0.1:6001"
    assert directory.departed == {}


def test_removing_an_old_incarnation_keeps_the_new_one():
    directory = _directory(A)
    new_b = WorkerInfo("b", 2)  # b came back under another rank
    directory.add(new_b, "127.0.0.1:7002", {})
    directory.remove(B, "old b")  # the old incarnation's removal arrives late
    assert directory.resolve("b") == new_b


def test_a_leavers_segments_are_unmapped_and_a_tensor_kept_over_one_still_reads():
    # The peer is this process's own pool (its probe advertised as a peer's would be).
    pool = shm.SenderPool()
    directory = Directory(shm_pool=None)
    shares = {"probe": pool.probe.name, "shm_key": pool.key.hex(), "host": shm.host_key()}
    try:
        directory.add(B, "127.0.0.1:5001", shares)
        peer = directory.known(1)
        assert peer is not None and peer.source is not None and peer.pid == os.getpid()
        data = np.arange(1 << 16, dtype=np.uint8)
        kept = peer.source(pool.place(memoryview(data), holder=os.getpid()))
        peer.source(pool.place(memoryview(data), holder=os.getpid()))  # freed at once
        maps = directory._attachments._maps
        assert len(maps) == 3  # the probe, and both slots
        directory.remove(B, "b left the group")
        assert maps == {}
        assert torch.equal(kept, torch.from_numpy(data))  # its map lives on with it
        # A process given the pid of one never removed: the earlier one's maps go.
        directory.add(B, "127.0.0.1:5001", shares)
        source = directory.known(1).source
        assert source is not None
        source(pool.place(memoryview(data), holder=os.getpid()))
        assert len(maps) == 2
        directory.add(WorkerInfo("c", 2), "127.0.0.1:5002", shares)
        assert list(maps) == [pool.probe.name]
    finally:
        pool.close()


def test_a_late_joiner_is_looked_up_once_then_known():
    directory = _directory(A)
    asked = []

    def lookup(worker):
        asked.append(worker)
        return (B, "127.0.0.1:5001", {}) if worker in ("b", 1) else None

    directory.lookup = lookup
    assert directory.get(1).info == B
    assert directory.resolve("b") == B
    assert asked == [1]  # the second time it was known
    with pytest.raises(RpcError):
        directory.resolve("nobody")
    assert directory.known(5) is None and asked == [1, "nobody"]  # known() never asks


def test_same_main_only_when_the_fingerprints_match(monkeypatch):
    monkeypatch.setattr(codec, "main_fingerprint", lambda: "this script")
    directory = Directory(shm_pool=None)
    directory.add(A, "x:1", {"main": "this script"})
    directory.add(B, "x:2", {"main": "another script"})
    directory.add(WorkerInfo("c", 2), "x:3", {"main": ""})  # no script (an interactive session)
    assert directory.known(0).same_main and not directory.known(1).same_main
    assert not directory.known(2).same_main
    assert directory.known(0).placer is None and directory.known(0).source is None  # no shm
