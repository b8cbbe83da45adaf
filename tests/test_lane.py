"""The same-host lane (rrpc/lane.py): who opens one, what crosses it, and how it fails.

Two workers of one host carry their calls over a Unix socket; two in
different network namespaces, or with the lane switched off, stay on gRPC.
A lane that breaks mid-call fails that call naming the peer, and the next
call works; a caller that cannot prove the cluster token is refused.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import rrpc
from harness import mp_context, run_workers
from rrpc import auth, codec, lane, lane_io, wire
from rrpc import spin as spin_module
from rrpc.agent import current_agent
from rrpc.futures import wait_until
from rrpc.messages import REPLY
from rrpc.spin import Spin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import netns  # noqa: E402 -- benchmarks/netns.py

pytestmark = pytest.mark.timeout(120)


def _lane_open_to(name: str) -> bool:
    agent = current_agent()
    return agent.routes.lane_to(agent.worker_info(name)) is not None


def _echo(value):
    return value


_release = []  # worker1's copy of the test's release Event


def _wait_for_release():
    _release[0].wait(30)  # set by the caller once the lane broke under this call
    return "late"


# -- Who opens a lane ----------------------------------------------------------------
def _calls_over_the_lane(rank, world_size):
    if rank != 0:
        return None
    generator = torch.Generator().manual_seed(1)
    sent = [torch.randn(n, generator=generator) for n in (0, 1, 1000, 200_000)]
    back = rrpc.rpc_sync("worker1", _echo, args=(sent,))
    futures = [rrpc.rpc_async("worker1", torch.add, args=(t, 1)) for t in sent]
    added = [f.wait() for f in futures]
    counter = rrpc.remote("worker1", dict, kwargs={"calls": 3})
    return (
        _lane_open_to("worker1"),
        all(torch.equal(a, b) for a, b in zip(back, sent, strict=True)),
        all(torch.equal(a, b + 1) for a, b in zip(added, sent, strict=True)),
        counter.to_here(),
    )


# The tests of the lane itself turn it on: the suite also runs with RRPC_LANE=0.
LANE_ON = {"RRPC_LANE": "1"}


def test_two_workers_on_one_host_carry_their_calls_over_the_lane():
    opened, echoed, added, counted = run_workers(_calls_over_the_lane, env=LANE_ON)[0]
    assert opened is True
    assert echoed and added
    assert counted == {"calls": 3}


def _lane_state(rank, world_size):
    if rank == 0:
        assert torch.equal(
            rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), 2 * torch.ones(2)
        )
        return _lane_open_to("worker1")
    return None


@pytest.mark.parametrize(
    "how",
    ["env", "option", "tensorpipe_transports"],
)
def test_a_lane_switched_off_leaves_the_calls_on_grpc(how):
    env, options = None, None
    if how == "env":
        env = {"RRPC_LANE": "0"}
    elif how == "option":
        options = rrpc.RpcBackendOptions(same_host_lane=False)
    else:
        options = rrpc.TensorPipeRpcBackendOptions(_transports=["uv"])
    assert run_workers(_lane_state, env=env, backend_options=options)[0] is False


def test_tensorpipe_transports_with_shm_keep_the_lane(monkeypatch):
    monkeypatch.setenv("RRPC_LANE", "1")  # the suite may run with the lane off
    options = rrpc.TensorPipeRpcBackendOptions(_transports=["shm", "uv"], _channels=["basic"])
    assert options.same_host_lane and not options.shared_memory
    assert run_workers(_lane_state, env=LANE_ON, backend_options=options)[0] is True


def test_an_unknown_tensorpipe_transport_is_refused_by_name():
    with pytest.raises(ValueError, match="carrier-pigeon"):
        rrpc.RpcBackendOptions(_transports=["carrier-pigeon"])


def _namespaced(rank, world_size, pair, results):
    host = pair.b if rank == 2 else pair.a
    netns.enter(host.netns)  # before any socket is opened
    os.environ.update(MASTER_ADDR=pair.a.address, RRPC_ADVERTISE_HOST=host.address)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        one = rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        two = rrpc.rpc_sync("worker2", torch.add, args=(torch.ones(2), 2))
        results.put(
            (_lane_open_to("worker1"), _lane_open_to("worker2"), one.sum().item(), two.sum().item())
        )
    rrpc.shutdown()


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_workers_in_different_network_namespaces_open_no_lane():
    results = mp_context.Queue()
    with netns.VethPair.create() as pair:
        run_workers(
            _namespaced, world_size=3, args=(pair, results), init=False, timeout=90, env=LANE_ON
        )
    assert results.get(timeout=5) == (True, False, 4.0, 6.0)


# -- A lane that breaks --------------------------------------------------------------
def _break_mid_call(rank, world_size, release):
    _release.append(release)
    if rank != 0:
        return None
    assert rrpc.rpc_sync("worker1", _echo, args=(1,)) == 1
    agent = current_agent()
    peer = agent.worker_info("worker1")
    pending = rrpc.rpc_async("worker1", _wait_for_release)
    opened = agent.routes.lane_to(peer)
    opened._sock.shutdown(socket.SHUT_RDWR)  # the lane breaks under the pending call
    try:
        pending.wait()
        error = None
    except rrpc.PeerUnavailableError as exc:
        error = str(exc)
    release.set()
    after = rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 4))
    return error, after.tolist()


def test_a_lane_that_breaks_mid_call_fails_that_call_naming_the_peer_and_the_next_call_works():
    error, after = run_workers(_break_mid_call, args=(mp_context.Event(),), env=LANE_ON)[0]
    assert error is not None and "worker1" in error and "lane" in error
    assert after == [5.0, 5.0]


SMALL_LIMIT = 1 << 20  # worker1's max_message_size below
HELD = 10.0  # seconds worker1 runs its inline request at most (until the caller releases it)
_started = []  # worker1's copy of the Event its held request sets as it starts


def _held_until_released():
    _started[0].set()
    _release[0].wait(HELD)
    return "released"


def _refused_beside_an_inline_request(rank, world_size, started, release):
    _started.append(started)
    _release.append(release)
    options = rrpc.RpcBackendOptions(max_message_size=SMALL_LIMIT if rank == 1 else 0)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = None
    if rank == 0:
        assert rrpc.rpc_sync("worker1", _echo, args=(1,)) == 1  # the lane is open
        held = rrpc.rpc_async("worker1", _held_until_released)  # alone: run inline by its reader
        assert started.wait(30)
        start = time.monotonic()
        try:
            rrpc.rpc_sync("worker1", torch.numel, args=(torch.zeros(SMALL_LIMIT // 4 + 10),))
            seen = {"refused": None}
        except rrpc.PeerUnavailableError as exc:
            seen = {"refused": str(exc)}
        seen["took"] = time.monotonic() - start
        release.set()
        try:
            seen["held"] = held.wait()
        except rrpc.PeerUnavailableError as exc:  # its lane ended under it (as on gRPC)
            seen["held"] = type(exc).__name__
        seen["after"] = rrpc.rpc_sync("worker1", _echo, args=(2,))
    rrpc.shutdown()
    return seen


def test_a_request_the_callee_refuses_ends_the_lane_at_once_beside_a_long_inline_request():
    # Measured before: the refused call failed after HELD (9.8 s): the callee
    # said goodbye only once both its readers were done, and one of them ran
    # the held request inline.
    started, release = mp_context.Event(), mp_context.Event()
    env = {"RRPC_SHM": "0", **LANE_ON}  # the tensor goes in the frame, over the limit
    seen = run_workers(
        _refused_beside_an_inline_request, args=(started, release), env=env, init=False
    )[0]
    assert seen["refused"] is not None and "max_message_size" in seen["refused"], seen
    assert seen["took"] < 3.0, seen
    assert seen["held"] == "PeerUnavailableError", seen
    assert seen["after"] == 2


# -- Replies only rrpc's bookkeeping awaits -------------------------------------------
def _creations_nobody_waits_for(rank, world_size):
    if rank != 0:
        return None
    rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))  # the lane is open
    agent = current_agent()
    lane_to = agent.routes.lane_to(agent.worker_info("worker1"))
    woken_at_send = []
    need_reader = lane_to.need_reader

    def counted() -> None:
        if sys._getframe(1).f_code.co_name == "_send":  # as a request is sent
            woken_at_send.append(threading.current_thread().name)
        need_reader()

    lane_to.need_reader = counted
    # remote() then to_here(): the caller reads the creation's reply with its
    # fetch's, or the scheduler wakes the reader later; the send wakes no thread.
    fetched = [
        rrpc.remote("worker1", torch.ones, args=(2,)).to_here().sum().item() for _ in range(5)
    ]
    woken_by_remote = list(woken_at_send)
    rrpc.rpc_async("worker1", torch.add, args=(torch.ones(1), 1)).wait()  # a user's: at once
    # A creation that nothing waits for still gets read: its confirmation
    # comes, by the lane's reader thread that the scheduler wakes.
    alone = rrpc.remote("worker1", torch.ones, args=(3,))
    confirmed = wait_until(alone._creation, 30.0) and alone.confirmed_by_owner()
    pending = rrpc.rref_debug_info()["num_pending_confirmations"]
    return fetched, woken_by_remote, len(woken_at_send), confirmed, pending


def test_a_reply_only_the_bookkeeping_awaits_wakes_no_reader_at_once_and_is_still_read():
    fetched, woken_by_remote, woken_in_all, confirmed, pending = run_workers(
        _creations_nobody_waits_for, env=LANE_ON
    )[0]
    assert fetched == [2.0] * 5
    assert woken_by_remote == []  # no remote() woke the lane's reader as it sent
    assert woken_in_all == 1  # the user's rpc_async did: the check sees it
    assert confirmed is True and pending == 0


class _LaneOverASocketPair:
    """A caller's ``lane.Lane`` whose far end is the test: it writes the replies."""

    def __init__(self):
        ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self.replied: list[int] = []
        self.second_replied = threading.Event()
        self.scheduled: list = []
        self.lane = lane.Lane(
            ours,
            "peer",
            on_frame=self._on_frame,
            on_close=lambda *_: None,
            reader=wire.FrameReader(),
            call_later=lambda delay, fn, *args: self.scheduled.append(fn),
        )
        self.woken = 0
        need_reader = self.lane.need_reader

        def counted():
            self.woken += 1
            need_reader()

        self.lane.need_reader = counted

    def _on_frame(self, frame):
        self.replied.append(frame.envelope.request_id)
        if len(self.replied) == 2:
            self.second_replied.set()
        return True

    def reply(self, request_id):
        self.theirs.sendall(b"".join(codec.encode(REPLY, request_id, None).pieces))

    def close(self):
        self.lane.close()
        self.lane.release()
        self.theirs.close()


@pytest.mark.parametrize("second", ["bookkeeping", "a caller's"])
def test_a_leader_leaving_wakes_the_reader_at_once_only_for_a_reply_a_caller_awaits(second):
    pair = _LaneOverASocketPair()
    pair.lane.expect(1)  # the leader's own call
    pair.lane.expect(2, bookkeeping=second == "bookkeeping")  # sent after it, not answered yet
    pair.reply(1)
    assert pair.lane.lead(lambda: 1 in pair.replied, float("inf"))
    assert pair.replied == [1]
    if second == "bookkeeping":
        # Not now: its next call would find the reader holding the turn.
        assert pair.woken == 0 and len(pair.scheduled) == 1
        pair.scheduled.pop()()  # READ_SOON later, still unread: the reader thread reads it
        assert pair.woken == 1
    else:
        assert pair.woken == 1 and pair.scheduled == []
    pair.reply(2)
    assert pair.second_replied.wait(30) and pair.replied == [1, 2]  # by the reader thread
    pair.close()


# -- Trust -----------------------------------------------------------------------------
def _lane_path_and_wait(rank, world_size, paths, done):
    if rank == 1:
        listener = current_agent().lane_listener
        paths.put((listener.path, stat.S_IMODE(os.stat(listener.directory).st_mode)))
        assert done.wait(60)
        return None
    assert done.wait(60)
    # After the stranger was refused, worker1 still serves, over the lane.
    return rrpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1)).item(), _lane_open_to(
        "worker1"
    )


def test_a_caller_without_the_token_is_refused_on_the_lane_and_the_worker_keeps_serving():
    paths, done = mp_context.Queue(), mp_context.Event()
    env = {"RRPC_AUTH_TOKEN": "s3cret", **LANE_ON}
    outcome = {}

    def stranger():
        path, mode = paths.get(timeout=60)
        outcome["mode"] = mode
        try:
            with pytest.raises((rrpc.AuthenticationError, ConnectionError, OSError)):
                sock = lane.connect(path, (0, 1), auth.Token("wrong"), timeout=5)
                # The callee proved the real token, which "wrong" cannot check.
                sock.close()
            # A forged proof after a real hello: the callee drops the socket.
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.settimeout(5)
            raw.connect(path)
            raw.sendall(lane_io.MAGIC + struct.pack("<q", 0) + bytes(32))
            raw.recv(1024)
            raw.sendall(b"\x01" * 32)
            outcome["after_forged_proof"] = raw.recv(1024)  # REFUSED, then the socket closes
            outcome["then"] = raw.recv(1024)
            raw.close()
        finally:
            done.set()

    thread = threading.Thread(target=stranger)
    thread.start()
    results = run_workers(_lane_path_and_wait, args=(paths, done), env=env)
    thread.join(10)
    assert outcome["mode"] == 0o700
    assert outcome["after_forged_proof"] == lane_io.REFUSED
    assert outcome["then"] == b""
    assert results[0] == (2.0, True)


# -- Opening a lane within the call's time, without processes -----------------------
def _no_lane_expected(sock, peer):
    raise AssertionError(f"a lane to {peer.name} opened")


def test_a_lane_whose_peer_never_answers_gives_up_within_the_calls_timeout(tmp_path, monkeypatch):
    # A frozen peer's listen backlog accepts the connection and nobody answers:
    # the opening exchange, on the calling thread, waits out its whole limit.
    # It must be the call's timeout (0.2 s here), not CONNECT_TIMEOUT's.
    monkeypatch.setattr(lane.Lanes, "CONNECT_TIMEOUT", 30.0)
    path = str(tmp_path / "lane.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(1)  # never accepts: connections wait in the backlog
    failed = []
    lanes = lane.Lanes(0, None, _no_lane_expected, failed.append)
    try:
        start = time.monotonic()
        opened = lanes.to(rrpc.WorkerInfo("worker1", 1), path, timeout=0.2)
        took = time.monotonic() - start
    finally:
        listening.close()
    assert opened is None
    assert took < 0.2 + 1.0, took
    assert failed == [1]  # the agent then suspects it: no lane opens to it until it answers
    assert lanes.to(rrpc.WorkerInfo("worker1", 1), path, timeout=0.2) is None  # not yet retried
    assert failed == [1]


# -- The writer, without processes ---------------------------------------------------
def test_writer_keeps_frames_whole_and_in_order_when_the_socket_is_full():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    writer = lane_io.Writer(ours, "test", limit=1 << 30)
    big = bytes(range(256)) * (16 << 10)  # 4 MiB: far more than the socket buffer holds
    frames = [[b"head%d" % i, b"", memoryview(big), b"tail%d" % i] for i in range(3)]
    received = bytearray()

    def read_all():
        expected = sum(len(piece) for frame in frames for piece in frame)
        while len(received) < expected:
            received.extend(theirs.recv(1 << 20))

    reader = threading.Thread(target=read_all)
    for frame in frames:  # the first fills the socket; the rest queue behind it
        writer.write(frame)
    reader.start()
    reader.join(30)
    writer.drain(5)
    assert bytes(received) == b"".join(bytes(p) for frame in frames for p in frame)
    assert writer.backlog_bytes == 0
    ours.close()
    theirs.close()


def test_writer_that_lost_its_peer_raises_lane_broken_on_the_next_write():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    writer = lane_io.Writer(ours, "test", limit=1 << 30)
    theirs.close()
    with pytest.raises(lane_io.LaneBroken):
        writer.write([b"x" * 10])
        writer.write([b"y" * 10])
    ours.close()


# -- Spinning before sleeping (lane_io.Reader's ``spin``) ----------------------------
class _CountingPoller:
    """A poll object that counts the looks that do not sleep (timeout 0) and the waits that may."""

    def __init__(self, poller):
        self._poller = poller
        self.looks = 0
        self.sleeps = 0

    def poll(self, timeout=-1):
        if timeout == 0:
            self.looks += 1
        else:
            self.sleeps += 1
        return self._poller.poll(timeout)


@pytest.fixture
def spinning_reader():
    """``make(spin, stopped=False)``: a lane reader on one end of a socket
    pair, its poller counting (``_CountingPoller``), and the other end;
    ``stopped``: its recent waits were long (spinning off). Both ends are
    closed after the test, whatever its outcome."""
    sockets: list[socket.socket] = []

    def make(spin, stopped=False):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sockets.extend((ours, theirs))
        ours.setblocking(False)
        reader = lane_io.Reader(ours, spin=spin)
        counting = reader._poller = _CountingPoller(reader._poller)
        if stopped:
            reader.spin._hits = 0.0
        return reader, counting, theirs

    yield make
    for sock in sockets:
        sock.close()


def test_a_reader_catches_bytes_that_come_while_it_spins_without_sleeping(spinning_reader):
    reader, counting, theirs = spinning_reader(spin=5.0)  # far longer than the write takes
    writer = threading.Thread(target=theirs.sendall, args=(b"reply",))
    writer.start()
    assert reader.recv(timeout_ms=10_000, wait_first=True) == b"reply"
    writer.join()
    assert counting.looks > 0 and counting.sleeps == 0


def test_a_spin_yields_the_cpu_at_each_look_after_its_first_moments(spinning_reader, monkeypatch):
    # Past SPIN_ALONE, a thread that wants this CPU (the computation the
    # reader waits for, a third process) gets it at every look.
    looks: list[tuple[float, bool]] = []  # (when, yielded before it)
    yielded = [False]

    def sched_yield():
        yielded[0] = True

    reader, counting, theirs = spinning_reader(spin=0.02)
    poll = counting.poll

    def noting_poll(timeout):
        looks.append((time.perf_counter(), yielded[0]))
        yielded[0] = False
        return poll(timeout)

    counting.poll = noting_poll
    monkeypatch.setattr(spin_module.os, "sched_yield", sched_yield)
    start = time.perf_counter()
    reader._wait(1)  # nothing comes: it spins all of spin, then sleeps out 1 ms
    spun = [(when - start, before) for when, before in looks[:-1]]  # the last: the sleep
    assert any(before for _, before in spun)
    first_yield = min(when for when, before in spun if before)
    assert first_yield >= Spin.SPIN_ALONE
    assert all(before for when, before in spun if when > first_yield)
    # A spin shorter than SPIN_ALONE never yields.
    reader, counting, _ = spinning_reader(spin=Spin.SPIN_ALONE / 2)
    yielded[0] = False
    reader._wait(1)
    assert counting.looks > 0 and not yielded[0]


def test_a_reader_stops_spinning_after_long_waits_and_spins_again_after_short_ones(spinning_reader):
    reader, counting, theirs = spinning_reader(spin=0.002)
    # Nothing comes: the first wait spins (no waits seen yet), then sleeps out the timeout.
    assert reader.recv(timeout_ms=50, wait_first=True) is None
    assert counting.looks > 0 and counting.sleeps > 0
    # Waits that long turn spinning off: the next one sleeps at once.
    counting.looks = 0
    assert reader.recv(timeout_ms=50, wait_first=True) is None
    assert counting.looks == 0
    # Short waits (the bytes are there when it looks) turn it back on.
    for i in range(8):
        theirs.sendall(b"%d" % i)
        assert reader.recv(timeout_ms=1000, wait_first=True) == b"%d" % i
    counting.looks = 0
    assert reader.recv(timeout_ms=50, wait_first=True) is None
    assert counting.looks > 0


def _probed(reader, counting, waits, timeout_ms):
    """Which of ``waits`` waits in a row (numbered from 1) looked without
    sleeping first; nothing comes, so each times out after ``timeout_ms``."""
    probed = []
    for wait in range(1, waits + 1):
        counting.looks = 0
        reader._wait(timeout_ms)
        if counting.looks:
            probed.append(wait)
    return probed


def test_a_reader_that_stopped_spinning_still_spins_one_wait_in_probe_every(spinning_reader):
    reader, counting, _ = spinning_reader(0.001, stopped=True)  # long waits lately
    spun = _probed(reader, counting, 2 * Spin.PROBE_EVERY, 5)
    assert len(spun) == 2, spun


def test_a_probe_that_waits_in_vain_doubles_the_interval_and_a_short_wait_resets_it(
    spinning_reader,
):
    reader, counting, theirs = spinning_reader(0.001, stopped=True)  # long waits lately
    assert _probed(reader, counting, 128, 2) == [8, 16, 32, 64, 128]
    # A short wait (the bytes are there): probes come one wait in PROBE_EVERY again.
    theirs.sendall(b"x")
    assert reader.recv(timeout_ms=1000, wait_first=True) == b"x"
    probed = _probed(reader, counting, 2 * Spin.PROBE_EVERY, 2)
    assert len(probed) == 2, probed


def test_a_reader_without_spin_never_looks_without_sleeping(spinning_reader):
    reader, counting, theirs = spinning_reader(spin=0.0)
    theirs.sendall(b"x")
    assert reader.recv(timeout_ms=1000, wait_first=True) == b"x"
    assert reader.recv(timeout_ms=20) is None
    assert counting.looks == 0 and counting.sleeps > 0


@pytest.mark.parametrize("name", ["lane_spin", "grpc_spin"])
def test_each_spin_is_an_option_and_an_environment_variable(monkeypatch, name):
    assert getattr(rrpc.RpcBackendOptions(**{name: 0}), name) == 0
    assert getattr(rrpc.RpcBackendOptions(), name) == 1e-3
    monkeypatch.setenv(f"RRPC_{name.upper()}", "0.0002")
    assert getattr(rrpc.RpcBackendOptions(), name) == 0.0002
    with pytest.raises(ValueError, match=name):
        rrpc.RpcBackendOptions(**{name: 1.0})
    with pytest.raises(TypeError, match=name):
        rrpc.RpcBackendOptions(**{name: "fast"})
