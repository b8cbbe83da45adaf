"""The state of a stream (``streams.StreamState``), driven with plain events:
no processes, no sockets. The table below is the specification the module's
docstring draws; every (state, event) pair not in it must be refused."""

import threading

import pytest

from harness import pushed
from rrpc import codec, streams, turns, wire
from rrpc.messages import ProtocolError, mark_transport_thread, thread_state
from rrpc.outbox import LEND_AT, Outbox
from rrpc.streams import (
    AUTHENTICATE,
    AUTHENTICATING,
    CLOSED,
    END,
    EXPIRE,
    HALF_CLOSE,
    HALF_CLOSED,
    OPEN,
    OPENING,
    PROVEN,
    START,
    Event,
    State,
    StreamState,
    StreamStateError,
)

TABLE = {
    (OPENING, AUTHENTICATE): AUTHENTICATING,
    (OPENING, START): OPEN,
    (OPENING, END): CLOSED,
    (AUTHENTICATING, PROVEN): OPEN,
    (AUTHENTICATING, EXPIRE): CLOSED,
    (AUTHENTICATING, END): CLOSED,
    (OPEN, HALF_CLOSE): HALF_CLOSED,
    (OPEN, EXPIRE): OPEN,
    (OPEN, END): CLOSED,
    (HALF_CLOSED, EXPIRE): HALF_CLOSED,
    (HALF_CLOSED, END): CLOSED,
    **{(CLOSED, event): CLOSED for event in Event},
}


@pytest.mark.parametrize("state", list(State), ids=lambda state: state.value)
@pytest.mark.parametrize("event", list(Event), ids=lambda event: event.value)
def test_every_event_in_every_state_moves_as_the_table_says_or_is_refused(state, event):
    stream = StreamState(state)
    if (state, event) in TABLE:
        assert stream.move(event) == (TABLE[state, event] is not state)
        assert stream.state is TABLE[state, event]
    else:
        with pytest.raises(StreamStateError) as refused:
            stream.move(event)
        assert f"'{event.value}'" in str(refused.value)
        assert f"'{state.value}'" in str(refused.value)
        assert stream.state is state  # a refused event moves nothing


def test_a_stream_with_a_token_opens_only_once_the_peer_proved_itself():
    stream = StreamState()
    assert stream.move(AUTHENTICATE) and stream.state is AUTHENTICATING
    for skipping_the_proof in (START, HALF_CLOSE):
        with pytest.raises(StreamStateError, match="in state 'authenticating'"):
            stream.move(skipping_the_proof)
    assert stream.move(PROVEN) and stream.state is OPEN
    with pytest.raises(StreamStateError, match="'proven' in state 'open'"):
        stream.move(PROVEN)


def test_a_half_closed_stream_ends_and_stays_ended():
    stream = StreamState(OPEN)
    assert stream.move(HALF_CLOSE) and stream.state is HALF_CLOSED
    assert stream.move(END) and stream.state is CLOSED
    assert not stream.move(END)  # another thread's news of the same end
    assert stream.state is CLOSED


def test_a_handshake_that_times_out_first_closes_the_stream_with_its_error():
    stream = StreamState(AUTHENTICATING)
    timed_out = TimeoutError("no proof within 10 s")
    assert stream.move(EXPIRE, timed_out)
    assert not stream.move(PROVEN)  # the proof came in just after: too late
    assert not stream.move(END, RuntimeError("cancelled"))  # the first reason stays
    assert (stream.state, stream.error) == (CLOSED, timed_out)


def test_a_timer_that_goes_off_after_the_proof_changes_nothing():
    stream = StreamState(AUTHENTICATING)
    assert stream.move(PROVEN)
    assert not stream.move(EXPIRE, TimeoutError("late"))
    assert (stream.state, stream.error) == (OPEN, None)


def test_a_waiter_for_the_handshake_wakes_when_it_ends():
    stream = StreamState(AUTHENTICATING)
    seen: list[State] = []
    waiter = threading.Thread(
        target=lambda: seen.append(stream.wait_while(OPENING, AUTHENTICATING))
    )
    waiter.start()
    stream.move(PROVEN)
    waiter.join(30)
    assert seen == [OPEN]


# -- The state as the sending side and the readers see it ----------------------------
def _packet(*names: str) -> bytes:
    return b"".join(b"".join(codec.encode(3, 1, name).pieces) for name in names)


def test_a_half_closed_stream_ends_after_its_last_reply():
    outbox = Outbox(packet_size=1 << 20)
    outbox.received = 2  # two requests read
    outbox.stream.move(HALF_CLOSE)
    outbox.end_if_answered()
    outbox.put([b"reply1;"])
    assert outbox.stream.state is HALF_CLOSED  # one request still unanswered
    outbox.put([b"reply2;"])
    assert outbox.stream.state is CLOSED
    assert pushed(outbox) == ([b"reply1;reply2;"], [None])


def test_readers_of_a_caller_that_half_closed_answer_nothing_more_and_end():
    outbox = Outbox(packet_size=1 << 20)
    seen: list[str] = []
    readers = turns.TakeTurns(
        iter([_packet("a")]),
        wire.FrameReader(),
        lambda frame, inline: seen.append(codec.loads(frame)),
        outbox=outbox,
    )
    readers.run()  # reads "a", then finds the request side over
    assert (seen, outbox.stream.state) == (["a"], HALF_CLOSED)
    outbox.put([b"answer;"])
    assert outbox.stream.state is CLOSED
    assert pushed(outbox) == ([b"answer;"], [None])


def test_readers_end_the_stream_with_the_error_of_a_malformed_frame():
    outbox = Outbox(packet_size=1 << 20)
    readers = turns.TakeTurns(
        iter([b"\xff\xff\xff\x7fgarbage"]), wire.FrameReader(), lambda f, i: None, outbox=outbox
    )
    readers.run()
    assert outbox.stream.state is CLOSED
    assert isinstance(outbox.stream.error, ProtocolError)


def test_readers_end_the_stream_when_its_peer_goes_away():
    def broken():
        raise streams.StreamBroken("reset by peer")
        yield b""

    readers = turns.TakeTurns(broken(), wire.FrameReader(), lambda f, i: None)
    readers.run()
    assert (readers.stream.state, readers.stream.error) == (CLOSED, None)


def test_readers_read_nothing_of_a_stream_that_is_not_open():
    def never_read():
        pytest.fail("read a packet of a peer that has not proved itself")
        yield b""

    outbox = Outbox(packet_size=1 << 20, stream=StreamState(AUTHENTICATING))
    turns.TakeTurns(never_read(), wire.FrameReader(), lambda f, i: None, outbox=outbox).run()
    assert outbox.stream.state is AUTHENTICATING


def test_a_peer_has_one_bound_of_requests_in_flight_across_its_streams():
    admission = streams.Admission(limit=8)
    assert admission.of(3) is admission.of(3)
    assert admission.of(3) is not admission.of(4)
    assert admission.of(3).limit == 8


# -- A pushed outbox: the threads that queue frames send them -------------------------
class _Carrier:
    """A carrier's two ends for ``Outbox.push``: what was sent, by which thread."""

    def __init__(self, on_send=None):
        self.sent: list[tuple[bytes, str]] = []
        self.finished: list[BaseException | None] = []
        self.on_send = on_send

    def send(self, packet: bytes) -> None:
        self.sent.append((packet, threading.current_thread().name))
        if self.on_send is not None:
            self.on_send()

    def finish(self, error: BaseException | None) -> None:
        self.finished.append(error)


def test_a_pushed_frame_goes_out_from_the_thread_that_queued_it():
    outbox = Outbox(packet_size=1 << 20)
    carrier = _Carrier()
    outbox.put([b"early;"])  # queued before the carrier is there: it goes at push
    outbox.push(carrier.send, carrier.finish)
    outbox.put([b"a;", b"b;"])
    me = threading.current_thread().name
    assert carrier.sent == [(b"early;", me), (b"a;b;", me)]
    outbox.end()
    assert carrier.finished == [None]
    outbox.end()
    outbox.put([b"late;"])
    assert (len(carrier.sent), carrier.finished) == (2, [None])  # nothing after the end


def test_frames_queued_while_a_thread_sends_go_with_its_next_packet():
    outbox = Outbox(packet_size=1 << 20)
    others = []

    def another_thread_queues_two():  # while the first send is under way
        if not others:
            others.append(threading.Thread(target=outbox.put, args=([b"x;"],)))
            others.append(threading.Thread(target=outbox.put, args=([b"y;"],)))
            for thread in others:
                thread.start()
                thread.join(5)  # they return at once: a thread is sending

    carrier = _Carrier(another_thread_queues_two)
    outbox.push(carrier.send, carrier.finish)
    outbox.put([b"first;"])
    me = threading.current_thread().name
    assert carrier.sent == [(b"first;", me), (b"x;y;", me)]


def test_a_thread_serving_another_stream_leaves_the_sending_to_the_outbox_sender():
    outbox = Outbox(packet_size=1 << 20)
    sent = threading.Event()
    carrier = _Carrier(sent.set)
    outbox.push(carrier.send, carrier.finish)

    def serving(stream):
        def run():
            mark_transport_thread()
            thread_state.serving = stream
            outbox.put([stream.__class__.__name__.encode()])

        thread = threading.Thread(target=run, name="reader")
        thread.start()
        thread.join(5)

    serving(outbox.stream)  # this stream's reader: it sends itself
    assert carrier.sent == [(b"StreamState", "reader")]
    sent.clear()
    serving(StreamState(OPEN))  # another stream's: the sender thread does
    assert sent.wait(5)
    assert carrier.sent[1][0] == b"StreamState" and carrier.sent[1][1] == "rrpc-send"
    outbox.end()


def test_a_pushed_outbox_finishes_once_with_the_error_it_ended_with():
    outbox = Outbox(packet_size=1 << 20)
    carrier = _Carrier()
    outbox.push(carrier.send, carrier.finish)
    error = ProtocolError("malformed")
    outbox.end(error)
    outbox.end()
    assert carrier.finished == [error]


def test_a_carrier_that_fails_to_send_ends_the_outbox_with_its_error():
    outbox = Outbox(packet_size=1 << 20)
    carrier = _Carrier()
    failure = ConnectionError("gone")

    def fail() -> None:
        raise failure

    carrier.on_send = fail
    outbox.push(carrier.send, carrier.finish)
    outbox.put([b"a;"])  # the queuing thread does not see the failure
    assert carrier.finished == [failure]


def _lend_recorder(outbox, lent):
    """``Outbox.push``'s ``lend``, recording the bytes waiting when a turn lends."""

    def lend(fn, *args):
        lent.append(outbox.backlog)
        return fn(*args)

    return lend


def test_a_turn_with_lend_at_bytes_to_send_lends_its_permit_and_a_small_one_does_not():
    outbox = Outbox(packet_size=1 << 20, track_backlog=True)
    carrier, lent = _Carrier(), []
    outbox.push(carrier.send, carrier.finish, lend=_lend_recorder(outbox, lent))
    me = threading.current_thread().name
    outbox.put([b"small;"])  # the common reply: sent as before, nothing lent
    assert (carrier.sent, lent) == ([(b"small;", me)], [])
    large = bytes(LEND_AT)  # may wait for a peer that does not read
    outbox.put([large])
    assert (carrier.sent[1], lent, outbox.backlog) == ((large, me), [LEND_AT], 0)


def test_a_turn_lends_from_the_moment_lend_at_bytes_are_queued_by_others():
    outbox = Outbox(packet_size=1 << 20, track_backlog=True)
    large, lent = bytes(LEND_AT), []

    def another_thread_queues_a_large_one():  # while the small one is sent
        if len(carrier.sent) == 1:
            other = threading.Thread(target=outbox.put, args=([large],))
            other.start()
            other.join(5)  # it returns at once: this thread sends its frame

    carrier = _Carrier(another_thread_queues_a_large_one)
    outbox.push(carrier.send, carrier.finish, lend=_lend_recorder(outbox, lent))
    outbox.put([b"small;"])
    assert ([packet for packet, _ in carrier.sent], lent) == ([b"small;", large], [len(large)])


class _Gate(threading.Event):
    """An event that says when someone first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_on = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited_on.set()
        return super().wait(timeout)


def test_requests_that_come_before_the_worker_is_ready_start_in_their_order_once_it_is():
    # A peer that finished init_rpc first may call already: its requests wait
    # in the reader, not each wherever it was to run (where a later one could
    # start first).
    admission = streams.Admission()
    ready = _Gate()
    admission.gate(ready, wait=30)
    in_flight = admission.of(1)
    seen: list[str] = []
    names = [f"r{i}" for i in range(20)]
    readers = turns.TakeTurns(
        iter([_packet(*names[:5]), _packet(*names[5:])]),
        wire.FrameReader(),
        lambda frame, inline: (seen.append(codec.loads(frame)), in_flight.give()),
        admit=lambda frame: in_flight.take(streams.weight(frame), lambda: False),
    )
    threads = [threading.Thread(target=readers.run) for _ in range(2)]
    for thread in threads:
        thread.start()
    assert ready.waited_on.wait(30)
    assert seen == []  # nothing handed on before the worker is ready
    ready.set()
    for thread in threads:
        thread.join(30)
    assert seen == names
