"""A worker logs the streams it refuses or ends, one line per kind of event
and peer host per interval (rrpc.logs), naming the address and the reason.

worker1 captures its ``rrpc`` logger and runs a clock the test advances (so
the rate limit's interval passes without waiting); worker0 hits worker1's
port with raw gRPC streams (tests/test_fuzz.py's ``_fuzz_stream``).
"""

from __future__ import annotations

import gc
import logging
import pickle
import struct
import threading
import time

import torch
from test_fuzz import _fuzz_stream, _my_address, _sink, _whoami

import rrpc
from harness import run_workers
from rrpc import codec, logs, transport
from rrpc._proto.rrpc_pb2 import Envelope, SharedBuffer
from rrpc.messages import CALL

TOKEN = "log-token"
LIMIT = 1 << 20


class _Captured(logging.Handler):
    lines: list[str] = []

    def emit(self, record):
        _Captured.lines.append(record.getMessage())


class _Clock:
    """Stands in for ``time`` in rrpc.logs: monotonic, plus what the test skipped."""

    skipped = 0.0

    @staticmethod
    def monotonic():
        return time.monotonic() + _Clock.skipped


def _lines():
    return list(_Captured.lines)


def _skip_interval():
    _Clock.skipped += logs.INTERVAL


def _frame(envelope: Envelope, payload: bytes = b"") -> bytes:
    head = envelope.SerializeToString()
    return struct.pack("<I", len(head)) + head + payload


def _new_lines(before):
    return rrpc.rpc_sync("worker1", _lines)[len(before) :]


def _hit_worker1(address):
    seen = {}
    lines = rrpc.rpc_sync("worker1", _lines)
    call = b"".join(bytes(p) for p in codec.encode(CALL, 1, (_sink, (), {})).pieces)
    for _ in range(50):
        _fuzz_stream(address, [call], "wrong-token", timeout=5)
    seen["50 wrong tokens"] = _new_lines(lines)
    rrpc.rpc_sync("worker1", _skip_interval)
    lines = rrpc.rpc_sync("worker1", _lines)
    _fuzz_stream(address, [call], "wrong-token", timeout=5)
    seen["51st, an interval later"] = _new_lines(lines)

    lines = rrpc.rpc_sync("worker1", _lines)
    seen["no token"] = (_fuzz_stream(address, [call], None, timeout=5), _new_lines(lines))
    lines = rrpc.rpc_sync("worker1", _lines)
    seen["handshake timeout"] = (
        _fuzz_stream(address, [call], TOKEN, timeout=10, prove=False),
        _new_lines(lines),
    )

    lines = rrpc.rpc_sync("worker1", _lines)
    for _ in range(20):
        _fuzz_stream(address, [struct.pack("<I", 12) + b"\xff" * 12], TOKEN, timeout=5)
    seen["20 unparseable envelopes"] = _new_lines(lines)

    lines = rrpc.rpc_sync("worker1", _lines)
    oversize = _frame(Envelope(kind=CALL, request_id=2, payload_size=LIMIT + 1))
    seen["oversize claim"] = (_fuzz_stream(address, [oversize], TOKEN, 5), _new_lines(lines))

    rrpc.rpc_sync("worker1", _skip_interval)  # a ProtocolError too, as the envelopes above
    lines = rrpc.rpc_sync("worker1", _lines)
    payload = pickle.dumps((_whoami, (), {}))
    envelope = Envelope(kind=CALL, request_id=3, payload_size=len(payload), buffer_sizes=[0])
    envelope.shared_buffers[0].CopyFrom(SharedBuffer(segment="1/0", offset=64, size=16))
    shared = _frame(envelope, payload)
    seen["foreign descriptor"] = (_fuzz_stream(address, [shared], TOKEN, 5), _new_lines(lines))
    seen["still serving"] = rrpc.rpc_sync("worker1", _whoami)
    return seen


def _logging_world(rank, world_size):
    if rank == 1:
        logging.getLogger("rrpc").addHandler(_Captured())
        logs.time = _Clock  # type: ignore[assignment]
        transport.SERVER_HANDSHAKE_TIMEOUT = 0.5
    options = rrpc.RpcBackendOptions(auth_token=TOKEN, max_message_size=LIMIT)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = _hit_worker1(rrpc.rpc_sync("worker1", _my_address)) if rank == 0 else None
    rrpc.shutdown()
    return seen


def test_refused_and_broken_streams_are_logged_once_per_kind_and_interval():
    seen = run_workers(_logging_world, 2, env={"RRPC_SHM": "1"}, init=False, timeout=90)[0]

    wrong = seen["50 wrong tokens"]
    assert len(wrong) == 1, wrong
    assert "ipv4:127.0.0.1:" in wrong[0] and "claims rank 0" in wrong[0]
    assert "wrong or missing auth token (wrong auth proof" in wrong[0]
    later = seen["51st, an interval later"]
    assert len(later) == 1 and "(49 more like it in the last 10 s)" in later[0], later

    (_, status), lines = seen["no token"]
    assert status == "UNAUTHENTICATED"
    assert len(lines) == 1 and "no valid auth nonce" in lines[0], lines
    (_, status), lines = seen["handshake timeout"]
    assert status == "CANCELLED"
    assert len(lines) == 1 and "no auth handshake within 0.5 s" in lines[0], lines

    broken = seen["20 unparseable envelopes"]
    assert len(broken) == 1 and "malformed frame: unparseable envelope" in broken[0], broken
    (_, status), lines = seen["oversize claim"]
    assert status == "INVALID_ARGUMENT"
    assert len(lines) == 1, lines
    assert f"{LIMIT + 1} bytes exceeds max_message_size={LIMIT}" in lines[0]
    (_, status), lines = seen["foreign descriptor"]
    assert status == "INVALID_ARGUMENT"
    assert len(lines) == 1 and "bad shared-memory descriptor" in lines[0], lines
    assert seen["still serving"] == "worker1"


class _Carrier:
    """A carrier as ``Agent.on_carrier_closed`` sees one: a gRPC stream, by its type."""

    def release(self):
        pass


def _carrier_break_logged(rank, world_size):
    """Whether a carrier breaking is logged: while the run goes on, and once
    this worker waits in the shutdown barrier (``agent.leaving``), where peers
    that passed it first stop."""
    captured = _Captured()
    logging.getLogger("rrpc").addHandler(captured)
    agent = rrpc.agent.current_agent()
    logged = {}
    for leaving, peer in ((False, "lost"), (True, "left")):
        agent.leaving = leaving
        agent.on_carrier_closed(rrpc.WorkerInfo(peer, 7), _Carrier(), ConnectionError("gone"))
        logged[leaving] = any(f"stream to {peer}" in line for line in _Captured.lines)
    agent.leaving = False
    logging.getLogger("rrpc").removeHandler(captured)
    return logged


def test_a_carrier_that_breaks_in_the_shutdown_barrier_is_not_logged_as_lost():
    # The parameter-server demo ended with "stream to ps failed: lane to ps
    # broke": a trainer's late RRef DELETE met the lane ps had closed, having
    # passed the barrier while the trainer still waited in it.
    logged = run_workers(_carrier_break_logged, 1, timeout=60)[0]
    assert logged == {False: True, True: False}


def _rref_dropped_after_stop_logged(rank, world_size):
    """worker1 drops a user RRef once its agent has stopped (as a trainer's
    last RRefs may go while its shutdown runs): the DELETE cannot go. Returns
    what the RRef service made of it, and the lines logged meanwhile."""
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        rrpc.shutdown()
        return None
    captured = _Captured()
    logging.getLogger("rrpc").addHandler(captured)
    held = [rrpc.remote("worker0", torch.ones, args=(2,))]
    held[0].to_here()
    agent = rrpc.agent.current_agent()
    service = agent.rrefs
    answered, errors = threading.Event(), []
    real_answered, real_stop = service._answered, agent.stop

    def answered_here(send, error):
        real_answered(send, error)
        errors.append(repr(error))
        answered.set()

    def stop_then_drop(*args, **kwargs):
        real_stop(*args, **kwargs)
        held.clear()  # the last reference: the RRef's DELETE is queued now
        gc.collect()
        assert answered.wait(30), "the RRef service never tried to send the DELETE"

    service._answered, agent.stop = answered_here, stop_then_drop
    rrpc.shutdown()
    logging.getLogger("rrpc").removeHandler(captured)
    return errors, [line for line in _Captured.lines if "RREF_DELETE" in line]


def test_an_rref_dropped_after_the_agent_stopped_is_not_logged_as_a_failure():
    # The parameter-server demo ended with "Send(RREF_DELETE to rank 0 ...)
    # failed: ... rrpc on trainer2 is shut down": an RRef the trainer dropped
    # while its shutdown ran. Its owner stops too; nothing is lost.
    errors, logged = run_workers(_rref_dropped_after_stop_logged, 2, init=False, timeout=60)[1]
    assert len(errors) == 1 and "shut down" in errors[0], errors  # it was tried, and failed
    assert logged == []
