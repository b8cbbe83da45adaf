"""The caller's end of a gRPC stream on grpcio's core API (``rrpc.grpc_call``),
against a bare grpcio server in this process: order, ends, errors."""

import os
import threading

import grpc
import pytest

from harness import ECHO_METHOD, read_stream
from rrpc import grpc_call


@pytest.mark.timeout(60)
def test_packets_sent_while_others_wait_for_room_go_out_in_order(echo_channel, monkeypatch):
    # Room for one waiting packet: the sender waits for room at nearly every
    # send, and a send in flight may complete while it waits.
    monkeypatch.setattr(grpc_call, "WAITING_LIMIT", 64 << 10)
    call = grpc_call.Call(echo_channel, ECHO_METHOD, [])
    packets, reader = read_stream(call)
    sent = [os.urandom(64 << 10) for _ in range(300)]
    for packet in sent:
        call.send(packet)
    call.close_sending()
    reader.join(30)
    assert not reader.is_alive()
    received = [packets.get() for _ in range(packets.qsize())]
    assert received.pop() == "ended"
    assert len(received) == len(sent)
    assert all(got == packet for got, packet in zip(received, sent, strict=True))


@pytest.mark.timeout(60)
def test_a_stream_ended_with_an_error_raises_its_status_and_refuses_more_sends(echo_channel):
    call = grpc_call.Call(echo_channel, ECHO_METHOD, [])
    packets, reader = read_stream(call)
    call.send(b"one")
    call.send(b"fail")
    reader.join(30)
    assert not reader.is_alive()
    assert packets.get() == b"one"
    error = packets.get()
    assert isinstance(error, grpc_call.StreamEnded)
    assert error.code() is grpc.StatusCode.INTERNAL and error.details() == "asked to fail"
    with pytest.raises(grpc_call.StreamEnded):
        call.send(b"after")


@pytest.mark.timeout(60)
def test_a_cancelled_stream_is_drained_by_its_reader_and_ends(echo_channel):
    call = grpc_call.Call(echo_channel, ECHO_METHOD, [])
    packets = call.packets()
    call.send(b"x" * 100)
    assert next(packets) == b"x" * 100  # the reader stops reading here
    call.cancel("test")
    done = threading.Thread(target=call.drain, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive()
    with pytest.raises(grpc_call.StreamEnded):
        call.send(b"after")


@pytest.mark.timeout(60)
def test_an_unreachable_server_ends_the_stream_unavailable():
    with grpc.insecure_channel("127.0.0.1:1") as unreachable:
        call = grpc_call.Call(unreachable, ECHO_METHOD, [])
        call.send(b"lost")
        with pytest.raises(grpc_call.StreamEnded) as ended:
            list(call.packets())
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.timeout(60)
def test_wake_returns_a_thread_waiting_for_the_streams_next_event(echo_channel):
    call = grpc_call.Call(echo_channel, ECHO_METHOD, [])
    call.send(b"ping")
    packet = None
    while packet is None or call.busy():  # the opening's events, the send's, the echo
        packet = call.take() or packet
    assert packet == b"ping"  # and nothing more comes
    woken = threading.Event()

    def waiting():
        assert call.take() is None
        woken.set()

    thread = threading.Thread(target=waiting, daemon=True)
    thread.start()
    assert not woken.wait(0.2)  # nothing to take: it waits
    call.wake()
    assert woken.wait(30)
    call.cancel("test")
    call.drain()
