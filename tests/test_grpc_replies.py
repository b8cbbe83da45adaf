"""A caller reading its own reply on a gRPC stream (``rrpc.grpc_replies``):
over gRPC, ``rpc_sync`` wakes no rrpc thread, every reply still reaches its
call, and a caller waiting in the stream still ends at its deadline."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import torch

import rrpc
from harness import ECHO_METHOD, run_workers
from rrpc import PeerUnavailableError, RpcTimeoutError, grpc_call, grpc_replies, wire
from rrpc.agent import current_agent
from rrpc.outbox import Outbox
from rrpc.scheduler import Scheduler

GRPC_ONLY = {"RRPC_LANE": "0"}  # every call between the two workers over gRPC


@pytest.mark.timeout(60)
def test_a_leader_that_nothing_reaches_leaves_at_its_deadline(echo_channel):
    # Nothing arrives on the stream and no call ends: only the deadline's
    # own wake-up (the scheduler's) ends the wait for gRPC's next event.
    call = grpc_call.Call(echo_channel, ECHO_METHOD, [])
    scheduler = Scheduler()
    outbox = Outbox(1 << 20)
    replies = grpc_replies.Replies(
        call, wire.FrameReader(), lambda frame: None, outbox, scheduler.call_at
    )
    ended = []

    def read():
        with pytest.raises(grpc_call.StreamEnded) as end:
            replies.read()
        ended.append(end.value.code())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not replies.lead(lambda: False, time.monotonic()):  # the reader is ready, and idle
        pass
    start = time.monotonic()
    assert replies.lead(lambda: False, start + 0.3)
    assert 0.3 <= time.monotonic() - start < 10
    call.cancel("test")
    replies.need_reader()
    reader.join(30)
    assert ended == [grpc.StatusCode.CANCELLED]
    scheduler.stop(5)


def _voluntary_switches(thread_name: str) -> int:
    """How many times the thread named ``thread_name`` slept and was woken so far."""
    (thread,) = [t for t in threading.enumerate() if t.name == thread_name]
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        line = next(line for line in status if line.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def _sequential_calls(rank, world_size):
    if rank != 0:
        return None
    for _ in range(20):  # the stream is open, the first calls' reader wake-ups are past
        rrpc.rpc_sync("worker1", torch.add, args=(1, 1))
    before = _voluntary_switches("rrpc-recv-worker1")
    results = [rrpc.rpc_sync("worker1", torch.add, args=(i, 1)) for i in range(300)]
    return results, _voluntary_switches("rrpc-recv-worker1") - before


@pytest.mark.timeout(120)
def test_rpc_sync_over_grpc_reads_its_own_reply_and_wakes_no_reader_thread():
    results, reader_woken = run_workers(_sequential_calls, env=GRPC_ONLY)[0]
    assert results == [i + 1 for i in range(300)]
    # The stream's reader thread slept through (a reader that reads each reply
    # wakes at least once per call; on a loaded machine, a pause of IDLE
    # between two calls lets it read one).
    assert reader_woken < 100


def _mixed_calls(rank, world_size):
    if rank != 0:
        return None
    failures = []

    def caller(offset):
        for i in range(100):
            value = offset + i
            pending = rrpc.rpc_async("worker1", torch.mul, args=(value, 3))
            if rrpc.rpc_sync("worker1", torch.add, args=(value, 1)) != value + 1:
                failures.append(("sync", value))
            if pending.wait() != value * 3:
                failures.append(("async", value))

    threads = [threading.Thread(target=caller, args=(1000 * n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


@pytest.mark.timeout(120)
def test_callers_reading_the_stream_hand_every_other_reply_to_its_own_call():
    # Four threads, each with a call in flight while it reads for its own:
    # whoever reads meets the others' replies and must complete the right call.
    assert run_workers(_mixed_calls, env=GRPC_ONLY)[0] == []


_release = threading.Event()


def _blocked_until_released():
    assert _release.wait(60)
    return "late"


def _release_the_blocked():
    _release.set()


def _calls_past_their_deadline(rank, world_size):
    if rank != 0:
        return None
    rrpc.rpc_sync("worker1", torch.add, args=(1, 1))  # the stream is open
    seen = {}
    start = time.monotonic()
    try:
        rrpc.rpc_sync("worker1", _blocked_until_released, timeout=0.5)
        seen["rpc_sync"] = "returned"
    except RpcTimeoutError:
        seen["rpc_sync"] = "timed out"
    seen["rpc_sync took"] = time.monotonic() - start
    # A wait shorter than the call's own timeout: remote()'s, in to_here().
    start = time.monotonic()
    try:
        rrpc.remote("worker1", _blocked_until_released, timeout=0.5).to_here(timeout=60)
        seen["to_here"] = "returned"
    except RpcTimeoutError:
        seen["to_here"] = "timed out"
    seen["to_here took"] = time.monotonic() - start
    rrpc.rpc_sync("worker1", _release_the_blocked)
    seen["next"] = rrpc.rpc_sync("worker1", torch.add, args=(2, 2))
    return seen


@pytest.mark.timeout(120)
def test_a_caller_waiting_in_the_stream_is_woken_at_its_deadline():
    # The callee never answers in time, and nothing else arrives on the
    # stream: only the deadline can end the caller's wait for the next event.
    seen = run_workers(_calls_past_their_deadline, env=GRPC_ONLY)[0]
    assert seen["rpc_sync"] == "timed out" and seen["rpc_sync took"] < 5.0
    assert seen["to_here"] == "timed out" and seen["to_here took"] < 5.0
    assert seen["next"] == 4


def _interrupt_once_waiting(connection, record):
    """SIGINT to this process once its main thread reads ``connection`` for
    a reply, its request sent (not while it runs rrpc's sending code, where a
    signal's exception lands anywhere in Python's bookkeeping). ``record``
    says whether it was sent, or the caller's last state if it never was:
    what a failure of the test needs to tell a lost signal from one never sent."""
    deadline = time.monotonic() + 15
    state = None
    while time.monotonic() < deadline:
        state = (
            connection._replies._leading,
            connection._call.busy(),
            connection._outbox._sending,
        )
        if state == (True, False, False):
            record.append("sent")
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.001)  # polls the state above; the signal is what the test waits for
    record.append(f"never sent: (leading, send in flight, outbox sending) stayed {state}")


def _interrupted_while_reading(rank, world_size):
    if rank != 0:
        return None
    # Python's own Ctrl-C handling, as a user's program has it, whatever this
    # process inherited: a SIGINT ignored in the process that started the
    # harness's fork server is ignored in every child it forks.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    rrpc.rpc_sync("worker1", torch.add, args=(1, 1))
    connection = current_agent().routes.to(rrpc.get_worker_info("worker1"))[0]
    record: list[str] = []
    threading.Thread(target=_interrupt_once_waiting, args=(connection, record), daemon=True).start()
    try:
        # No reply comes: the signal finds the caller waiting in gRPC's core
        # for the stream's next event (grpcio then frees the call), or
        # handling one. The call's own timeout bounds a signal that is lost.
        rrpc.rpc_sync("worker1", _blocked_until_released, timeout=25)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "interrupted"
    except RpcTimeoutError:
        pending = signal.SIGINT in signal.sigpending()
        outcome = (
            f"timed out, the signal {record}; SIGINT's handler was {inherited!r}, "
            f"blocked {signal.SIGINT in blocked}, now pending {pending}"
        )
    for _ in range(10):  # the stream the signal cut may fail a call or two as it ends
        try:
            rrpc.rpc_sync("worker1", _release_the_blocked)
            return outcome, rrpc.rpc_sync("worker1", torch.add, args=(2, 2))
        except PeerUnavailableError:
            continue
    return outcome, "no call worked"


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_caller_reading_its_reply_interrupts_it_and_the_worker_recovers():
    # It surfaces as KeyboardInterrupt, the stream it cut ends, and the
    # worker's calls go on, on a new stream.
    outcome, after = run_workers(_interrupted_while_reading, env=GRPC_ONLY)[0]
    assert outcome == "interrupted", outcome  # else: whether the signal was ever sent
    assert after == 4
