"""The bulk socket beside a gRPC stream (rrpc/bulk.py): large tensor buffers
sent from and received into the tensors' memory.

Without processes: two ``Channel`` ends over a TCP socket, the frame reader
claiming a transfer, the opening exchange (token, stream key). With worker
processes: tensors echo exactly over it, between two network namespaces as on
one host with the lane off; switched off it is not dialed; a bulk socket that
breaks mid-call fails that call naming the peer, and the next call works.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import rrpc
from harness import mp_context, run_workers
from rrpc import auth, bulk, bulk_open, wire
from rrpc._proto.rrpc_pb2 import Envelope, SharedBuffer
from rrpc.agent import current_agent
from rrpc.messages import AuthenticationError, ProtocolError
from rrpc.outbox import Outbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns  # noqa: E402 -- benchmarks/netns.py

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


# -- Two ends of one socket, without processes -------------------------------------
def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        dialed = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return dialed, accepted


class _Ends:
    """Two channels bound over ``count`` sockets; what each puts on its
    stream, and their breaks."""

    def __init__(self, max_message_size: int = 0, peer_timeout: float = 8.0, count: int = 1):
        self.broken: list[BaseException] = []
        self.a = bulk.Channel("A", "test-a-{}", max_message_size, peer_timeout, self.broken.append)
        self.b = bulk.Channel("B", "test-b-{}", max_message_size, peer_timeout, self.broken.append)
        for index in range(count):
            assert not self.a.bound and not self.b.bound
            ours, theirs = _tcp_pair()
            assert self.a.bind(ours, index, count) and self.b.bind(theirs, index, count)
        assert self.a.bound and self.b.bound
        self.stream: list[list] = []  # the frames put on "the stream", in order

    def close(self) -> None:
        self.a.close()
        self.b.close()


def _frame(*buffers: np.ndarray, request_id: int = 1) -> list:
    head = Envelope(
        kind=1, request_id=request_id, payload_size=3, buffer_sizes=[len(b) for b in buffers]
    ).SerializeToString()
    return [wire.HEADER.pack(len(head)) + head + b"pay", *(memoryview(b) for b in buffers)]


def _envelope(first: bytes) -> Envelope:
    (size,) = wire.HEADER.unpack_from(first)
    envelope = Envelope()
    envelope.ParseFromString(first[wire.HEADER.size : wire.HEADER.size + size])
    return envelope


def _random(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("count", [1, 3])
def test_large_buffers_cross_the_socket_exactly_and_the_frame_keeps_its_payload(count):
    ends = _Ends(count=count)
    try:
        big, small = _random(3 * MiB + 5, 1), _random(17, 2)
        assert ends.a.send(_frame(big, small), ends.stream.append) is True
        (first,) = ends.stream[0]  # only the envelope and payload stay in the stream
        envelope = _envelope(first)
        assert envelope.bulk != 0 and list(envelope.buffer_sizes) == [len(big), len(small)]
        assert first.endswith(b"pay")
        got = ends.b.claim(envelope.bulk, [len(big), len(small)])
        assert np.array_equal(got[0], big) and np.array_equal(got[1], small)
        # And back, the other way on the same socket.
        assert ends.b.send(_frame(got[0]), ends.stream.append) is True
        back = ends.a.claim(_envelope(ends.stream[1][0]).bulk, [len(big)])
        assert np.array_equal(back[0], big)
    finally:
        ends.close()


def test_a_buffer_past_recycle_min_reuses_the_memory_of_one_freed_before():
    ends = _Ends()
    size = bulk.RECYCLE_MIN + 8
    try:
        first, second = _random(size, 3), _random(size, 4)
        ends.a.send(_frame(first), ends.stream.append)
        (got,) = ends.b.claim(_envelope(ends.stream[0][0]).bulk, [size])
        address = got.ctypes.data
        kept = torch.from_numpy(got[8:].view(np.float32))  # a view keeps the memory
        del got
        ends.a.send(_frame(second, request_id=2), ends.stream.append)
        (again,) = ends.b.claim(_envelope(ends.stream[1][0]).bulk, [size])
        again_address = again.ctypes.data
        assert again_address != address  # the first one's is still in use
        assert np.array_equal(again, second)
        assert np.array_equal(kept.numpy().view(np.uint8), first[8:])  # and untouched
        del kept, again
        freed = bulk.recycled.kept()
        assert freed >= 2 * size  # both came back
        ends.a.send(_frame(first, request_id=3), ends.stream.append)
        (third,) = ends.b.claim(_envelope(ends.stream[2][0]).bulk, [size])
        assert np.array_equal(third, first)
        assert third.ctypes.data in (address, again_address)  # freed memory, not new
        assert bulk.recycled.kept() == freed - size  # taken from the kept ones
    finally:
        ends.close()


def test_recycled_memory_comes_back_only_once_every_view_of_it_is_gone():
    recycled = bulk.Recycled(limit=8 * MiB)
    buffer = recycled.take(MiB)
    address = buffer.ctypes.data
    tensor = torch.from_numpy(buffer[16:].view(np.int32).reshape(4, -1))
    del buffer
    assert recycled.kept() == 0
    other = recycled.take(MiB)
    assert other.ctypes.data != address
    del tensor
    assert recycled.kept() == MiB
    assert recycled.take(MiB).ctypes.data == address
    del other


def test_recycled_keeps_at_most_its_limit_dropping_the_oldest():
    recycled = bulk.Recycled(limit=3 * MiB)
    one, two, big, huge = (
        recycled.take(MiB),
        recycled.take(MiB),
        recycled.take(2 * MiB),
        recycled.take(4 * MiB),
    )
    big_address = big.ctypes.data
    del one, two  # 2 MiB kept
    assert recycled.kept() == 2 * MiB
    del big  # 4 MiB would be kept: the oldest 1 MiB one goes
    assert recycled.kept() == 3 * MiB
    del huge  # past the limit alone: not kept
    assert recycled.kept() == 3 * MiB
    again = recycled.take(2 * MiB)
    assert again.ctypes.data == big_address
    assert recycled.kept() == MiB


def test_transfers_waiting_to_go_count_in_the_streams_reply_backlog():
    """A callee's replies waiting unsent are bounded (streams.REPLY_BACKLOG),
    their bulk bytes too: the stream's outbox counts them until written."""
    outbox = Outbox(1 << 20, track_backlog=True)
    served = bulk.Channel("rank 0", "test-served-{}", 0, 8.0, backlog=outbox)
    dialer = bulk.Channel("worker1", "test-dialer-{}", 0, 8.0)
    socks = _tcp_pair()
    assert served.bind(socks[1]) and dialer.bind(socks[0])
    try:
        big = _random(32 * MiB, 9)
        with outbox._lock:  # nothing is written before this looks
            served.send(_frame(big), outbox.put)
            assert outbox.backlog > len(big)
        (first,) = outbox.queue.get_nowait()
        got = dialer.claim(_envelope(first).bulk, [len(big)])
        assert np.array_equal(got[0], big)
        with outbox._lock:
            outbox._room_waiters += 1  # woken as a reader waiting for room is
            assert outbox._room.wait_for(lambda: outbox.backlog == len(first), timeout=10)
    finally:
        served.close()
        dialer.close()


def test_small_frames_stay_whole_in_the_stream():
    ends = _Ends()
    try:
        frame = _frame(_random(bulk.BULK_MIN - 1, 3))
        assert ends.a.send(frame, ends.stream.append) is False
        assert ends.stream == [frame]
        assert ends.a.send([b"no buffers"], ends.stream.append) is False
    finally:
        ends.close()


def test_a_frame_naming_shared_memory_buffers_stays_whole_in_the_stream():
    # Same host, the lane off: one tensor in a slot, 1 MiB of smaller ones
    # streamed. A bulk frame cannot name slots (its reader refuses one).
    ends = _Ends()
    try:
        frame = _frame(_random(bulk.BULK_MIN, 3), _random(0, 4))
        envelope = _envelope(frame[0])
        envelope.shared_buffers[1].CopyFrom(SharedBuffer(segment="1/2", offset=64, size=9))
        head = envelope.SerializeToString()
        frame[0] = wire.HEADER.pack(len(head)) + head + b"pay"
        assert ends.a.send(frame, ends.stream.append) is False
        assert ends.stream == [frame]
    finally:
        ends.close()


@pytest.mark.parametrize("count", [1, 2])
def test_transfers_claimed_in_any_order_are_each_their_own(count):
    ends = _Ends(count=count)
    try:
        sent = [_random(MiB + i, i) for i in range(4)]
        for i, buffer in enumerate(sent):
            ends.a.send(_frame(buffer, request_id=i + 1), ends.stream.append)
        ids = [_envelope(frame[0]).bulk for frame in ends.stream]
        assert len(set(ids)) == 4
        for i in (2, 0, 3, 1):
            assert np.array_equal(ends.b.claim(ids[i], [len(sent[i])])[0], sent[i])
    finally:
        ends.close()


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_a_transfers_stripes_are_its_bytes_cut_in_equal_parts(count):
    buffers = [_random(size, size) for size in (0, 5, MiB + 3, 1, 0, 2 * MiB)]
    buffers.append(np.arange(1000, dtype=np.float32))  # a view of 4-byte items: cut by bytes
    parts = [bulk.stripe(buffers, index, count) for index in range(count)]
    assert b"".join(bytes(view) for part in parts for view in part) == b"".join(
        buffer.tobytes() for buffer in buffers
    )
    sizes = [sum(len(view) for view in part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(len(view) > 0 for part in parts for view in part)


def test_many_transfers_over_several_sockets_stay_within_the_backlog_and_exact(monkeypatch):
    """Readers that meet a transfer with no room stop until claims make room,
    and the claims, in order, get every transfer whole (each socket carried
    its part)."""
    monkeypatch.setattr(bulk, "BACKLOG", 5 * MiB)
    ends = _Ends(count=3)
    try:
        sent = [_random(2 * MiB + 7 * i, 10 + i) for i in range(12)]
        for i, buffer in enumerate(sent):
            assert ends.a.send(_frame(buffer, _random(i, i), request_id=i + 1), ends.stream.append)
        for i, frame in enumerate(ends.stream):
            with ends.b._lock:
                held = ends.b._held
            assert held <= bulk.BACKLOG
            got = ends.b.claim(_envelope(frame[0]).bulk, [len(sent[i]), i])
            assert np.array_equal(got[0], sent[i]) and np.array_equal(got[1], _random(i, i))
        assert ends.broken == []
    finally:
        ends.close()


def test_a_claim_whose_sizes_differ_from_the_transfer_is_a_protocol_error():
    ends = _Ends()
    try:
        ends.a.send(_frame(_random(MiB, 4)), ends.stream.append)
        with pytest.raises(ProtocolError, match="announced"):
            ends.b.claim(_envelope(ends.stream[0][0]).bulk, [MiB + 1])
    finally:
        ends.close()


def test_a_transfer_over_max_message_size_breaks_the_socket_before_it_is_allocated():
    ends = _Ends(max_message_size=2 * MiB)
    try:
        ends.a.send(_frame(_random(3 * MiB, 5)), ends.stream.append)
        with pytest.raises(ProtocolError, match="max_message_size"):
            ends.b.claim(_envelope(ends.stream[0][0]).bulk, [3 * MiB])
        assert any("max_message_size" in str(error) for error in ends.broken)
    finally:
        ends.close()


class _FacingRawPeer:
    """A bound channel, the raw socket of its peer (``theirs``), and its breaks."""

    def __init__(self, max_message_size: int = 0, peer_timeout: float = 8.0):
        self.broken: list[BaseException] = []
        self.channel = bulk.Channel(
            "peer", "test-{}", max_message_size, peer_timeout, self.broken.append
        )
        ours, self.theirs = _tcp_pair()
        assert self.channel.bind(ours)

    def __enter__(self) -> tuple[bulk.Channel, socket.socket, list[BaseException]]:
        return self.channel, self.theirs, self.broken

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.theirs.close()


def test_a_peer_that_closes_mid_transfer_fails_the_claim_and_reports_the_break():
    with _FacingRawPeer() as (channel, theirs, broken):
        # A header announcing 1 MiB, then half of it, then the peer is gone.
        theirs.sendall(bulk._TRANSFER.pack(7, 1) + bulk._SIZE.pack(MiB) + bytes(MiB // 2))
        theirs.close()
        with pytest.raises(ProtocolError, match="ended"):
            channel.claim(7, [MiB])
        assert len(broken) == 1 and "mid-transfer" in str(broken[0])


@pytest.mark.parametrize("seed", range(8))
def test_garbage_on_the_socket_breaks_it_with_a_clear_error_and_allocates_nothing_huge(seed):
    """Random headers (counts, sizes) from a peer: refused by the limits, or
    read as a transfer no frame names; never a crash, never a huge allocation."""
    rng = np.random.default_rng(seed)
    with _FacingRawPeer(max_message_size=64 * MiB) as (channel, theirs, broken):
        count = int(rng.integers(0, 1 << 32))
        sizes = rng.integers(0, 1 << 63, size=min(count, 4), dtype=np.uint64)
        theirs.sendall(bulk._TRANSFER.pack(1, count) + sizes.tobytes() + rng.bytes(4096))
        theirs.close()
        with pytest.raises(ProtocolError):
            channel.claim(1, [0])
        assert len(broken) == 1
        assert "buffers" in str(broken[0]) or "max_message_size" in str(broken[0])


def test_a_claim_fails_when_no_byte_comes_for_peer_timeout():
    with _FacingRawPeer(peer_timeout=1.0) as (channel, theirs, broken):
        theirs.sendall(bulk._TRANSFER.pack(9, 1) + bulk._SIZE.pack(MiB) + bytes(1000))
        with pytest.raises(ProtocolError, match="stopped for 1 s"):
            channel.claim(9, [MiB])  # the rest never comes: the peer froze
        assert channel.error is not None  # the socket is ended (the failed claim ends the stream)


def test_a_dialer_whose_dial_failed_sends_whole_frames_and_refuses_bulk_frames():
    def dial(index: int, count: int) -> socket.socket:
        raise ConnectionRefusedError("no bulk port there")

    channel = bulk.Channel("peer", "test-{}", 0, 8.0, dial=dial)
    stream: list[list] = []
    frame = _frame(_random(2 * MiB, 6))
    assert channel.send(frame, stream.append) is False  # and it dials, in the background
    assert stream == [frame]
    # The dial's own failure, not the wait for a socket that never came.
    with pytest.raises(ProtocolError, match="no bulk port there"):
        channel.claim(1, [2 * MiB])
    assert channel.send(frame, stream.append) is False and stream == [frame, frame]


def test_the_frame_reader_takes_a_bulk_frames_buffers_from_its_claim():
    claimed: list[tuple[int, list[int]]] = []
    buffer = _random(MiB, 7)

    def claim(transfer: int, sizes: list[int]) -> list[np.ndarray]:
        claimed.append((transfer, sizes))
        return [buffer]

    first = wire.with_bulk(_frame(buffer)[0], 42)
    for cut in (len(first), 5):  # whole in one packet, and cut anywhere
        reader = wire.FrameReader(0, claim=claim)
        frames = [f for i in range(0, len(first), cut) for f in reader.feed(first[i : i + cut])]
        assert len(frames) == 1 and bytes(frames[0].payload) == b"pay"
        assert frames[0].buffers[0] is buffer
    assert claimed == [(42, [MiB]), (42, [MiB])]
    with pytest.raises(ProtocolError, match="without a bulk socket"):
        wire.FrameReader(0).feed(first)


# -- The opening exchange ------------------------------------------------------------
def _listener(token: auth.Token | None, streams: dict[bytes, bulk.Channel]) -> bulk_open.Listener:
    return bulk_open.Listener("127.0.0.1", 1, token, lambda rank, key: streams.get(key))


def test_dialers_past_the_ones_being_proved_are_closed_unheard_and_a_slot_frees_with_one(
    monkeypatch,
):
    # The port is on the network: silent dialers hold a thread each for the
    # handshake's limit, so only OPENING of them at once.
    monkeypatch.setattr(bulk_open.Listener, "OPENING", 2)
    key = bulk_open.new_key()
    served = bulk.Channel("rank 0", "test-served-{}", 0, 8.0)
    listener = _listener(auth.Token("s3cret"), {key: served})
    silent = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(2)]
    try:
        extra = socket.create_connection(("127.0.0.1", listener.port))
        extra.settimeout(30)
        start = time.monotonic()
        assert extra.recv(1) == b""  # closed, with no thread started for it ...
        assert time.monotonic() - start < bulk_open.HANDSHAKE_TIMEOUT / 2  # ... at once
        extra.close()
        silent.pop().close()  # its handshake fails at once: its slot frees
        deadline = time.monotonic() + 30
        while True:  # the slot frees once that thread ends: retry until it did
            try:
                sock = bulk_open.dial("127.0.0.1", listener.port, (0, 1), auth.Token("s3cret"), key)
                break
            except (OSError, ConnectionError):
                assert time.monotonic() < deadline
        sock.close()
    finally:
        for sock in silent:
            sock.close()
        served.close()
        listener.stop()


def test_a_dialer_with_the_token_and_the_streams_key_is_bound(monkeypatch):
    key = bulk_open.new_key()
    served = bulk.Channel("rank 0", "test-served-{}", 0, 8.0)
    listener = _listener(auth.Token("s3cret"), {key: served})
    try:
        sock = bulk_open.dial("127.0.0.1", listener.port, (0, 1), auth.Token("s3cret"), key)
        dialer = bulk.Channel("worker1", "test-dialer-{}", 0, 8.0)
        assert dialer.bind(sock)
        stream: list[list] = []
        buffer = _random(2 * MiB, 8)
        dialer.send(_frame(buffer), stream.append)
        got = served.claim(_envelope(stream[0][0]).bulk, [2 * MiB])
        assert np.array_equal(got[0], buffer)
        dialer.close()
    finally:
        served.close()
        listener.stop()


@pytest.mark.parametrize(
    "case", ["wrong token", "no token", "unknown stream", "wrong rank", "socket past the count"]
)
def test_a_dialer_that_cannot_prove_itself_or_names_no_stream_is_refused(monkeypatch, case):
    monkeypatch.setattr(bulk_open, "FIND_WAIT", 0.1)
    key = bulk_open.new_key()
    served = bulk.Channel("rank 0", "test-served-{}", 0, 8.0)
    listener = _listener(auth.Token("s3cret"), {key: served})
    token, name, ranks, index = auth.Token("s3cret"), key, (0, 1), 0
    if case == "wrong token":
        token = auth.Token("guess")
    elif case == "no token":
        token = None
    elif case == "unknown stream":
        name = bulk_open.new_key()
    elif case == "wrong rank":
        ranks = (0, 2)  # the listener is rank 1
    else:
        index = 2
    try:
        with pytest.raises((AuthenticationError, OSError)):
            bulk_open.dial("127.0.0.1", listener.port, ranks, token, name, index, 2, timeout=5)
        assert not served.bound
    finally:
        served.close()
        listener.stop()


def test_sockets_bind_one_by_one_and_a_failed_second_dial_leaves_frames_whole():
    """Bound once every socket is; if a later dial fails, both ends carry
    every frame whole, and the stream is not ended."""
    key = bulk_open.new_key()
    served_broken: list[BaseException] = []
    served = bulk.Channel("rank 0", "test-served-{}", 0, 8.0, on_broken=served_broken.append)
    listener = _listener(None, {key: served})

    def dial(index: int, count: int) -> socket.socket:
        if index == 1:
            raise ConnectionRefusedError("the second socket was refused")
        return bulk_open.dial("127.0.0.1", listener.port, (0, 1), None, key, index, count)

    dialer = bulk.Channel("worker1", "test-dialer-{}", 0, 8.0, dial=dial, sockets=2)
    try:
        stream: list[list] = []
        frame = _frame(_random(2 * MiB, 11))
        assert dialer.send(frame, stream.append) is False  # whole; it dials
        with served._lock:  # the first socket was bound, then closed by the dialer
            assert served._lock.wait_for(lambda: served.error is not None, 10)
        assert not served.bound and not dialer.bound and served_broken == []
        assert dialer.send(frame, stream.append) is False and stream == [frame, frame]
        assert served.send(frame, stream.append) is False
    finally:
        dialer.close()
        served.close()
        listener.stop()


# -- Workers -------------------------------------------------------------------------
# Two workers of one host with the lane and shared memory off: their large
# tensors go over the bulk socket, as between two hosts.
GRPC_ONLY = {"RRPC_LANE": "0", "RRPC_SHM": "0"}


def _echo(value):
    return value


def _bulk_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("rrpc-bulk-"))


def _echoes(rank, world_size):
    if rank != 0:
        return None
    generator = torch.Generator().manual_seed(3)
    sent = [
        torch.randn(2 * MiB // 4, generator=generator),  # over the socket
        torch.randint(0, 1000, (3, MiB // 8), generator=generator),  # int64, 2-D
        torch.randn(100, generator=generator),  # small: in the stream
    ]
    results = [torch.equal(rrpc.rpc_sync("worker1", _echo, args=(t,)), t) for t in sent]
    together = rrpc.rpc_sync("worker1", _echo, args=(sent,))  # one frame, three buffers
    results.append(all(torch.equal(a, b) for a, b in zip(together, sent, strict=True)))
    futures = [rrpc.rpc_async("worker1", torch.add, args=(sent[0], i)) for i in range(4)]
    results.append(all(torch.equal(f.wait(), sent[0] + i) for i, f in enumerate(futures)))
    return results, _bulk_threads()


@pytest.mark.parametrize("sockets", [None, "1", "3"])
def test_large_tensors_echo_exactly_over_the_bulk_socket(sockets):
    env = GRPC_ONLY if sockets is None else {**GRPC_ONLY, "RRPC_BULK_SOCKETS": sockets}
    results, threads = run_workers(_echoes, env=env)[0]
    assert all(results), results
    # Two sockets by default (bulk_sockets), a reader and a writer each.
    count = 2 if sockets is None else int(sockets)
    assert threads.count("rrpc-bulk-recv-worker1") == count
    assert threads.count("rrpc-bulk-send-worker1") == count


def _slot_and_streamed(rank, world_size):
    if rank != 0:
        return None
    big = torch.arange(100_000, dtype=torch.float32)  # 400 KB: a shared-memory slot
    small = [torch.full((60_000,), float(i)) for i in range(5)]  # 1.2 MB in the stream
    # The first call asks for the bulk socket; the later ones find it bound.
    return [
        all(
            torch.equal(a, b)
            for a, b in zip(
                rrpc.rpc_sync("worker1", _echo, args=((big, *small),)), (big, *small), strict=True
            )
        )
        for _ in range(4)
    ]


def test_a_message_with_a_slot_and_a_streamed_megabyte_crosses_a_same_host_grpc_stream():
    # The lane off, shared memory on: its frame names a slot, so it stays whole.
    assert run_workers(_slot_and_streamed, env={"RRPC_LANE": "0"})[0] == [True] * 4


def _recycled_echoes(rank, world_size):
    if rank != 0:
        return None
    elements = (bulk.RECYCLE_MIN + 4 * MiB) // 4  # float32: received into recycled memory

    def tensor(seed):
        return torch.randn(elements, generator=torch.Generator().manual_seed(seed))

    # Results kept while more arrive: none may be received over another.
    kept = [(seed, rrpc.rpc_sync("worker1", _echo, args=(tensor(seed),))) for seed in range(3)]
    intact = [torch.equal(result, tensor(seed)) for seed, result in kept]
    del kept  # their memory comes back, and the next replies are received into it
    again = [
        torch.equal(rrpc.rpc_sync("worker1", _echo, args=(tensor(s),)), tensor(s)) for s in (3, 4)
    ]
    return intact, again, bulk.recycled.kept() > 0


def test_large_results_kept_or_dropped_over_the_bulk_socket_stay_exact():
    intact, again, recycling = run_workers(_recycled_echoes, env=GRPC_ONLY)[0]
    assert intact == [True, True, True] and again == [True, True]
    assert recycling  # the dropped results' memory was kept for the next ones


@pytest.mark.parametrize("how", ["env", "option", "tensorpipe_channels"])
def test_a_bulk_socket_switched_off_is_never_dialed(how):
    env, options = dict(GRPC_ONLY), None
    if how == "env":
        env["RRPC_BULK"] = "0"
    elif how == "option":
        options = rrpc.RpcBackendOptions(bulk_channel=False)
    else:
        options = rrpc.TensorPipeRpcBackendOptions(_channels=["basic"])
    results, threads = run_workers(_echoes, env=env, backend_options=options)[0]
    assert all(results), results
    assert threads == []


_release = []  # worker1's copy of the test's release Event


def _echo_after_release(value):
    _release[0].wait(30)
    return value


def _break_mid_call(rank, world_size, release):
    _release.append(release)
    if rank != 0:
        return None
    big = torch.randn(2 * MiB // 4)
    assert torch.equal(rrpc.rpc_sync("worker1", _echo, args=(big,)), big)  # opens the socket
    pending = rrpc.rpc_async("worker1", _echo_after_release, args=(big,))
    agent = current_agent()
    connection = agent.routes._connections[agent.worker_info("worker1").id]
    connection._bulk._socks[0].shutdown(socket.SHUT_RDWR)  # the socket breaks under the call
    try:
        pending.wait()
        error = None
    except rrpc.PeerUnavailableError as exc:
        error = str(exc)
    release.set()
    after = rrpc.rpc_sync("worker1", _echo, args=(big,))
    return error, torch.equal(after, big)


def test_a_bulk_socket_that_breaks_mid_call_fails_that_call_naming_the_peer_and_the_next_works():
    error, echoed = run_workers(_break_mid_call, args=(mp_context.Event(),), env=GRPC_ONLY)[0]
    assert error is not None and "worker1" in error and "bulk" in error
    assert echoed


def _across_hosts(rank, world_size, pair, results):
    host = pair.b if rank == 1 else pair.a
    netns.enter(host.netns)  # before any socket is opened
    os.environ.update(MASTER_ADDR=pair.a.address, RRPC_ADVERTISE_HOST=host.address)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        big = torch.randn(4 * MiB // 4)
        echoed = [torch.equal(rrpc.rpc_sync("worker1", _echo, args=(big,)), big) for _ in range(3)]
        results.put((echoed, _bulk_threads()))
    rrpc.shutdown()


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_two_hosts_carry_large_tensors_over_the_bulk_socket():
    results = mp_context.Queue()
    with netns.VethPair.create() as pair:
        before = sum(pair.link_bytes())
        run_workers(
            _across_hosts,
            args=(pair, results),
            init=False,
            timeout=90,
            # /dev/shm is shared across network namespaces: off, as between two machines.
            env={"RRPC_LANE": "1", "RRPC_SHM": "0"},
        )
        crossed = sum(pair.link_bytes()) - before
    echoed, threads = results.get(timeout=5)
    assert echoed == [True, True, True]
    assert "rrpc-bulk-recv-worker1" in threads
    assert crossed >= 6 * 4 * MiB  # three round trips of 4 MiB crossed the link


def test_bulk_sockets_is_bounded():
    assert rrpc.RpcBackendOptions(bulk_sockets=1).bulk_sockets == 1
    for wrong in (0, bulk.MAX_SOCKETS + 1):
        with pytest.raises(ValueError, match="bulk_sockets"):
            rrpc.RpcBackendOptions(bulk_sockets=wrong)
