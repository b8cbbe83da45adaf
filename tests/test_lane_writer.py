"""A lane's ``Writer``: frames from many threads reach the socket whole, in
each thread's order, and a thread that finds another one sending leaves its
frame to it instead of waiting for the socket (writers combine)."""

from __future__ import annotations

import select
import socket
import struct
import threading

import pytest

from rrpc import lane_io
from rrpc.lane_io import LaneBroken, Writer

FRAME = struct.Struct("<HI")  # the writing thread, its frame's number


class HeldSocket:
    """A socket stand-in whose first ``sendmsg`` waits until ``go`` is set,
    so that a test can act while a thread is inside it."""

    def __init__(self, first_fails: bool = False) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()
        self.first_fails = first_fails
        self.calls = 0
        self.sent: list[bytes] = []  # what each sendmsg call carried

    def sendmsg(self, pieces: list) -> int:
        self.calls += 1
        if self.calls == 1:
            self.inside.set()
            assert self.go.wait(30)
            if self.first_fails:
                raise BrokenPipeError(32, "Broken pipe")
        data = b"".join(bytes(piece) for piece in pieces)
        self.sent.append(data)
        return len(data)


def test_a_thread_that_finds_another_sending_leaves_its_frame_to_it():
    sock = HeldSocket()
    writer = Writer(sock, "test", limit=1 << 20)  # type: ignore[arg-type]
    first = threading.Thread(target=writer.write, args=([b"first"],))
    first.start()
    assert sock.inside.wait(30)
    # The first thread is inside sendmsg, holding the socket: these return at once.
    writer.write([b"second"])
    writer.write([b"third", b"+"])
    assert sock.sent == []
    sock.go.set()
    first.join(30)
    # The first thread sent the others' frames, in their order, in one call.
    assert sock.sent == [b"first", b"secondthird+"]


def test_frames_left_to_a_thread_whose_send_fails_are_dropped_and_the_next_write_raises():
    sock = HeldSocket(first_fails=True)
    writer = Writer(sock, "test", limit=1 << 20)  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def write_first() -> None:
        try:
            writer.write([b"first"])
        except LaneBroken as exc:
            raised.append(exc)

    first = threading.Thread(target=write_first)
    first.start()
    assert sock.inside.wait(30)
    writer.write([b"second"])  # left to the first thread, whose send then fails
    sock.go.set()
    first.join(30)
    assert raised and "Broken pipe" in str(raised[0])
    with pytest.raises(LaneBroken):
        writer.write([b"third"])
    assert sock.sent == [] and sock.calls == 1  # nothing written after the failure


@pytest.mark.timeout(60)
def test_frames_of_many_threads_arrive_whole_and_in_each_threads_order():
    threads, frames_each, payload = 16, 400, b"x" * 300
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    # A small buffer: some frames wait in the backlog for the sender thread.
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    writer = Writer(ours, "test", limit=1 << 30)
    frame_size = FRAME.size + len(payload)
    expected = threads * frames_each * frame_size
    received = bytearray()

    def read() -> None:
        while len(received) < expected:
            chunk = theirs.recv(1 << 16)
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    start = threading.Barrier(threads)

    def write(number: int) -> None:
        start.wait()
        for index in range(frames_each):
            writer.write([FRAME.pack(number, index), payload])

    writers = [threading.Thread(target=write, args=(n,)) for n in range(threads)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    reader.join(50)
    ours.close()
    theirs.close()
    assert len(received) == expected
    next_index = [0] * threads
    for offset in range(0, expected, frame_size):
        number, index = FRAME.unpack_from(received, offset)
        assert received[offset + FRAME.size : offset + frame_size] == payload
        assert index == next_index[number], f"thread {number}: frame {index} out of order"
        next_index[number] += 1
    assert next_index == [frames_each] * threads


def test_waiting_on_a_socket_another_thread_closed_returns_for_the_next_try_to_fail():
    # The backlog's sender waits for room between sends; the lane may break
    # (its socket closed by another thread) right before it waits.
    ours, theirs = socket.socketpair()
    theirs.close()
    ours.close()
    lane_io.wait(ours, select.POLLOUT, 10_000)  # at once, and no ValueError
    with pytest.raises(OSError):
        ours.sendmsg([b"x"])
