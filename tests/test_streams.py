"""The state of a stream (``streams.StreamState``), driven with plain events:
no processes, no sockets. The table below is the specification the module's
docstring draws; every (state, event) pair not in it must be refused."""

import threading

import pytest

from rrpc import codec, streams, turns, wire
from rrpc.messages import ProtocolError
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
    outbox = streams.Outbox(packet_size=1 << 20)
    outbox.received = 2  # two requests read
    outbox.stream.move(HALF_CLOSE)
    outbox.end_if_answered()
    outbox.put([b"reply1;"])
    assert outbox.stream.state is HALF_CLOSED  # one request still unanswered
    outbox.put([b"reply2;"])
    assert outbox.stream.state is CLOSED
    assert list(outbox.packets()) == [b"reply1;reply2;"]


def test_readers_of_a_caller_that_half_closed_answer_nothing_more_and_end():
    outbox = streams.Outbox(packet_size=1 << 20)
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
    assert list(outbox.packets()) == [b"answer;"]


def test_readers_end_the_stream_with_the_error_of_a_malformed_frame():
    outbox = streams.Outbox(packet_size=1 << 20)
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

    outbox = streams.Outbox(packet_size=1 << 20, stream=StreamState(AUTHENTICATING))
    turns.TakeTurns(never_read(), wire.FrameReader(), lambda f, i: None, outbox=outbox).run()
    assert outbox.stream.state is AUTHENTICATING


def test_a_peer_has_one_bound_of_requests_in_flight_across_its_streams():
    admission = streams.Admission(limit=8)
    assert admission.of(3) is admission.of(3)
    assert admission.of(3) is not admission.of(4)
    assert admission.of(3).limit == 8
