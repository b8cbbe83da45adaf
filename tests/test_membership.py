"""Dynamic membership (no world_size): workers that join late, leave, and come back.

Most tests run the group on a store that no worker hosts: a plain
``torch.distributed.TCPStore`` server in a process of its own (harness rank 0,
``_store``), as torchrun's c10d endpoint or a standalone server would be. Then
no member is special: rrpc rank 0 may leave first.
"""

import json
import logging
import os
import queue
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

import rrpc
import rrpc.optim
from harness import WorkerGroup, free_port, mp_context, outcome, run_workers
from rrpc import membership, shm
from rrpc.agent import current_agent


def _dynamic():
    del os.environ["WORLD_SIZE"]  # the harness sets it; without it membership is dynamic


def _store(rank, world_size, up, released, workers):
    """Harness rank 0: the group's store, hosted by no worker; it stays up until
    ``released`` (a semaphore) has been released once per worker. (Not Events: a
    test may kill this process, and setting an Event it waited on can hang.)"""
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False
    )
    up.set()
    assert all(released.acquire(timeout=100) for _ in range(workers))
    del store


def _events():
    """Membership events seen by this worker, as (kind, name, incarnation, seen at)."""
    seen = queue.SimpleQueue()
    rrpc.on_membership_change(
        lambda e: seen.put((e.kind, e.worker.name, e.incarnation, time.time()))
    )
    return seen


def _next_event(seen, kind, name):
    while True:
        event = seen.get(timeout=60)
        if event[:2] == (kind, name):
            return event


# -- A worker leaves; the others go on ----------------------------------------------

_gate = threading.Event()  # worker0: opens its slow call
_slow_started = None


def _slow_call():
    _slow_started.set()
    assert _gate.wait(60)
    return "drained"


def _leave_while_others_work(
    rank, world_size, up, joined, slow_started, left_seen, done, group_read, finished
):
    global _slow_started
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 2)
    assert up.wait(60)
    me = rank - 1  # rrpc ranks 0, 1, 2; worker0 (rank 0) leaves first
    _slow_started = slow_started
    seen = _events()
    rrpc.init_rpc(f"worker{me}", rank=me)
    joined[me].set()
    assert all(event.wait(60) for event in joined)
    if me == 0:
        assert slow_started.wait(60)  # worker1's call is running here
        threading.Thread(target=lambda: left_seen.wait(60) and _gate.set()).start()
        started = time.time()
        rrpc.shutdown()  # waits for worker1's call, which waits until worker1 saw the leave
        return {"shutdown_started": started, "shutdown_seconds": time.time() - started}
    result = {}
    if me == 1:
        in_flight = rrpc.rpc_async("worker0", _slow_call)
        kind, name, _, seen_at = _next_event(seen, "left", "worker0")
        left_seen.set()
        result["left_seen_at"] = seen_at
        start = time.monotonic()
        with pytest.raises(rrpc.PeerUnavailableError) as error:
            rrpc.rpc_sync("worker0", torch.add, args=(1, 1))
        result["fail_seconds"] = time.monotonic() - start
        result["error"] = str(error.value)
        result["in_flight"] = in_flight.wait()  # the leaver answered it before it left
        result["group"] = [w.name for w in rrpc.get_worker_infos()]
        done.set()
        assert group_read.wait(60)  # worker2 reads the group before this one leaves it
    else:  # worker2: calls worker1 all along, and sees worker0 go too
        calls = 0
        while not done.is_set():
            assert rrpc.rpc_sync("worker1", torch.add, args=(calls, 1)) == calls + 1
            calls += 1
        result["calls"] = calls
        result["event"] = _next_event(seen, "left", "worker0")[:2]
        result["group"] = [w.name for w in rrpc.get_worker_infos()]
        group_read.set()
    rrpc.shutdown()
    finished.release()
    return result


@pytest.mark.timeout(120)
def test_rank0_leaves_after_draining_while_the_others_keep_calling_each_other():
    events = [mp_context.Event() for _ in range(5)]
    up, slow_started, left_seen, done, group_read = events
    joined = [mp_context.Event() for _ in range(3)]
    args = (up, joined, slow_started, left_seen, done, group_read, mp_context.Semaphore(0))
    with WorkerGroup(_leave_while_others_work, 4, args=args, init=False) as group:
        store, worker0, worker1, worker2 = group.wait(110)
    assert store is None
    assert worker1["in_flight"] == "drained"
    assert isinstance(worker1["error"], str) and "worker0" in worker1["error"]
    assert "left the group" in worker1["error"]
    assert worker1["fail_seconds"] < 1.0
    assert worker1["group"] == ["worker1", "worker2"]
    assert worker2["group"] == ["worker1", "worker2"]
    assert worker2["event"] == ("left", "worker0")
    assert worker2["calls"] > 0
    seen_after = worker1["left_seen_at"] - worker0["shutdown_started"]
    print(
        f"\nleave seen by worker1 {seen_after * 1000:.0f} ms after worker0 called shutdown; "
        f"a call to it then failed in {worker1['fail_seconds'] * 1000:.1f} ms; "
        f"worker0's shutdown took {worker0['shutdown_seconds']:.2f} s; "
        f"worker2 made {worker2['calls']} calls to worker1 meanwhile"
    )
    assert seen_after < 5.0


# -- A worker dies and comes back under its name ------------------------------------


def _pid():
    return os.getpid()


def _rejoin(rank, world_size, up, first_in, called, killed, done, finished):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 2)
    assert up.wait(60)
    if rank == 1:  # worker0: stays throughout
        seen = _events()
        rrpc.init_rpc("worker0", rank=0)
        assert first_in.wait(60)
        first_pid = rrpc.rpc_sync("worker1", _pid)
        called.set()  # the test may kill worker1 now
        assert killed.wait(60)
        start = time.monotonic()
        with pytest.raises(rrpc.PeerUnavailableError):
            rrpc.rpc_sync("worker1", _pid)
        dead_seconds = time.monotonic() - start
        event = _next_event(seen, "joined", "worker1")
        if event[2] == 0:  # the first incarnation's join: wait for the second
            event = _next_event(seen, "joined", "worker1")
        second_pid = rrpc.rpc_sync("worker1", _pid)
        group = [(w.name, w.id) for w in rrpc.get_worker_infos()]
        done.set()
        rrpc.shutdown()
        finished.release()
        return {
            "first_pid": first_pid,
            "second_pid": second_pid,
            "incarnation": event[2],
            "dead_seconds": dead_seconds,
            "group": group,
        }
    if rank == 2:  # worker1, first incarnation: killed by the test
        rrpc.init_rpc("worker1", rank=1)
        first_in.set()
        # Until killed. (Not on a shared Event: setting one a killed process waited on can hang.)
        threading.Event().wait(100)
        return None
    assert killed.wait(60)  # worker1 again, a new process
    started = time.monotonic()
    rrpc.init_rpc("worker1", rank=1)
    join_seconds = time.monotonic() - started
    value = rrpc.remote("worker0", torch.add, args=(torch.ones(2), 3)).to_here()
    assert done.wait(60)
    rrpc.shutdown()
    finished.release()
    return {"value": value.tolist(), "pid": os.getpid(), "join_seconds": join_seconds}


@pytest.mark.timeout(120)
def test_a_killed_worker_rejoins_under_its_name_and_peers_reach_its_new_process():
    up, first_in, called, killed, done = (mp_context.Event() for _ in range(5))
    args = (up, first_in, called, killed, done, mp_context.Semaphore(0))
    with WorkerGroup(_rejoin, 4, args=args, init=False) as group:
        assert called.wait(90)
        group.kill(2)
        killed.set()
        store, worker0, _, again = group.wait(100, may_die=[2])
    assert worker0["first_pid"] == group.processes[2].pid
    assert worker0["second_pid"] == again["pid"] == group.processes[3].pid
    assert worker0["incarnation"] == 1
    assert worker0["dead_seconds"] < 2.0
    assert worker0["group"] == [("worker0", 0), ("worker1", 1)]
    assert again["value"] == [4.0, 4.0]
    print(f"\nrejoin: init_rpc of the new worker1 took {again['join_seconds']:.2f} s")


def _same_name_twice(rank, world_size, up, first_in, done, finished):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 1)
    assert up.wait(60)
    if rank == 1:
        rrpc.init_rpc("worker0", rank=0)
        first_in.set()
        assert done.wait(60)
        rrpc.shutdown()
        finished.release()
        return None
    assert first_in.wait(60)
    try:
        rrpc.init_rpc("worker0", rank=5)
        message = None
    except rrpc.RpcError as error:
        message = str(error)
    done.set()
    return message


@pytest.mark.timeout(90)
def test_a_name_held_by_a_running_worker_cannot_be_taken():
    up, first_in, done = (mp_context.Event() for _ in range(3))
    args = (up, first_in, done, mp_context.Semaphore(0))
    with WorkerGroup(_same_name_twice, 3, args=args, init=False) as group:
        *_, message = group.wait(80)
    assert message is not None and "worker name 'worker0' is not unique" in message
    assert "still runs at 127.0.0.1:" in message


# -- A leaver's shared memory --------------------------------------------------------

SLOT_FLOATS = 1 << 20  # 4 MiB: travels in a shared-memory slot of the sender's pool
_kept: list[torch.Tensor] = []  # worker0: a tensor from the leaver, kept past its leaving


def _keep(tensor):
    _kept.append(tensor)


def _numel(tensor):
    return tensor.numel()


def _mapped_of(pid):
    """The names of process ``pid``'s segments this worker maps (``shm.Attachments``)."""
    return sorted(
        name for name in current_agent().peers._attachments._maps if name.startswith(f"{pid}/")
    )


def _shm_bytes():
    """Bytes of this process's maps of rrpc's segments (its own and its peers')."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "memfd:rrpc-shm" in line:
                start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
                total += end - start
    return total


def _leaver_shares_memory(rank, world_size, up, joined, sent, measured, finished):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 2)
    assert up.wait(60)
    me = rank - 1  # worker1 leaves
    seen = _events()
    rrpc.init_rpc(f"worker{me}", rank=me)
    joined[me].set()
    assert all(event.wait(60) for event in joined)
    if me == 1:  # one slot worker0 keeps a tensor over, one it frees at once
        rrpc.rpc_sync("worker0", _keep, args=(torch.full((SLOT_FLOATS,), 7.0),))
        assert rrpc.rpc_sync("worker0", _numel, args=(torch.ones(SLOT_FLOATS),)) == SLOT_FLOATS
        sent.set()
        assert measured.wait(60)
        rrpc.shutdown()
        finished.release()
        return None
    assert sent.wait(60)
    leaver = rrpc.rpc_sync("worker1", _pid)
    before = {"names": _mapped_of(leaver), "bytes": _shm_bytes()}
    measured.set()
    _next_event(seen, "left", "worker1")
    deadline = time.monotonic() + 60
    while shm._alive(leaver):  # its process gone: only this worker's maps hold its slots
        assert time.monotonic() < deadline, f"the leaver (process {leaver}) still runs"
        time.sleep(0.01)  # polling /proc: no event tells a non-parent that a process ended
    after = {"names": _mapped_of(leaver), "bytes": _shm_bytes()}
    kept_reads = torch.equal(_kept[0], torch.full((SLOT_FLOATS,), 7.0))
    _kept.clear()
    freed_bytes = _shm_bytes()
    rrpc.shutdown()
    finished.release()
    return {"before": before, "after": after, "kept_reads": kept_reads, "freed": freed_bytes}


@pytest.mark.timeout(120)
def test_a_leavers_segments_are_unmapped_and_a_tensor_kept_over_one_still_reads():
    up, sent, measured = (mp_context.Event() for _ in range(3))
    joined = [mp_context.Event() for _ in range(2)]
    args = (up, joined, sent, measured, mp_context.Semaphore(0))
    with WorkerGroup(_leaver_shares_memory, 3, args=args, init=False) as group:
        _, worker0, _ = group.wait(110)
    slot = SLOT_FLOATS * 4
    before, after = worker0["before"], worker0["after"]
    assert len(before["names"]) == 3, before  # its probe and two slots: one kept, one freed
    assert after["names"] == [], after
    assert before["bytes"] - after["bytes"] >= slot, worker0  # the freed slot's map went at once
    assert worker0["kept_reads"]  # the kept one's map lives on with its tensor
    assert after["bytes"] - worker0["freed"] >= slot, worker0  # and goes with it


# -- RRefs, distributed autograd and the optimizer with late joiners ------------------


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x)


_model = None


def _parameter_rrefs():
    global _model
    _model = _Model()
    return [rrpc.RRef(p) for p in _model.parameters()]


def _forward(x):
    return _model(x)


def _parameters():
    return [p.detach().clone() for p in _model.parameters()]


def _to_here(rref):
    return rref.to_here()


def _late_joiners(
    rank, world_size, worker1_in, worker1_done, worker1_left, worker2_in, worker2_left
):
    _dynamic()  # worker0 hosts the store here: it joins first and leaves last
    if rank == 2:
        assert worker1_done.wait(90)
    elif rank == 1:
        assert worker1_in.wait(90)
    rrpc.init_rpc(f"worker{rank}", rank=rank)
    if rank == 0:
        seen = _events()
        before = rrpc.rref_debug_info()["num_owner_rrefs"]
        worker1_in.set()
        _next_event(seen, "joined", "worker1")
        # An early member makes a value on the late joiner, then hands it to a later one.
        on_worker1 = rrpc.remote("worker1", torch.mul, args=(torch.ones(2), 5))
        assert worker1_done.wait(90)
        _next_event(seen, "joined", "worker2")
        from_worker2 = rrpc.rpc_sync("worker2", _to_here, args=(on_worker1,)).tolist()
        del on_worker1
        worker2_in.set()
        _next_event(seen, "left", "worker1")
        worker1_left.set()
        after = rrpc.rref_debug_info()
        assert worker2_left.wait(90)
        rrpc.shutdown()
        return {"from_worker2": from_worker2, "owner_before": before, "after": after}
    if rank == 1:
        params = rrpc.rpc_sync("worker0", _parameter_rrefs)
        optimizer = rrpc.optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.5)
        x = torch.arange(6.0).reshape(2, 3)
        with rrpc.autograd.context() as context_id:
            loss = rrpc.rpc_sync("worker0", _forward, args=(x,)).pow(2).sum()
            rrpc.autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        # The same step in one process.
        local = _Model()
        torch.optim.SGD(local.parameters(), lr=0.5).zero_grad()
        local(x).pow(2).sum().backward()
        with torch.no_grad():
            expected = [(p - 0.5 * p.grad).tolist() for p in local.parameters()]
        got = [p.tolist() for p in rrpc.rpc_sync("worker0", _parameters)]
        worker1_done.set()
        assert worker2_in.wait(90)
        # Leaves holding RRefs to worker0's values (params, optimizer): it lets go of them.
        rrpc.shutdown()
        return {"expected": expected, "got": got}
    assert worker1_left.wait(90)
    rrpc.shutdown()
    worker2_left.set()
    return None


@pytest.mark.timeout(120)
def test_rrefs_autograd_and_optimizer_work_with_late_joiners_and_a_leaver_lets_go_of_its_rrefs():
    events = [mp_context.Event() for _ in range(5)]
    with WorkerGroup(_late_joiners, 3, args=events, init=False) as group:
        worker0, worker1, _ = group.wait(110)
    assert worker1["got"] == worker1["expected"]
    assert worker0["from_worker2"] == [5.0, 5.0]
    # Everything the leaver held of worker0's (parameters, its optimizer) is freed.
    assert worker0["after"]["num_owner_rrefs"] == worker0["owner_before"] == 0
    assert worker0["after"]["num_owner_forks"] == 0


# -- A worker that cannot reach the store ----------------------------------------------


def _store_lost(rank, world_size, up, joined, store_gone, finished, done, timeout):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, done, 2)
    assert up.wait(60)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("rrpc").addHandler(handler)
    rrpc.init_rpc(f"worker{rank}", rank=rank)
    joined[rank - 1].set()
    assert store_gone.wait(60)
    assert rrpc.rpc_sync(f"worker{2 - rank + 1}", torch.add, args=(1, 1)) == 2  # peers still fine
    start = time.monotonic()
    try:
        rrpc.shutdown(timeout=timeout)
        error = None
    except rrpc.RpcError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    finished[rank - 1].set()
    return {"seconds": seconds, "error": error, "lines": lines}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["frozen", "killed"])
def test_shutdown_within_its_timeout_when_the_store_is_unreachable(how):
    up, store_gone = mp_context.Event(), mp_context.Event()
    done = mp_context.Semaphore(0)
    joined = [mp_context.Event() for _ in range(2)]
    finished = [mp_context.Event() for _ in range(2)]
    timeout = 3.0
    args = (up, joined, store_gone, finished, done, timeout)
    with WorkerGroup(_store_lost, 3, args=args, init=False) as group:
        assert all(event.wait(60) for event in joined)
        if how == "frozen":
            group.send_signal(0, signal.SIGSTOP)  # accepts connections, never answers
        else:
            group.kill(0)
        store_gone.set()
        try:
            assert all(event.wait(60) for event in finished)
            # Let the workers exit first: a store request left blocked on the frozen
            # store must not wake up while their interpreter is finalizing.
            for worker in group.processes[1:]:
                worker.join(30)
        finally:
            if how == "frozen":
                group.send_signal(0, signal.SIGCONT)
            done.release()
            done.release()
        _, *workers = group.wait(60)
    for result in workers:
        assert result["seconds"] < timeout + 2.0, result
        assert "cannot reach the rendezvous store at 127.0.0.1:" in result["error"], result
        assert any("cannot reach the rendezvous store" in line for line in result["lines"])
    took = ", ".join(f"{result['seconds']:.2f} s" for result in workers)
    print(f"\nshutdown(timeout={timeout:g}) with the store {how}: {took}")


# -- A join whose store stops answering -------------------------------------------------


def _store_proxy(listen_port, store_port, trigger, delay):
    """A TCP proxy to the store that, from the first client packet holding
    ``trigger`` on, forwards the clients' bytes only ``delay`` seconds after
    they came (None: never; the store looks frozen: connected, silent).
    Returns the listening socket (close it to stop) and an Event set at the trigger."""
    listener = socket.create_server(("127.0.0.1", listen_port))
    triggered = threading.Event()
    frozen = threading.Event()  # never set: a timed wait that stands for the link's latency

    def pump(source, target, watch):
        try:
            while data := source.recv(65536):
                if watch and trigger in data:
                    triggered.set()
                if watch and triggered.is_set():
                    if delay is None:
                        continue  # swallowed
                    frozen.wait(delay)
                target.sendall(data)
        except OSError:
            return

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            store = socket.create_connection(("127.0.0.1", store_port))
            threading.Thread(target=pump, args=(client, store, True), daemon=True).start()
            threading.Thread(target=pump, args=(store, client, False), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, triggered


def _join_through(rank, world_size, proxy_port, init_timeout):
    _dynamic()
    options = rrpc.RpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{proxy_port}", init_timeout=init_timeout
    )
    outcome = []

    def join():
        start = time.monotonic()
        try:
            rrpc.init_rpc("late", rank=1, rpc_backend_options=options)
            outcome.append(("joined", time.monotonic() - start))
        except Exception as exc:
            outcome.append((f"{type(exc).__name__}: {exc}", time.monotonic() - start))

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    joiner.join(init_timeout + 20)
    if joiner.is_alive():
        return ("still in init_rpc", init_timeout + 20)
    return outcome[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "trigger, delay",
    [(b"/dynamic", None), (b"/name/late", None), (b"/dynamic", 0.4)],
    ids=["frozen-at-mode", "frozen-at-claim", "slow"],
)
def test_a_dynamic_join_ends_by_init_timeout_when_the_store_stops_answering(trigger, delay):
    """The store answers the connection and the incarnation's count, then stops
    answering (frozen) or answers every request ``delay`` late (slow: each
    request well within init_timeout, the join's ten or so not). Either way
    init_rpc ends by init_timeout, naming the step it was at."""
    init_timeout = 2.0
    store_port, proxy_port = free_port(), free_port()
    store = dist.TCPStore("127.0.0.1", store_port, None, True, wait_for_workers=False)
    listener, triggered = _store_proxy(proxy_port, store_port, trigger, delay)
    try:
        ((what, seconds),) = run_workers(
            _join_through, 1, args=(proxy_port, init_timeout), init=False, timeout=60
        )
    finally:
        listener.close()
        del store
    assert triggered.is_set()
    assert seconds < init_timeout + 1.5, (what, seconds)
    assert what.startswith("StoreUnreachableError: rank 1 cannot reach the rendezvous store"), what
    assert "(joining, " in what and "init_timeout (2 s)" in what, what
    if trigger == b"/name/late":
        assert "(joining, claiming worker name 'late')" in what, what
    print(f"\njoin through a store that stops answering ({delay=}): {seconds:.2f} s: {what}")


# -- Notices prove nothing by themselves ------------------------------------------------


@rrpc.functions.expose
def _whereabouts():
    return os.getpid()


def _forgeries():
    """worker2's false notices to worker0, as (what, index, event): events
    outside the log that only the log may hold, an index past the log's end,
    another member's "left" without its leave key, and a real index with a
    text that does not say what that event is."""
    group = current_agent().group
    group.catch_up()
    worker1 = dict(group.members["worker1"])
    elsewhere = {**worker1, "address": "127.0.0.1:1", "advertised": {}}
    ghost = {**elsewhere, "name": "ghost", "rank": 7}
    return [
        ("worker1 replaced", 0, elsewhere),
        ("a ghost joined", 0, ghost),
        ("a ghost joined next in the log", group.applied + 1, ghost),
        ("a ghost joined past the log's end", group.applied + 100, ghost),
        ("worker1 left, unproven", 0, {**worker1, "kind": "left"}),
        ("worker1 left, wrong key", 0, {**worker1, "kind": "left", "leave_key": "00" * 16}),
        ("worker1 left, as event 1 (a join)", 1, {**worker1, "kind": "left"}),
    ]


def _forged_notices(rank, world_size, up, joined, attacked, finished):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 3)
    assert up.wait(60)
    me = rank - 1
    rrpc.init_rpc(f"worker{me}", rank=me)
    joined[me].set()
    assert all(event.wait(60) for event in joined)
    result = None
    if me == 2:  # a member, authenticated, that no one should take at its word
        result = {
            what: outcome(
                rrpc.rpc_sync, "worker0", membership._notice, args=(index, json.dumps(event), 0.0)
            )
            for what, index, event in _forgeries()
        }
        attacked.set()
    elif me == 0:
        assert attacked.wait(60)
        result = {
            "names": [w.name for w in rrpc.get_worker_infos()],
            "worker1": outcome(rrpc.rpc_sync, "worker1", _whereabouts, timeout=10),
        }
    assert attacked.wait(60)
    rrpc.shutdown()
    finished.release()
    return result


@pytest.mark.timeout(120)
def test_a_member_cannot_forge_a_membership_change_on_another_in_restricted_mode():
    up, attacked = mp_context.Event(), mp_context.Event()
    joined = [mp_context.Event() for _ in range(3)]
    env = {"RRPC_AUTH_TOKEN": "membership-token", "RRPC_RESTRICTED": "1"}
    args = (up, joined, attacked, mp_context.Semaphore(0))
    with WorkerGroup(_forged_notices, 4, args=args, env=env, init=False) as group:
        _, worker0, _, forger = group.wait(100)
    for what, reply in forger.items():
        if what == "worker1 left, as event 1 (a join)":
            assert "value" in reply, (what, reply)  # a real event, read from the log: a join
            continue
        assert reply.get("type") == "RpcError", (what, reply)
        assert "worker0 ignored a membership notice" in reply["message"], (what, reply)
    assert worker0["names"] == ["worker0", "worker1", "worker2"]
    assert worker0["worker1"].get("value") == group.processes[2].pid, worker0


def _leave_without_store(rank, world_size, up, joined, store_gone, left, finished):
    _dynamic()
    if rank == 0:
        return _store(rank, world_size, up, finished, 2)
    assert up.wait(60)
    seen = _events()
    rrpc.init_rpc(f"worker{rank - 1}", rank=rank - 1)
    joined[rank - 1].set()
    assert all(event.wait(60) for event in joined)
    assert store_gone.wait(60)
    if rank == 2:  # worker1 leaves; its "left" cannot reach the log, so it tells worker0
        membership.REQUEST_LIMIT = 2.0  # the store's limit: not 10 s of this test's time
        error = outcome(rrpc.shutdown)
        left.set()
        finished.release()
        return error
    assert left.wait(60)
    event = _next_event(seen, "left", "worker1")
    # Gone from the directory, with why (a call by name would ask the frozen store
    # first whether a worker1 joined again).
    departed = current_agent().peers.departed.get("worker1")
    rrpc.shutdown(graceful=False)  # the store is still frozen
    finished.release()
    return {"event": event[:3], "departed": departed}


@pytest.mark.timeout(120)
def test_a_leaver_that_cannot_reach_the_store_still_tells_the_members_itself():
    """The one notice outside the log: the leaver's "left", proven by its key."""
    up, store_gone, left = (mp_context.Event() for _ in range(3))
    joined = [mp_context.Event() for _ in range(2)]
    args = (up, joined, store_gone, left, mp_context.Semaphore(0))
    with WorkerGroup(_leave_without_store, 3, args=args, init=False) as group:
        try:
            assert all(event.wait(60) for event in joined)
            group.send_signal(0, signal.SIGSTOP)  # accepts connections, never answers
            store_gone.set()
            assert left.wait(90)
            for worker in group.processes[1:]:
                worker.join(60)
        finally:
            group.send_signal(0, signal.SIGCONT)
        _, worker0, leaver = group.wait(60)
    assert "cannot reach the rendezvous store" in leaver.get("message", ""), leaver
    assert worker0["event"] == ("left", "worker1", 0), worker0
    assert worker0["departed"] == "worker 'worker1' (rank 1) left the group", worker0
