"""Two readers of one stream: a lone request runs on its reader, which lends it the read role.

Driven with plain packets and threads, no processes: ``turns.TakeTurns``
knows neither gRPC nor sockets.
"""

from __future__ import annotations

import queue
import threading

import pytest

from rrpc import codec, futures, turns, wire
from rrpc.messages import thread_state


def _packet(name: str) -> bytes:
    return b"".join(codec.encode(3, 1, name).pieces)


class _Packets:
    """A stream whose packets the test hands in one at a time; ``end()`` half-closes it."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, name: str) -> None:
        self._queue.put(_packet(name))

    def end(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        packet = self._queue.get(timeout=30)
        if packet is None:
            self._queue.put(None)  # both readers see the end
            raise StopIteration
        return packet


def _serve(on_request, readable=None):
    """Two readers over a fresh stream; each request goes to ``on_request(name, inline)``.
    ``readable(packets)``: the carrier's probe of bytes waiting, if it has one."""
    packets = _Packets()
    readers = turns.TakeTurns(
        packets,
        wire.FrameReader(),
        lambda frame, inline: on_request(codec.loads(frame), inline),
        readable=None if readable is None else lambda: readable(packets),
    )
    threads = [
        threading.Thread(target=readers.run, name=f"reader-{i}", daemon=True) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    return packets, threads


def _finish(packets, threads):
    packets.end()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()


@pytest.mark.timeout(60)
def test_sequential_requests_run_inline_on_one_reader_and_wake_nobody():
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline, threading.current_thread().name))

    packets, threads = _serve(on_request)
    seen = []
    for i in range(50):
        packets.send(f"call {i}")
        seen.append(ran.get(timeout=30))  # the caller waits for each reply: sequential
    _finish(packets, threads)
    assert [name for name, _, _ in seen] == [f"call {i}" for i in range(50)]
    assert all(inline for _, inline, _ in seen)
    # The reader that ran a request read the next one too: the role was lent, not passed.
    assert len({thread for _, _, thread in seen}) == 1


@pytest.mark.timeout(60)
def test_a_long_request_has_its_reading_taken_over_and_the_next_one_goes_to_the_pool():
    release = threading.Event()
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline, threading.current_thread().name))
        if name == "long":
            assert release.wait(30)  # not an RPC: only the partner's clock relieves it

    packets, threads = _serve(on_request)
    packets.send("long")
    long_name, long_inline, long_thread = ran.get(timeout=30)
    packets.send("next")
    # Read by the partner (within STANDBY_WAIT + HANDOFF_AFTER), while "long" still runs.
    next_name, next_inline, next_thread = ran.get(timeout=10)
    release.set()
    _finish(packets, threads)
    assert (long_name, long_inline) == ("long", True)
    assert (next_name, next_inline) == ("next", False)  # a request runs already: the pool
    assert next_thread != long_thread


@pytest.mark.timeout(60)
def test_a_long_request_keeps_its_reader_while_nothing_waits_to_be_read():
    # A sequential caller: its next request comes after the reply. A takeover
    # would only move that request to the other thread (cold caches, another
    # OpenMP team).
    release, probed = threading.Event(), threading.Semaphore(0)
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline, threading.current_thread().name))
        if name == "long":
            assert release.wait(30)

    def readable(packets):
        probed.release()  # the partner looked, past HANDOFF_AFTER
        return not packets._queue.empty()

    packets, threads = _serve(on_request, readable)
    packets.send("long")
    long_name, _, long_thread = ran.get(timeout=30)
    for _ in range(3):  # the partner looked three times and found nothing to read
        assert probed.acquire(timeout=10)
    release.set()
    packets.send("next")
    next_name, next_inline, next_thread = ran.get(timeout=10)
    _finish(packets, threads)
    assert (next_name, next_inline, next_thread) == ("next", True, long_thread)


@pytest.mark.timeout(60)
def test_a_long_request_has_its_reading_taken_over_once_bytes_wait():
    release = threading.Event()
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline, threading.current_thread().name))
        if name == "long":
            assert release.wait(30)

    packets, threads = _serve(on_request, lambda packets: not packets._queue.empty())
    packets.send("long")
    long_name, _, long_thread = ran.get(timeout=30)
    packets.send("next")
    next_name, next_inline, next_thread = ran.get(timeout=10)  # while "long" still runs
    release.set()
    _finish(packets, threads)
    assert (next_name, next_inline) == ("next", False)
    assert next_thread != long_thread


@pytest.mark.timeout(60)
def test_a_request_that_waits_for_an_rpc_hands_reading_over_at_once():
    handed_over = threading.Event()
    reply = threading.Event()
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline))
        if name == "nested":
            # As a request that calls rpc_sync: futures.blocking hands the reading off.
            futures.blocking(lambda: handed_over.set() or reply.wait(30))
        elif name == "reply":
            reply.set()

    packets, threads = _serve(on_request)
    packets.send("nested")
    assert ran.get(timeout=30) == ("nested", True)
    assert handed_over.wait(30)
    packets.send("reply")  # what the nested call waits for comes on the same stream
    assert ran.get(timeout=30) == ("reply", False)
    _finish(packets, threads)


@pytest.mark.timeout(60)
def test_the_hand_off_is_set_only_while_a_request_runs_inline():
    seen = []
    packets, threads = _serve(lambda name, inline: seen.append((name, thread_state.hand_off)))
    packets.send("a")
    _finish(packets, threads)
    [(name, hand_off)] = seen
    assert name == "a" and hand_off is not None


@pytest.mark.timeout(60)
def test_a_partner_that_takes_over_mid_packet_hands_on_the_rest_of_it_in_order():
    release = threading.Event()
    ran = queue.SimpleQueue()

    def on_request(name, inline):
        ran.put((name, inline))
        if name == "a":
            assert release.wait(30)

    packets = _Packets()
    readers = turns.TakeTurns(
        packets, wire.FrameReader(), lambda frame, inline: on_request(codec.loads(frame), inline)
    )
    threads = [threading.Thread(target=readers.run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    packets._queue.put(b"".join(_packet(name) for name in ("a", "b", "c")))
    seen = [ran.get(timeout=30) for _ in range(3)]  # b and c while a still runs
    release.set()
    _finish(packets, threads)
    assert seen == [("a", True), ("b", False), ("c", False)]


@pytest.mark.timeout(60)
def test_a_stream_that_ends_mid_packet_hands_on_nothing_after_it_to_either_reader():
    ran = []
    admitted = []

    def admit(frame):
        name = codec.loads(wire.Frame(frame.envelope, frame.payload, list(frame.buffers)))
        admitted.append(name)
        return name != "b"  # the stream ends while "b" waits for admission

    packets = _Packets()
    readers = turns.TakeTurns(
        packets,
        wire.FrameReader(),
        lambda frame, inline: ran.append(codec.loads(frame)),
        admit=admit,
    )
    threads = [threading.Thread(target=readers.run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    packets._queue.put(b"".join(_packet(name) for name in ("a", "b", "c")))
    for thread in threads:  # both end by themselves: the stream is closed
        thread.join(30)
        assert not thread.is_alive()
    assert ran == ["a"]
    assert admitted == ["a", "b"]
