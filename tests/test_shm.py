"""The same-host slot pool (``shm.SenderPool``): reuse, slots of dead receivers, and
slots a reply returns to the worker that sent them."""

import os
import resource
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest
import torch

import rrpc
from harness import run_workers
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


@pytest.mark.parametrize(
    ("size", "capacity"),
    [
        (256 << 10, 256 << 10),
        ((256 << 10) + 1, 320 << 10),  # past a power of two: a quarter step, not double
        (300 << 10, 320 << 10),
        (512 << 10, 512 << 10),
        (900 << 10, 1 << 20),
        (5 * MiB, 5 * MiB),
        (128 * MiB + 1, 160 * MiB),
    ],
)
def test_a_slot_is_at_most_a_quarter_larger_than_its_buffer(size, capacity):
    assert shm.capacity_for(size) == capacity
    assert size <= capacity <= max(size * 5 // 4, 8)


def _sized(size: int) -> memoryview:
    return memoryview(np.zeros(size, dtype=np.uint8))


def test_a_buffer_takes_a_free_larger_slot_up_to_twice_its_size_before_a_new_one():
    pool = shm.SenderPool()
    attach = shm.Attachments().bind(os.getpid(), pool.key)
    try:
        large = pool.place(_sized(600 << 10), holder=os.getpid())  # a 640 KiB slot
        attach(large)  # read and freed: free
        smaller = pool.place(_sized(300 << 10), holder=os.getpid())  # 320 KiB class: none yet
        assert smaller.segment == large.segment  # the free 640 KiB slot, not a new one
        attach(smaller)
        tiny = pool.place(_sized(256 << 10), holder=os.getpid())  # 640 KiB is over twice 256
        assert tiny.segment != large.segment
        assert pool.debug_info() == {"segments": 2, "busy": 1}
    finally:
        pool.close()


def test_a_slot_being_made_holds_up_no_other_buffer(monkeypatch):
    # Pre-faulting a new slot takes ~100 ms for 128 MiB here: made under the
    # pool's lock, it held up every other placement of the worker meanwhile.
    pool = shm.SenderPool()
    attach = shm.Attachments().bind(os.getpid(), pool.key)
    making, go_on = threading.Event(), threading.Event()
    make = shm._Segment.__init__

    def slowly(segment, capacity, key):
        if capacity == 4 * MiB:
            making.set()
            assert go_on.wait(60)
        make(segment, capacity, key)

    placed: dict[str, SharedBuffer | None] = {}

    def place(name: str, size: int) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: placed.update({name: pool.place(_sized(size), holder=os.getpid())})
        )
        thread.start()
        return thread

    try:
        free = pool.place(_payload(1), holder=os.getpid())  # a 2 MiB slot, then freed
        attach(free)
        monkeypatch.setattr(shm._Segment, "__init__", slowly)
        large = place("large", 4 * MiB)
        assert making.wait(60)
        small = place("small", 2 * MiB)
        small.join(10)
        assert not small.is_alive()  # placed while the 4 MiB slot is still being made
        assert placed["small"].segment == free.segment
    finally:
        go_on.set()
        large.join(60)
        pool.close()
    assert placed["large"] is not None and placed["large"].segment != free.segment


def test_a_pool_out_of_file_descriptors_leaves_buffers_to_the_stream():
    # Each slot holds a file descriptor: thousands of received tensors kept
    # alive could exhaust the process's limit (often 1,024).
    pool = shm.SenderPool()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 4, hard))
        # Up to 3 more, and the gaps below the highest: far fewer than this.
        placed = [pool.place(_sized(256 << 10), holder=os.getpid()) for _ in range(highest + 4)]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        pool.close()
    assert placed[0] is not None  # slots while descriptors last
    assert placed[-1] is None  # then None: the caller sends the buffer in the stream
    # Never a busy slot again: this (live) process's, taken back as if it had
    # died because /proc could not be opened, would overwrite a tensor it holds.
    segments = [shared.segment for shared in placed if shared is not None]
    assert len(segments) == len(set(segments))


def test_only_reply_slots_their_receiver_has_not_read_count_as_unseen():
    pool = shm.SenderPool()
    placer = pool.towards(os.getpid())
    unseen, slot = placer.unseen, 2 * MiB  # a 2 MiB payload fills a 2 MiB slot
    try:
        placer.place(_payload(1))  # a request: not counted
        replies = [placer.place(_payload(2 + i), reply=True) for i in range(3)]
        assert unseen.bytes == 3 * slot
        assert unseen.over(2 * slot) and not unseen.over(3 * slot)
        attach = shm.Attachments().bind(os.getpid(), pool.key)
        kept = attach(replies[0])  # read, and kept alive: the receiver's memory now
        attach(replies[1])  # read and freed at once: the slot is free again
        assert not unseen.over(slot)  # only the third is unread
        assert unseen.bytes == slot
        again = placer.place(_payload(9), reply=True)  # reuses the freed slot: a new sending
        assert again.segment == replies[1].segment
        assert unseen.over(slot)  # its earlier, read sending does not make it count as read
        assert unseen.wait_for_room(slot, ended=lambda: True) is False  # stream gone: stop waiting
        unseen.forget()
        assert unseen.bytes == 0 and unseen.wait_for_room(0, ended=lambda: False)
        del kept
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


# -- A reply that returns the peer's own slot -------------------------------------
class _Pair:
    """Worker A and worker B of one host, in this process: A's pool and B's."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.pool_a, self.pool_b = shm.SenderPool(), shm.SenderPool()
        self.maps_a, self.maps_b = shm.Attachments(), shm.Attachments()
        self.a_to_b = self.pool_a.towards(pid, self.maps_a)  # A places for B
        self.b_to_a = self.pool_b.towards(pid, self.maps_b)  # B places for A
        self.b_reads = self.maps_b.bind(pid, self.pool_a.key, self.pool_b)  # what A sends B
        self.a_reads = self.maps_a.bind(pid, self.pool_b.key, self.pool_a)  # what B sends A

    def close(self) -> None:
        self.pool_a.close()
        self.pool_b.close()


def test_a_reply_within_the_callers_slot_returns_it_and_the_caller_copies_it_out():
    pair = _Pair()
    try:
        sent = np.arange(2 * MiB, dtype=np.uint8)
        received = pair.b_reads(pair.a_to_b.place(memoryview(sent)))  # B's tensor over A's slot
        view = received[1000:5000]  # B replies with a part of what it got, and keeps it
        reply = pair.b_to_a.place(memoryview(view.numpy()))
        assert reply.returned and reply.offset == shm.HEADER + 1000 and reply.size == 4000
        assert pair.pool_b.debug_info()["segments"] == 0  # B copied nothing into a slot of its own
        back = pair.a_reads(reply)  # B still maps it: A copies it out
        assert np.array_equal(back.numpy(), sent[1000:5000])
        view.fill_(0)  # what B does to its tensor afterwards: not seen by A
        assert np.array_equal(back.numpy(), sent[1000:5000])
        del received, view
        again = pair.pool_a.place(_payload(8), holder=os.getpid())
        assert again.segment == reply.segment  # both holds gone: reused
        assert np.array_equal(back.numpy(), sent[1000:5000])  # a copy: untouched by the reuse
    finally:
        pair.close()


def test_a_returned_slot_the_callee_no_longer_maps_is_the_reply_itself_until_it_is_freed():
    pair = _Pair()
    try:
        sent = np.arange(2 * MiB, dtype=np.uint8)
        received = pair.b_reads(pair.a_to_b.place(memoryview(sent)))
        reply = pair.b_to_a.place(memoryview(received.numpy()))
        del received  # B's tensor is gone before A reads the reply: A's hold keeps the slot
        held = pair.pool_a.place(_payload(7), holder=os.getpid())
        assert held.segment != reply.segment
        back = pair.a_reads(reply)  # no copy: a tensor over A's own slot
        assert np.array_equal(back.numpy(), sent)
        assert pair.pool_a.place(_payload(9), holder=os.getpid()).segment != reply.segment
        del back  # freed: the slot is free again
        assert pair.pool_a.place(_payload(10), holder=os.getpid()).segment == reply.segment
    finally:
        pair.close()


def test_a_reply_outside_any_slot_of_the_caller_is_copied_into_the_callees_own():
    pair = _Pair()
    try:
        kept = pair.b_reads(pair.a_to_b.place(_payload(1)))
        reply = pair.b_to_a.place(_payload(2))  # B's own tensor
        assert not reply.returned and pair.pool_b.debug_info()["segments"] == 1
        assert bool((pair.a_reads(reply) == 2).all())
        del kept
    finally:
        pair.close()


def test_a_slot_is_returned_once_until_it_is_taken_back():
    pair = _Pair()
    try:
        received = pair.b_reads(pair.a_to_b.place(_payload(3)))
        first = pair.b_to_a.place(memoryview(received.numpy()))
        second = pair.b_to_a.place(memoryview(received.numpy()))  # A still holds the first
        assert first.returned and not second.returned
        assert bool((pair.a_reads(first) == 3).all()) and bool((pair.a_reads(second) == 3).all())
        assert pair.b_to_a.place(memoryview(received.numpy())).returned  # taken back: again
    finally:
        pair.close()


def test_a_returned_descriptor_is_checked_before_anything_is_read():
    pair = _Pair()
    try:
        received = pair.b_reads(pair.a_to_b.place(_payload(4)))
        reply = pair.b_to_a.place(memoryview(received.numpy()))
        forged = [
            SharedBuffer(segment=reply.segment, offset=0, size=16, returned=True),
            SharedBuffer(segment=reply.segment, offset=64, size=64 * MiB, returned=True),
            SharedBuffer(segment="1/2", offset=64, size=16, returned=True),
        ]
        for descriptor in forged:
            with pytest.raises(ValueError):
                pair.a_reads(descriptor)
        stranger = shm.Attachments().bind(os.getpid() + 1, pair.pool_b.key, pair.pool_a)
        with pytest.raises(ValueError, match="was not sent to process"):
            stranger(reply)  # the slot went to another process
        assert bool((pair.a_reads(reply) == 4).all())
        with pytest.raises(ValueError, match="not marked returned"):
            pair.a_reads(reply)  # taken back already
        with pytest.raises(ValueError, match="sent none"):
            shm.Attachments().bind(os.getpid(), pair.pool_b.key)(reply)  # a worker with no pool
    finally:
        pair.close()


# -- Workers -------------------------------------------------------------------------
_kept: list = []  # worker1's copies of what it was sent


def _keep_and_return(tensor):
    _kept.append(tensor)
    return tensor


def _scribble_on_kept():
    _kept[-1].fill_(-1.0)  # after its reply went: the caller's copy must not change


def _slots_made():
    from rrpc.agent import current_agent

    return current_agent().shm_pool.debug_info()["segments"]


def _echoes_returned(rank, world_size):
    if rank != 0:
        return None
    sent = torch.randn(MiB)  # 4 MiB: through a slot either way
    back = rrpc.rpc_sync("worker1", _keep_and_return, args=(sent,))
    view = rrpc.rpc_sync("worker1", torch.narrow, args=(sent, 0, 1000, MiB // 2))
    rrpc.rpc_sync("worker1", _scribble_on_kept)
    return (
        torch.equal(back, sent),
        torch.equal(view, sent[1000 : 1000 + MiB // 2]),
        rrpc.rpc_sync("worker1", _slots_made),
    )


def test_a_worker_that_returns_what_it_was_sent_makes_no_slot_and_the_caller_keeps_a_copy():
    same, narrowed, slots = run_workers(_echoes_returned, env={"RRPC_SHM": "1"})[0]
    assert same and narrowed
    assert slots == 0  # worker1 replied with the caller's own slots, copied nothing


# -- A tensor sent before its receiver has finished init_rpc ---------------------
def _sum(tensor):
    return float(tensor.sum())


def _sent_before_the_callee_knows_the_caller(rank, world_size, sent):
    # Seen in `make bench` (parameter server): a trainer's first update, 4 MiB
    # through shared memory, reached the server while it was still adding its
    # peers; the lane's reader found no peer for the slot and broke the lane.
    import threading

    from rrpc.agent import Agent

    if rank == 1:  # the callee: adds its peers only once the caller's frame is being read
        add_peer, attach_from = Agent.add_peer, Agent.attach_from
        attaching = threading.Event()

        def late_add_peer(self, *args):
            assert sent.wait(30)
            attaching.wait(10)  # the frame with the slot is being read (or never will be)
            return add_peer(self, *args)

        def noted_attach_from(self, *args):
            attaching.set()
            return attach_from(self, *args)

        Agent.add_peer, Agent.attach_from = late_add_peer, noted_attach_from
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    result = None
    if rank == 0:
        tensor = torch.ones(MiB)  # 4 MiB: a slot
        future = rrpc.rpc_async("worker1", _sum, args=(tensor,))
        sent.set()
        result = future.wait()
    else:
        sent.wait(30)
    rrpc.shutdown()
    return result


def test_a_tensor_sent_before_its_callee_has_added_its_caller_arrives():
    from harness import mp_context

    result = run_workers(
        _sent_before_the_callee_knows_the_caller,
        args=(mp_context.Event(),),
        init=False,
        env={"RRPC_SHM": "1"},
    )
    assert result[0] == float(MiB)


def test_by_default_a_tensor_from_256_kib_takes_a_slot_and_a_smaller_one_the_stream():
    # Below 256 KiB the lane's socket is as fast; from it, a slot is faster.
    from rrpc import codec
    from rrpc.messages import CALL

    threshold = rrpc.RpcBackendOptions().shm_threshold
    pool = shm.SenderPool()
    placer = pool.towards(os.getpid())
    try:
        placed = {}
        for kib in (200, 256, 300):
            out = codec.encode(
                CALL,
                1,
                (print, (torch.ones(kib * 256),), {}),
                shared_memory=placer,
                shm_threshold=threshold,
            )
            placed[kib] = pool.debug_info()["segments"]
        assert placed == {200: 0, 256: 1, 300: 2}, placed
        del out
    finally:
        pool.close()
