"""The callee's end of gRPC streams on grpcio's core API (``rrpc.grpc_serve``),
against the caller's end (``rrpc.grpc_call``) in this process: who polls,
the ends, and a method that is not served."""

import gc
import queue
import threading

import grpc
import pytest

import rrpc
from harness import read_stream, run_workers
from rrpc import grpc_call, grpc_serve

METHOD = "/test.Echo/Exchange"


def _listening(spin: float = 0.0):
    """A listener whose streams land on a queue, and a channel to it; its
    streams' readers spin ``spin`` seconds for the next request."""
    streams: queue.SimpleQueue = queue.SimpleQueue()
    listener = grpc_serve.Listener(
        "127.0.0.1:0", METHOD, [], None, streams.put, 1 << 20, "test", spin=spin
    )
    listener.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{listener.port}")
    yield channel, streams
    channel.close()
    listener.stop(grace=None)


@pytest.fixture
def served_streams():
    yield from _listening()


@pytest.fixture
def spinning_streams():
    yield from _listening(spin=5.0)  # far longer than the caller takes to send


class _CountingQueue:
    """A stream's completion queue, counting the polls that look (a past
    deadline: back at once) and those that sleep (no deadline)."""

    def __init__(self, queue):
        self._queue = queue
        self.looks = 0
        self.sleeps = 0
        self.looked = threading.Event()

    def poll(self, deadline=None):
        if deadline is None:
            self.sleeps += 1
        else:
            self.looks += 1
            self.looked.set()
        return self._queue.poll(deadline)


def _served_with_first_packet(channel, streams):
    """A stream whose first packet its reader took, its polls counted."""
    call = grpc_call.Call(channel, METHOD, [])
    read_stream(call)
    call.send(b"first")
    served = streams.get(timeout=10)
    packets = served.packets()
    assert next(packets) == b"first"
    counting = served._queue = _CountingQueue(served._queue)
    return call, packets, counting


@pytest.mark.timeout(60)
def test_a_reader_spinning_for_the_next_request_takes_it_without_sleeping(spinning_streams):
    call, packets, counting = _served_with_first_packet(*spinning_streams)
    second: queue.SimpleQueue = queue.SimpleQueue()
    reader = threading.Thread(target=lambda: second.put(next(packets)), daemon=True)
    reader.start()
    assert counting.looked.wait(10)  # the reader looks for the next request: send it now
    call.send(b"second")
    assert second.get(timeout=10) == b"second"
    assert counting.sleeps == 0


@pytest.mark.timeout(60)
def test_a_reader_without_spin_sleeps_until_the_next_request(served_streams):
    call, packets, counting = _served_with_first_packet(*served_streams)
    call.send(b"second")
    assert next(packets) == b"second"
    # (A completion still owed, the initial metadata's, may take a sleep of its own.)
    assert counting.looks == 0 and counting.sleeps >= 1


@pytest.mark.timeout(60)
def test_replies_sent_while_no_reader_polls_still_go_out(served_streams):
    """A reply's send completes only as someone takes the stream's events:
    with its readers busy elsewhere, the sending thread does."""
    channel, streams = served_streams
    call = grpc_call.Call(channel, METHOD, [("k", "v")])
    replies, _ = read_stream(call)
    call.send(b"hello")
    served = streams.get(timeout=10)
    assert served.metadata["k"] == "v"
    assert next(served.packets()) == b"hello"
    # Nobody reads the stream now (its reader "runs a request"): ten replies
    # in a row, each but the first waiting for the send before it.
    for i in range(10):
        served.send(b"reply%d;" % i)
    got = b""
    while got.count(b";") < 10:
        got += replies.get(timeout=10)
    assert got == b"".join(b"reply%d;" % i for i in range(10))


@pytest.mark.timeout(60)
def test_a_half_closed_stream_ends_its_packets_and_its_status_reaches_the_caller(
    served_streams,
):
    channel, streams = served_streams
    call = grpc_call.Call(channel, METHOD, [])
    replies, reader = read_stream(call)
    over = threading.Event()
    call.send(b"only")
    call.close_sending()
    served = streams.get(timeout=10)
    served.on_over(over.set)
    assert list(served.packets()) == [b"only"]  # then the caller half-closed
    served.send(b"answer")
    served.finish(grpc.StatusCode.DATA_LOSS, "as the test says")
    assert replies.get(timeout=10) == b"answer"
    ended = replies.get(timeout=10)
    assert isinstance(ended, grpc_call.StreamEnded)
    assert ended.code() is grpc.StatusCode.DATA_LOSS and ended.details() == "as the test says"
    reader.join(10)
    assert over.wait(10)  # the drain thread saw the stream's end


@pytest.mark.timeout(60)
def test_a_caller_that_cancels_ends_the_callees_stream(served_streams):
    channel, streams = served_streams
    call = grpc_call.Call(channel, METHOD, [])
    read_stream(call)
    call.send(b"first")
    served = streams.get(timeout=10)
    over = threading.Event()
    served.on_over(over.set)
    packets = served.packets()
    assert next(packets) == b"first"
    call.cancel("going away")
    # The read in progress ends (gRPC's core may report the cancel as the
    # end of the caller's messages, before it reports the stream's end) ...
    with pytest.raises((grpc_call.StreamEnded, StopIteration)):
        next(packets)
    assert over.wait(10)  # ... and the stream ends, with nothing more to send
    with pytest.raises(grpc_call.StreamEnded):
        served.send(b"too late")


@pytest.mark.timeout(60)
def test_a_method_not_served_is_refused_unimplemented(served_streams):
    channel, streams = served_streams
    call = grpc_call.Call(channel, "/test.Echo/Other", [])
    replies, _ = read_stream(call)
    ended = replies.get(timeout=10)
    assert isinstance(ended, grpc_call.StreamEnded)
    assert ended.code() is grpc.StatusCode.UNIMPLEMENTED
    assert streams.empty()


def _served_spins():
    """This worker's incoming gRPC streams' spins (their readers' ``spin.Spin``)."""
    return sorted({o._spin.spin for o in gc.get_objects() if isinstance(o, grpc_serve.Served)})


def _spins_of_the_callee(rank, world_size):
    if rank != 0:
        return None
    return rrpc.rpc_sync("worker1", _served_spins)


@pytest.mark.timeout(120)
def test_grpc_spin_reaches_the_readers_of_a_workers_streams():
    env = {"RRPC_LANE": "0", "RRPC_GRPC_SPIN": "0.004"}  # calls over gRPC, a spin of 4 ms
    assert run_workers(_spins_of_the_callee, env=env)[0] == [0.004]
