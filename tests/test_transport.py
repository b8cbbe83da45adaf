"""The streams without sockets: the sending side (``outbox.Outbox``:
batching, lingering, ending), the readers' turns, and the bound on a peer's
requests in flight; and one real gRPC stream, for who sends its replies."""

import queue
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from harness import pushed
from rrpc import codec, options, streams, transport, turns, wire
from rrpc._proto.rrpc_pb2 import Envelope
from rrpc.messages import ProtocolError
from rrpc.outbox import Outbox
from rrpc.scheduler import Scheduler


def _frame(i: int) -> list[bytes]:
    return [f"frame{i:03d};".encode()]


def _outbox(open_exchanges: int, delay: float = 300e-6, min_open: int = 16):
    """An outbox with ``open_exchanges`` requests sent and unanswered, nothing
    queued, and the list it sends its packets into from now on."""
    outbox = Outbox(packet_size=1 << 20, batch_delay=delay, batch_min_open=min_open)
    for i in range(open_exchanges):
        outbox.put(_frame(i))
    packets, _ = pushed(outbox)
    packets.clear()
    return outbox, packets


def test_frames_queued_together_go_out_as_one_packet():
    outbox = Outbox(packet_size=1 << 20)
    for i in range(5):
        outbox.put(_frame(i))
    assert pushed(outbox)[0] == [b"".join(piece for i in range(5) for piece in _frame(i))]


def test_under_load_the_sender_lingers_and_takes_what_arrived_meanwhile():
    outbox, packets = _outbox(open_exchanges=20)
    lingered = []

    def sleep(seconds):  # frames arriving while the sender lingers
        lingered.append(seconds)
        for i in range(1, 8):
            outbox.put(_frame(100 + i))

    outbox.sleep = sleep
    outbox.put(_frame(100))
    assert lingered == [300e-6]
    assert len(packets) == 1 and packets[0].count(b";") == 8  # one gRPC message for all eight


def test_a_lone_call_never_waits():
    outbox, packets = _outbox(open_exchanges=3)
    outbox.sleep = lambda seconds: pytest.fail("lingered with only a few calls open")
    outbox.put(_frame(0))
    assert packets == [_frame(0)[0]]


def test_zero_delay_turns_lingering_off():
    outbox, packets = _outbox(open_exchanges=40, delay=0.0)
    outbox.sleep = lambda seconds: pytest.fail("lingered with batch_delay=0")
    outbox.put(_frame(0))
    assert packets == [_frame(0)[0]]


def test_open_exchanges_count_frames_sent_against_frames_received():
    outbox = Outbox(packet_size=1 << 20)
    for i in range(10):
        outbox.put(_frame(i))
    outbox.received += 4
    assert outbox.open_exchanges() == 6
    outbox.received += 10  # a server: more requests received than replies sent
    assert outbox.open_exchanges() == 4


def test_end_sends_what_is_queued_then_stops():
    outbox = Outbox(packet_size=1 << 20)
    outbox.put(_frame(0))
    outbox.put(_frame(1))
    outbox.end()
    assert pushed(outbox) == ([_frame(0)[0] + _frame(1)[0]], [None])


def test_end_with_an_error_sends_what_is_queued_then_raises_it():
    outbox = Outbox(packet_size=1 << 20)
    outbox.put(_frame(0))
    outbox.end(ProtocolError("malformed"))
    packets, ends = pushed(outbox)
    assert packets == [_frame(0)[0]]
    assert len(ends) == 1 and isinstance(ends[0], ProtocolError) and "malformed" in str(ends[0])


def test_batch_delay_has_an_env_switch_and_a_sane_range(monkeypatch):
    monkeypatch.setenv("RRPC_BATCH_DELAY", "0")
    assert options.RpcBackendOptions().batch_delay == 0.0
    monkeypatch.delenv("RRPC_BATCH_DELAY")
    assert options.RpcBackendOptions().batch_delay > 0
    with pytest.raises(ValueError, match="batch_delay"):
        options.RpcBackendOptions(batch_delay=1.0)


# -- Taking turns reading an incoming stream ------------------------------------
def _packet(*names: str) -> bytes:
    return b"".join(b"".join(codec.encode(3, 1, name).pieces) for name in names)


def _turns(packets, waiting_partner: bool):
    """Run one reader over ``packets`` on this thread; without ``waiting_partner``
    as if the other reader were running a request. Returns what it did."""
    outbox = Outbox(packet_size=1 << 20)
    seen = []
    readers = turns.TakeTurns(
        iter(packets),
        wire.FrameReader(),
        lambda frame, inline: seen.append((codec.loads(frame), inline)),
        outbox=outbox,
    )
    readers._running = 0 if waiting_partner else 1
    readers.run()
    return seen, outbox


def test_a_lone_request_runs_on_the_thread_that_read_it_when_the_partner_reads_on():
    seen, _ = _turns([_packet("a")], waiting_partner=True)
    assert seen == [("a", True)]


def test_without_a_free_partner_every_request_goes_to_the_pool():
    seen, _ = _turns([_packet("a"), _packet("b")], waiting_partner=False)
    assert seen == [("a", False), ("b", False)]


def test_the_requests_of_a_batched_packet_run_inline_one_after_another_in_order():
    # The read role is lent to each in turn: a partner that takes it over from
    # one that runs long goes on with the rest (tests/test_turns.py).
    seen, _ = _turns([_packet("a", "b", "c")], waiting_partner=True)
    assert seen == [("a", True), ("b", True), ("c", True)]


def test_a_malformed_packet_ends_the_stream_with_its_error():
    seen, outbox = _turns([_packet("a"), b"\xff\xff\xff\x7fgarbage"], waiting_partner=True)
    assert seen == [("a", True)]
    _, ends = pushed(outbox)
    assert len(ends) == 1 and isinstance(ends[0], ProtocolError)


def test_a_packet_of_many_frames_is_handed_out_in_order_without_keeping_any():
    # One packet of 20,000 tiny frames (a flood from one peer): each frame is
    # handed out once, in order, and the reader keeps no reference to it
    # afterwards (pop(0) on the list made such a packet cost N squared).
    frames = [b"".join(bytes(p) for p in codec.encode(10, i, i).pieces) for i in range(20_000)]
    outbox = Outbox(1 << 20)
    seen: list[int] = []
    previous: list[weakref.ref] = []
    held: list[int] = []

    def on_frame(frame: wire.Frame) -> None:
        if previous and previous[0]() is not None:
            held.append(frame.envelope.request_id)  # the frame before is still referenced
        seen.append(frame.envelope.request_id)
        previous[:] = [weakref.ref(frame)]

    streams.hand_frames(b"".join(frames), wire.FrameReader(), on_frame, outbox)
    assert seen == list(range(20_000))
    assert outbox.received == 20_000
    assert held == []


# -- Requests in flight per peer --------------------------------------------------
def test_a_peer_at_its_bound_waits_until_one_of_its_requests_is_taken_up():
    in_flight = streams.InFlight(limit=2)
    assert in_flight.take(1, lambda: False) and in_flight.take(1, lambda: False)
    at_bound, taken = threading.Event(), threading.Event()

    def at_the_bound() -> bool:
        # take() asks whether the stream ended under its lock, right before it
        # waits: once this is set, give() (which needs the lock) finds it waiting.
        at_bound.set()
        return False

    def third():
        in_flight.take(1, at_the_bound)
        taken.set()

    waiter = threading.Thread(target=third)
    waiter.start()
    assert at_bound.wait(30)
    assert not taken.is_set()  # at the bound: it waits
    in_flight.give()  # a pool thread decoded one
    assert taken.wait(30)
    waiter.join(30)
    assert in_flight.count == 2


def test_a_reader_waiting_at_the_bound_gives_up_when_its_stream_ends():
    in_flight = streams.InFlight(limit=1)
    in_flight.take(1, lambda: False)
    ended = threading.Event()
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(in_flight.take(1, ended.is_set)))
    waiter.start()
    ended.set()
    in_flight.wake()
    waiter.join(5)
    assert outcome == [False]
    assert in_flight.count == 1


def test_a_frame_is_consumed_once_when_decoded():
    consumed: list[int] = []
    (frame,) = wire.FrameReader().feed(_packet("a"))
    frame.on_consumed = lambda: consumed.append(1)
    assert codec.loads(frame) == "a"
    assert consumed == [1]
    del frame  # already counted
    assert consumed == [1]


def test_a_frame_dropped_undecoded_is_consumed_when_its_last_reference_goes():
    consumed: list[int] = []
    (frame,) = wire.FrameReader().feed(_packet("a"))
    frame.on_consumed = lambda: consumed.append(1)
    del frame
    assert consumed == [1]


def test_a_frame_heavier_than_the_bound_goes_through_alone():
    in_flight = streams.InFlight(limit=4)
    assert in_flight.take(10, lambda: False)  # nothing else in flight
    assert in_flight.count == 10


def test_a_frame_weighs_one_request_more_per_buffers_per_request_buffers():
    def frame_with(buffers: int) -> wire.Frame:
        return wire.Frame(Envelope(), b"", [np.empty(0, dtype=np.uint8)] * buffers)

    per = streams.BUFFERS_PER_REQUEST
    assert [streams.weight(frame_with(n)) for n in (0, per - 1, per, 3 * per)] == [1, 1, 2, 4]


def test_requests_are_admitted_in_order_and_reading_stops_when_admission_fails():
    admitted: list[str] = []
    handed: list[str] = []

    def admit(frame: wire.Frame) -> bool:
        name = codec.loads(frame)
        admitted.append(name)
        return name != "c"  # the stream ended while "c" waited

    readers = turns.TakeTurns(
        iter([_packet("a", "b", "c", "d"), _packet("e")]),
        wire.FrameReader(),
        lambda frame, inline: handed.append(codec.loads(frame)),
        admit,
        outbox=Outbox(packet_size=1 << 20),
    )
    readers.run()
    assert admitted == ["a", "b", "c"]
    assert handed == ["a", "b"]  # nothing after the refused one, not even the next packet


# -- A real gRPC stream: replies go out from the thread that made them -------------
def _in_exchange(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``transport.Server._exchange`` now."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is transport.Server._exchange.__code__:
            return True
        frame = frame.f_back
    return False


@pytest.mark.timeout(60)
def test_a_served_stream_holds_no_thread_of_gRPCs_while_its_replies_go_out():
    """The callee answers on the stream from the thread that ran the request:
    no stream thread of gRPC's waits in ``_exchange`` to yield the replies
    (grpcio's synchronous form needs one per stream, woken for every reply)."""
    scheduler = Scheduler("test-scheduler")
    served: list[str] = []

    def on_request(frame, peer_rank, respond, inline):
        served.append(threading.current_thread().name)
        respond(codec.encode(1, frame.envelope.request_id, codec.loads(frame) * 2).pieces)

    server = transport.Server("127.0.0.1", on_request, None, 1 << 20, 1 << 30, scheduler, rank=1)
    replies: queue.SimpleQueue = queue.SimpleQueue()
    connection = transport.Connection(
        server.address,
        [("rrpc-rank", "0")],
        on_frame=lambda frame: replies.put(codec.loads(frame)),
        on_close=lambda closed, error: None,
        packet_size=1 << 20,
        max_message_size=1 << 30,
        peer_name="worker1",
        scheduler=scheduler,
    )
    try:
        for i in range(3):
            connection.send(codec.encode(10, i + 1, f"call{i}").pieces)
            assert replies.get(timeout=10) == f"call{i}" * 2
        assert all(name.startswith("rrpc-serve-0-") for name in served), served
        deadline = time.monotonic() + 5
        while any(
            _in_exchange(t) for t in threading.enumerate() if t.name.startswith("rrpc-stream")
        ):
            assert time.monotonic() < deadline, "a gRPC thread still serves the stream"
            time.sleep(0.01)
    finally:
        connection.close()
        server.stop(grace=None)
        scheduler.stop()
