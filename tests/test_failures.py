"""Failures surface as clear errors, promptly, and the workers keep serving.

Timeouts, remote exceptions, values that do not pickle, a peer that dies,
shutdown with calls in flight, init again after shutdown, and set-up errors
(duplicate name, rank out of range, a rank that never joins).

Each world is started once per module fixture and records what it saw; the
tests then assert on those records, one behaviour per test.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import rrpc
from harness import WorkerGroup, free_port, mp_context, run_workers
from harness import outcome as _outcome

REPO = Path(__file__).resolve().parent.parent

# -- Functions the workers run -------------------------------------------------


def _whoami():
    return rrpc.get_worker_info().name


def _echo(value):
    return value


def _sleep_then_return(seconds, value):
    time.sleep(seconds)  # a slow remote function
    return value


def _raise_value_error(x):
    raise ValueError(f"bad value {x}")


class _CustomError(RuntimeError):
    """Importable on both sides: re-raised as itself."""


def _raise_custom_error():
    raise _CustomError("custom failure", 17)


class _TwoArgError(Exception):
    """Pickles, but cannot be unpickled: BaseException.__reduce__ replays only self.args."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def _raise_two_arg_error():
    raise _TwoArgError("E7", "the detail")


def _raise_local_class():
    class LocalError(Exception):
        pass

    raise LocalError("only the callee knows this type")


def _make_lock():
    return threading.Lock()


class _RefusesToLoad:
    """Pickles fine; unpickling it (on the callee) raises."""

    def __reduce__(self):
        return (_refuse, ("refuse to load",))


def _refuse(message):
    raise RuntimeError(message)


# -- Timeouts, remote exceptions, unpicklable values (one world) -----------------

DEFAULT_TIMEOUT = 1.0


def _provoke_errors(rank, world_size):
    if rank != 0:
        return None
    seen = {}
    seen["explicit timeout"] = _outcome(
        rrpc.rpc_sync, "worker1", _sleep_then_return, args=(4, "late"), timeout=0.5
    )
    seen["default timeout"] = _outcome(
        lambda: rrpc.rpc_async("worker1", _sleep_then_return, args=(4, "late")).wait()
    )
    seen["no timeout"] = _outcome(
        rrpc.rpc_sync, "worker1", _sleep_then_return, args=(1.5, "on time"), timeout=0
    )
    seen["after timeouts"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
    seen["timeouts counted"] = rrpc.stats()["worker1"]["timeouts"]

    seen["value error"] = _outcome(rrpc.rpc_sync, "worker1", _raise_value_error, args=(42,))
    seen["custom error"] = _outcome(rrpc.rpc_sync, "worker1", _raise_custom_error)
    seen["custom error args"] = None
    try:
        rrpc.rpc_sync("worker1", _raise_custom_error)
    except _CustomError as exc:
        seen["custom error args"] = exc.args
    seen["two-arg error"] = _outcome(rrpc.rpc_sync, "worker1", _raise_two_arg_error)
    seen["local error"] = _outcome(rrpc.rpc_sync, "worker1", _raise_local_class)
    seen["async error"] = _outcome(
        lambda: rrpc.rpc_async("worker1", _raise_value_error, args=(5,)).wait()
    )

    sent_before = rrpc.stats()["worker1"]["calls_sent"]
    seen["lock argument"] = _outcome(rrpc.rpc_sync, "worker1", _echo, args=(threading.Lock(),))
    seen["sent for the lock argument"] = rrpc.stats()["worker1"]["calls_sent"] - sent_before
    seen["after lock argument"] = _outcome(rrpc.rpc_sync, "worker1", _echo, args=(torch.ones(2),))
    seen["argument that fails to load"] = _outcome(
        rrpc.rpc_sync, "worker1", _echo, args=(_RefusesToLoad(),)
    )
    seen["after argument that fails to load"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
    seen["lock result"] = _outcome(rrpc.rpc_sync, "worker1", _make_lock)
    seen["after lock result"] = _outcome(rrpc.rpc_sync, "worker1", _whoami)
    seen["lock result to self"] = _outcome(rrpc.rpc_sync, "worker0", _make_lock)
    seen["after lock result to self"] = _outcome(rrpc.rpc_sync, "worker0", _whoami)
    return seen


@pytest.fixture(scope="module")
def errors():
    options = rrpc.RpcBackendOptions(rpc_timeout=DEFAULT_TIMEOUT)
    return run_workers(_provoke_errors, 2, backend_options=options, timeout=60)[0]


def test_call_past_its_timeout_fails_at_its_timeout_naming_peer_and_function(errors):
    seen = errors["explicit timeout"]
    assert seen["type"] == "RpcTimeoutError"
    assert "TimeoutError" in seen["types"] and "RpcError" in seen["types"]
    assert 0.5 <= seen["elapsed"] < 3.0  # well before the reply would come (4 s)
    assert "_sleep_then_return" in seen["message"]
    assert "worker1" in seen["message"]
    assert "timed out after 0.5 s" in seen["message"]


def test_default_timeout_is_rpc_timeout_of_the_options(errors):
    seen = errors["default timeout"]
    assert seen["type"] == "RpcTimeoutError"
    assert DEFAULT_TIMEOUT <= seen["elapsed"] < 3.0  # well before the reply would come (4 s)
    assert f"timed out after {DEFAULT_TIMEOUT:g} s" in seen["message"]


def test_timeout_zero_waits_as_long_as_the_call_takes(errors):
    assert errors["no timeout"]["value"] == "on time"
    assert errors["no timeout"]["elapsed"] >= 1.5


def test_worker_keeps_serving_after_timeouts_and_counts_them(errors):
    assert errors["after timeouts"]["value"] == "worker1"
    assert errors["timeouts counted"] == 2


def test_remote_exception_reraises_with_its_type_message_and_remote_traceback(errors):
    seen = errors["value error"]
    assert seen["type"] == "ValueError"
    assert seen["message"] == "bad value 42"
    traceback_text = seen["remote_traceback"]
    assert "in _raise_value_error" in traceback_text
    assert 'raise ValueError(f"bad value {x}")' in traceback_text
    assert traceback_text.rstrip().endswith("ValueError: bad value 42")
    (note,) = seen["notes"]
    assert note.startswith("\nRemote traceback (on worker1):\n")
    assert "in _raise_value_error" in note
    assert errors["async error"]["type"] == "ValueError"
    assert errors["async error"]["message"] == "bad value 5"


def test_user_exception_class_reraises_as_itself_with_its_args(errors):
    assert errors["custom error"]["type"] == "_CustomError"
    assert errors["custom error args"] == ("custom failure", 17)
    assert "in _raise_custom_error" in errors["custom error"]["remote_traceback"]


def test_exception_that_cannot_be_unpickled_on_the_caller_becomes_remote_error(errors):
    seen = errors["two-arg error"]
    assert seen["type"] == "RemoteError"
    assert "RpcError" in seen["types"]
    assert seen["attributes"]["type_name"].endswith("._TwoArgError")
    assert seen["attributes"]["remote_message"] == "E7: the detail"
    assert seen["message"].endswith("._TwoArgError: E7: the detail")
    assert "in _raise_two_arg_error" in seen["remote_traceback"]


def test_exception_whose_class_exists_only_on_the_callee_becomes_remote_error(errors):
    seen = errors["local error"]
    assert seen["type"] == "RemoteError"
    assert seen["attributes"]["type_name"].endswith("_raise_local_class.<locals>.LocalError")
    assert seen["attributes"]["remote_message"] == "only the callee knows this type"
    assert "in _raise_local_class" in seen["remote_traceback"]


def test_unpicklable_argument_fails_on_the_caller_naming_the_function_then_calls_work(errors):
    seen = errors["lock argument"]
    assert seen["type"] == "SerializationError"
    assert "RpcError" in seen["types"] and "TypeError" in seen["types"]
    assert "_echo" in seen["message"]
    assert "lock" in seen["message"]
    assert errors["sent for the lock argument"] == 0  # refused before sending
    assert torch.equal(errors["after lock argument"]["value"], torch.ones(2))


def test_argument_the_callee_cannot_unpickle_fails_clearly_and_the_callee_keeps_serving(errors):
    seen = errors["argument that fails to load"]
    assert seen["type"] == "SerializationError"
    assert "refuse to load" in seen["message"]
    assert errors["after argument that fails to load"]["value"] == "worker1"


def test_unpicklable_result_fails_clearly_on_the_caller_and_the_callee_keeps_serving(errors):
    for target in ("", " to self"):
        seen = errors["lock result" + target]
        assert seen["type"] == "SerializationError", target
        assert "cannot pickle a value of type lock" in seen["message"], target
    assert errors["after lock result"]["value"] == "worker1"
    assert errors["after lock result to self"]["value"] == "worker0"


# -- The callee's log and torch's error types (one world) -------------------------


class _Kept(logging.Handler):
    """Keeps what one logger emits on a worker, for the test to read over RPC."""

    lines: list[str] = []

    def emit(self, record):
        _Kept.lines.append(f"{record.levelname} {record.name} {record.getMessage()}")


def _keep_request_error_log(level):
    logger = logging.getLogger("rrpc.request_errors")
    logger.setLevel(level)
    if not any(isinstance(handler, _Kept) for handler in logger.handlers):
        logger.addHandler(_Kept())
    _Kept.lines.clear()


def _kept_log():
    return list(_Kept.lines)


def _callee_log_and_builtin_errors(rank, world_size):
    if rank != 0:
        return None
    seen = {}
    rrpc.rpc_sync("worker1", _keep_request_error_log, args=(logging.WARNING,))
    seen["raised"] = [
        _outcome(rrpc.rpc_sync, "worker1", _raise_value_error, args=(i,)) for i in range(3)
    ]
    seen["log"] = rrpc.rpc_sync("worker1", _kept_log)
    rrpc.rpc_sync("worker1", _keep_request_error_log, args=(logging.ERROR,))
    # Another error type: the rate limit alone would not hold it back.
    seen["silenced"] = _outcome(rrpc.rpc_sync, "worker1", _raise_custom_error)
    seen["silenced log"] = rrpc.rpc_sync("worker1", _kept_log)

    seen["builtin, sync"] = _outcome(rrpc.rpc_sync, "worker1", torch.add, args=())
    seen["builtin, async"] = _outcome(lambda: rrpc.rpc_async("worker1", torch.add).wait())
    seen["builtin, remote"] = _outcome(
        lambda: rrpc.remote("worker1", torch.add, args=(torch.ones(2), "x")).to_here()
    )
    seen["builtin, to self"] = _outcome(rrpc.rpc_sync, "worker0", torch.ones, kwargs={"bogus": 1})
    seen["user function TypeError"] = _outcome(rrpc.rpc_sync, "worker1", _echo, args=(1, 2))
    return seen


@pytest.fixture(scope="module")
def callee_side():
    return run_workers(_callee_log_and_builtin_errors, 2, timeout=60)[0]


def test_the_callee_logs_a_user_function_error_once_with_its_traceback(callee_side):
    # torch prints every one on the callee's stderr; rrpc logs the first of a
    # kind per caller (logs.INTERVAL), which the caller also gets, traceback and all.
    for seen in callee_side["raised"]:
        assert seen["type"] == "ValueError"
        assert "in _raise_value_error" in seen["remote_traceback"]
    (line,) = callee_side["log"]
    assert line.startswith(
        "WARNING rrpc.request_errors rrpc: worker1: a request from worker0 raised "
        "(the caller gets it):\nTraceback (most recent call last):\n"
    )
    assert 'raise ValueError(f"bad value {x}")' in line
    assert line.endswith("ValueError: bad value 0")


def test_the_callee_log_of_request_errors_can_be_silenced_alone(callee_side):
    assert callee_side["silenced"]["type"] == "_CustomError"
    assert callee_side["silenced log"] == []


def test_a_builtin_with_wrong_arguments_raises_torchs_runtime_error_on_every_path(callee_side):
    # torch matches a builtin's arguments to its TorchScript schemas: a RuntimeError
    # (a local call would raise the Python binding's TypeError).
    for path in ("sync", "async", "remote", "to self"):
        seen = callee_side[f"builtin, {path}"]
        assert seen["type"] == "RuntimeError", (path, seen)
        assert seen["message"].startswith(
            "Overloaded torch operator invoked from Python failed to match any schema:\n"
        ), (path, seen)
    assert "aten::add()" in callee_side["builtin, sync"]["message"]
    assert "aten::ones()" in callee_side["builtin, to self"]["message"]


def test_a_user_functions_type_error_stays_a_type_error(callee_side):
    seen = callee_side["user function TypeError"]
    assert seen["type"] == "TypeError"
    assert "_echo() takes 1 positional argument but 2 were given" in seen["message"]


# -- The callee fails after a request ran (one world) ------------------------------


def _miscount_this_reply(then_raise):
    """Make the count of this request's reply fail (an internal error after the
    function ran, as a dummy metrics row did once in the benchmark), once."""
    from rrpc import metrics

    real = metrics.replied

    def broken(*args, **kwargs):
        metrics.replied = real
        raise AttributeError("the reply's row cannot count")

    metrics.replied = broken
    if then_raise:
        raise ValueError("the function's own error")
    return "the value"


_str_fails_here = []


class _UnprintableError(Exception):
    """Its text fails on the worker that raised it (not on the one it reaches)."""

    def __str__(self):
        if _str_fails_here:
            raise RuntimeError("no text for this error here")
        return "printable on the caller"


def _raise_interrupt():
    raise KeyboardInterrupt


def _raise_unprintable():
    _str_fails_here.append(True)
    raise _UnprintableError()


def _miscount_the_next_reply_here():
    """The same on the caller: counting the next reply that arrives here fails, once."""
    from rrpc import metrics

    real = metrics.answered

    def broken(*args, **kwargs):
        metrics.answered = real
        raise AttributeError("the reply's row cannot count")

    metrics.answered = broken


def _replies_despite_failed_counting(rank, world_size):
    if rank != 0:
        return None
    _miscount_the_next_reply_here()
    return {
        "counted here": _outcome(rrpc.rpc_sync, "worker1", _echo, ("arrived",), timeout=5),
        "value": _outcome(rrpc.rpc_sync, "worker1", _miscount_this_reply, (False,), timeout=5),
        "error": _outcome(rrpc.rpc_sync, "worker1", _miscount_this_reply, (True,), timeout=5),
        "unprintable": _outcome(rrpc.rpc_sync, "worker1", _raise_unprintable, timeout=5),
        "exit": _outcome(rrpc.rpc_sync, "worker1", sys.exit, (3,)),
        "interrupt": _outcome(lambda: rrpc.rpc_async("worker1", _raise_interrupt).wait()),
        "after": _outcome(rrpc.rpc_sync, "worker1", _whoami),
    }


@pytest.fixture(scope="module")
def failed_after_run():
    return run_workers(_replies_despite_failed_counting, 2, timeout=60)[0]


def test_a_reply_goes_even_if_the_callee_fails_to_count_it(failed_after_run):
    # Seen in `bench.py --overhead`: the reply was dropped and its caller waited
    # for its timeout (60 s), the callee logging only "a request handler failed".
    seen = failed_after_run
    assert seen["value"]["value"] == "the value", seen
    assert seen["error"]["type"] == "ValueError", seen
    assert seen["error"]["message"] == "the function's own error"
    assert seen["counted here"]["value"] == "arrived", seen
    for call in ("counted here", "value", "error", "unprintable"):
        assert seen[call]["elapsed"] < 4.0, seen  # not at the 5 s timeout
    assert seen["after"]["value"] == "worker1"


def test_a_callees_system_exit_or_interrupt_arrives_as_a_runtime_error(failed_after_run):
    # As torch (a RuntimeError naming it): re-raised as such, a callee's
    # SystemExit would end a caller that catches only Exception.
    expected = {"exit": "builtins.SystemExit: 3", "interrupt": "builtins.KeyboardInterrupt"}
    for call, text in expected.items():
        seen = failed_after_run[call]
        assert seen["type"] == "RemoteError" and "RuntimeError" in seen["types"], seen
        assert f"Original exception on remote side was {text}" in seen["message"], seen


def test_an_error_whose_text_fails_on_the_callee_still_reaches_the_caller(failed_after_run):
    seen = failed_after_run["unprintable"]
    assert seen["type"] == "_UnprintableError", seen
    assert "<exception str() failed>" in seen["remote_traceback"]


# -- A peer dies ---------------------------------------------------------------

_started = []
_never = threading.Event()


def _block_until_killed():
    _started.append(1)
    _never.wait()


def _count_started():
    return len(_started)


def _wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)  # polling a condition with a deadline


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _call_the_peer_that_dies(rank, world_size, ready, killed):
    captured = _Captured()
    logging.getLogger("rrpc").addHandler(captured)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 1:
        _never.wait()  # the test kills this worker
    pending = [rrpc.rpc_async("worker1", _block_until_killed) for _ in range(3)]
    if rank == 0:
        # worker0 and worker2 have three calls each running on worker1.
        started = lambda: rrpc.rpc_sync("worker1", _count_started) == 6  # noqa: E731
        _wait_for(started, 30, "six calls running on worker1")
        ready.set()
    assert killed.wait(60)
    seen = {
        "pending": [_outcome(future.wait) for future in pending],
        "new calls": [_outcome(rrpc.rpc_sync, "worker1", _whoami) for _ in range(3)],
        "others": _outcome(rrpc.rpc_sync, f"worker{2 - rank}", _whoami),
    }
    start = time.monotonic()
    rrpc.shutdown()
    seen["graceful shutdown took"] = time.monotonic() - start
    seen["log"] = captured.lines
    return seen


@pytest.fixture(scope="module")
def peer_death():
    """(what each rank saw, the wall-clock time just before worker1 was killed)."""
    ready, killed = mp_context.Event(), mp_context.Event()
    with WorkerGroup(_call_the_peer_that_dies, 3, args=(ready, killed), init=False) as group:
        assert ready.wait(60), "worker0 never reported its calls as started"
        killed_at = time.time()
        group.kill(1)
        killed.set()
        return group.wait(timeout=60), killed_at


def test_peer_death_fails_every_pending_call_within_seconds_naming_the_peer(peer_death):
    results, killed_at = peer_death
    for rank in (0, 2):
        for seen in results[rank]["pending"]:
            assert seen["type"] == "PeerUnavailableError", seen
            assert "worker1" in seen["message"]
            assert "_block_until_killed" in seen["message"]
            assert seen["finished at"] - killed_at < 30.0  # not at the 60 s default timeout


def test_a_dead_peer_is_logged_once_by_each_survivor_naming_it_and_its_address(peer_death):
    results, _ = peer_death
    for rank in (0, 2):
        lost = [line for line in results[rank]["log"] if "stream to worker1" in line]
        assert len(lost) == 1, results[rank]["log"]  # one line, not one per pending call
        assert lost[0].startswith(f"rrpc: worker{rank}: stream to worker1 at 127.0.0.1:")
        dead = [line for line in results[rank]["log"] if "declared dead" in line]
        assert len(dead) == 1 and "[1]" in dead[0], results[rank]["log"]


def _arrive_while_the_host_probes(index, processes, probing, arrived):
    # Ranks 0 (the store's host) and 2 of a world of 3 (process index 1 is rank
    # 2); rank 1 never comes. Rank 2 arrives at the shutdown barrier while rank 0
    # probes the ranks it found missing, [1, 2], and then passes the barrier
    # (rank 1 confirmed gone), as a peer that passes first and stops does. Its
    # probe by rank 0 then fails as a dead rank's would.
    from rrpc.rendezvous import Rendezvous

    rank = 2 * index
    captured = _Captured()
    logging.getLogger("rrpc").addHandler(captured)
    rendezvous = Rendezvous(rank, 3, "127.0.0.1", int(os.environ["MASTER_PORT"]), timeout=30)
    if rank == 0:

        def gone(ranks, limit):
            probing.set()
            assert arrived.wait(30)  # rank 2 passed the barrier meanwhile
            return True  # and is unreachable now, as rank 1 is

    else:
        assert probing.wait(30)

        def gone(ranks, limit):
            arrived.set()
            return ranks == [1]

    rendezvous.barrier("shutdown", 30, gone=gone, suspects={1})
    declared = sorted(rendezvous._gone)
    rendezvous.close(timeout=0)
    return declared, captured.lines


def test_a_rank_that_arrives_while_it_is_probed_is_not_declared_dead():
    # Seen once in CI: worker0 logged "ranks [1, 2] no longer answer: declared
    # dead at barrier 'shutdown'", worker2 alive; worker2 had arrived and
    # stopped while worker0 probed the ranks it had found missing a moment before.
    seen = run_workers(
        _arrive_while_the_host_probes,
        args=(mp_context.Event(), mp_context.Event()),
        init=False,
        timeout=60,
    )
    for declared, lines in seen:
        assert declared == [1]
        dead = [line for line in lines if "declared dead" in line]
        assert len(dead) == 1 and "ranks [1] no longer answer" in dead[0], lines


def test_calls_to_a_dead_peer_fail_fast(peer_death):
    results, _ = peer_death
    for rank in (0, 2):
        for seen in results[rank]["new calls"]:
            assert seen["type"] == "PeerUnavailableError", seen
            assert "worker1" in seen["message"]
            assert seen["elapsed"] < 10.0  # not at the 60 s default timeout


def test_survivors_keep_talking_and_shut_down_gracefully_after_a_peer_died(peer_death):
    results, _ = peer_death
    assert results[0]["others"]["value"] == "worker2"
    assert results[2]["others"]["value"] == "worker0"
    for rank in (0, 2):
        assert results[rank]["graceful shutdown took"] < 20.0


# -- Shutdown and init again (one world) ------------------------------------------

_unblock = threading.Event()


def _block_until_unblocked():
    _unblock.wait(30)
    return "unblocked"


def _unblock_here():
    _unblock.set()


def _shutdown_and_init_again(rank, world_size, second_port, third_port, fourth_port, stopped):
    other = f"worker{1 - rank}"
    seen = {}

    # 1. Graceful shutdown while calls are in flight in both directions.
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    in_flight = [
        rrpc.rpc_async(other, _sleep_then_return, args=(0.2 + 0.01 * i, i)) for i in range(20)
    ]
    rrpc.shutdown()
    seen["done after graceful shutdown"] = [f.done() for f in in_flight]
    seen["values"] = [f.wait() for f in in_flight]

    # 2. Init again in the same process, on a new rendezvous port, rank and
    #    world size from the environment as torchrun sets them.
    os.environ["MASTER_PORT"] = str(second_port)
    rrpc.init_rpc(f"worker{rank}")
    seen["after init again"] = rrpc.rpc_sync(other, torch.add, args=(torch.ones(2), rank))
    seen["name after init again"] = rrpc.rpc_sync(other, _whoami)
    rrpc.shutdown()

    # 3. Shutdown that is not graceful fails the calls still pending.
    os.environ["MASTER_PORT"] = str(third_port)
    rrpc.init_rpc(f"worker{rank}")
    if rank == 0:
        pending = [rrpc.rpc_async(other, _block_until_unblocked) for _ in range(3)]
        start = time.monotonic()
        rrpc.shutdown(graceful=False)
        seen["not graceful"] = [_outcome(f.wait) for f in pending]
        seen["not graceful took"] = time.monotonic() - start
        seen["call after shutdown"] = _outcome(rrpc.rpc_sync, other, _whoami)
        stopped.set()
    else:
        assert stopped.wait(30)
        _unblock.set()
        rrpc.shutdown(graceful=False)

    # 4. As in torch, timeout=0 means no limit: a worker with nothing left to do
    #    waits in shutdown for one that is still working (a parameter server
    #    typically waits there for the whole training run).
    os.environ["MASTER_PORT"] = str(fourth_port)
    rrpc.init_rpc(f"worker{rank}")
    if rank == 0:
        time.sleep(2.0)  # still working
        rrpc.shutdown()
    else:
        seen["shutdown without a time limit"] = _outcome(rrpc.shutdown, timeout=0)
    return seen


@pytest.fixture(scope="module")
def lifecycle():
    stopped = mp_context.Event()
    ports = (free_port(), free_port(), free_port())
    return run_workers(_shutdown_and_init_again, 2, args=(*ports, stopped), init=False, timeout=90)


def test_graceful_shutdown_completes_every_call_in_flight(lifecycle):
    for rank in (0, 1):
        assert lifecycle[rank]["done after graceful shutdown"] == [True] * 20
        assert lifecycle[rank]["values"] == list(range(20))


def test_init_again_in_the_same_process_after_shutdown_works(lifecycle):
    assert torch.equal(lifecycle[0]["after init again"], torch.full((2,), 1.0))
    assert torch.equal(lifecycle[1]["after init again"], torch.full((2,), 2.0))
    assert lifecycle[0]["name after init again"] == "worker1"
    assert lifecycle[1]["name after init again"] == "worker0"


def test_shutdown_not_graceful_fails_pending_calls_at_once(lifecycle):
    seen = lifecycle[0]
    for outcome in seen["not graceful"]:
        assert outcome["type"] == "RpcError"
        assert "worker0" in outcome["message"] and "shut down" in outcome["message"]
    assert seen["not graceful took"] < 15.0  # not when the calls end by themselves (30 s)
    assert seen["call after shutdown"]["type"] == "RpcError"
    assert "not been initialized" in seen["call after shutdown"]["message"]


def test_graceful_shutdown_with_timeout_zero_waits_for_a_worker_still_working(lifecycle):
    seen = lifecycle[1]["shutdown without a time limit"]
    assert seen.get("type") is None, seen
    assert seen["elapsed"] >= 1.5


def test_shutdown_waits_without_a_time_limit_by_default_like_torch():
    import inspect

    import torch.distributed.rpc as torch_rpc

    def default(shutdown):
        return inspect.signature(shutdown).parameters["timeout"].default

    assert default(rrpc.shutdown) == default(torch_rpc.shutdown) == 0


def test_a_script_that_raises_without_shutdown_exits_and_its_peer_shuts_down():
    script = Path(__file__).resolve().parent / "scripts" / "raise_without_shutdown.py"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    processes = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=60) for process in processes]
    finally:
        for process in processes:
            process.kill()
    (out0, err0), (out1, err1) = outputs
    assert processes[0].returncode == 1 and "boom, without shutdown" in err0, err0[-3000:]
    assert processes[1].returncode == 0, err1[-3000:]
    assert out0 == "CALLED worker1\n" and out1 == "CALLED worker0\nSHUT DOWN\n", (out0, out1)


# -- Set-up errors -------------------------------------------------------------


def _init_and_report(rank, world_size, name, options):
    start = time.monotonic()
    try:
        rrpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - start,
        }
    rrpc.shutdown()
    return {"value": "joined"}


def _setup_errors(rank, world_size, lonely_ports):
    seen = {"duplicate": _init_and_report(rank, world_size, "twin", None)}
    # Then each rank alone founds a world of three on its own port; nobody else comes.
    os.environ["MASTER_PORT"] = str(lonely_ports[rank])
    options = rrpc.RpcBackendOptions(init_timeout=2.0)
    seen["never joined"] = _init_and_report(0, 3, "alone", options)
    return seen


@pytest.fixture(scope="module")
def setup_errors():
    ports = [free_port(), free_port()]
    return run_workers(_setup_errors, 2, args=(ports,), init=False, timeout=60)


def test_duplicate_worker_name_is_rejected_on_every_rank_naming_the_duplicate(setup_errors):
    for rank in (0, 1):
        seen = setup_errors[rank]["duplicate"]
        assert seen.get("type") == "RpcError", seen
        assert seen["message"] == "worker name 'twin' is not unique: ranks [0, 1] all use it"


def test_rendezvous_times_out_naming_the_ranks_that_never_joined(setup_errors):
    for rank in (0, 1):
        seen = setup_errors[rank]["never joined"]
        assert seen.get("type") == "RpcError", seen
        assert "timed out after 2 s" in seen["message"]
        assert "rank(s) [1, 2] of world_size 3 never arrived" in seen["message"]
        assert 2.0 <= seen["elapsed"] < 4.0


@pytest.mark.parametrize(
    ("rank", "world_size", "message"),
    [
        (2, 2, "rank 2 is out of range for world_size 2"),
        (5, 3, "rank 5 is out of range for world_size 3"),
        (0, 0, "world_size must be >= 1, got 0"),
    ],
)
def test_rank_out_of_range_is_a_value_error_before_anything_starts(rank, world_size, message):
    with pytest.raises(ValueError) as error:
        rrpc.init_rpc("w", rank=rank, world_size=world_size)
    assert str(error.value) == message


def test_missing_rank_and_world_size_say_which_variable_to_set(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as error:
        rrpc.init_rpc("w", world_size=2)
    assert "RANK" in str(error.value) and "rank=" in str(error.value)


def test_pickle_of_the_two_arg_error_really_fails_to_load():
    # Guards the premise of the RemoteError test above.
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(_TwoArgError("E7", "the detail")))


# -- A peer freezes (SIGSTOP) ----------------------------------------------------


def _call_the_peer_that_freezes(rank, world_size, ready, frozen, measured, resumed, done):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank != 0:
        # worker1 waits on `resumed`, which only it and worker0 wait on after
        # SIGCONT: a process stopped inside an Event's lock blocks its waiters.
        assert (resumed if rank == 1 else done).wait(120)
        if rank == 1:
            assert done.wait(120)
        rrpc.shutdown()
        return None
    pending = [rrpc.rpc_async("worker1", _block_until_killed) for _ in range(2)]
    started = lambda: rrpc.rpc_sync("worker1", _count_started) == 2  # noqa: E731
    _wait_for(started, 30, "two calls running on worker1")
    ready.set()
    assert frozen.wait(60)
    frozen_at = time.monotonic()
    seen = {"pending": [], "survivor": _outcome(rrpc.rpc_sync, "worker2", _whoami)}
    for future in pending:
        outcome = _outcome(future.wait)
        outcome["after"] = time.monotonic() - frozen_at
        seen["pending"].append(outcome)
    seen["survivor after"] = _outcome(rrpc.rpc_sync, "worker2", _whoami)
    measured.set()
    assert resumed.wait(60)
    seen["after resume"] = _outcome(rrpc.rpc_sync, "worker1", _whoami, timeout=20)
    done.set()
    rrpc.shutdown()
    return seen


@pytest.mark.timeout(180)
def test_a_frozen_peer_fails_pending_calls_after_peer_timeout_and_is_usable_after_resume():
    ready, frozen, measured, resumed, done = (mp_context.Event() for _ in range(5))
    args = (ready, frozen, measured, resumed, done)
    with WorkerGroup(_call_the_peer_that_freezes, 3, args=args, init=False) as group:
        assert ready.wait(60), "worker0 never reported its calls as started"
        group.send_signal(1, signal.SIGSTOP)
        frozen.set()
        try:
            measured.wait(60)  # worker0 saw its pending calls end (or gave up)
        finally:
            group.send_signal(1, signal.SIGCONT)
            resumed.set()
        seen = group.wait(timeout=90)[0]
    assert seen["survivor"]["value"] == "worker2"
    for outcome in seen["pending"]:
        assert outcome["type"] == "PeerUnavailableError", outcome
        assert "worker1" in outcome["message"]
        # peer_timeout (8 s) after the freeze, measured 7.6-8.0 s; the calls
        # would otherwise wait for the 60 s default timeout.
        assert outcome["after"] < 30.0, outcome
    assert seen["survivor after"]["value"] == "worker2"
    assert seen["after resume"]["value"] == "worker1"


# -- A caller frozen while its large reply is sent --------------------------------

_big_reply_events = []  # worker1's (started, release)


def _big_bytes():
    """32 MiB: far more than a frozen gRPC caller takes before the callee's
    send waits in flow control (~4 MiB), until the caller reads or its stream ends."""
    return bytes(range(256)) * (32 << 12)


def _big_reply():
    started, release = _big_reply_events
    started.set()
    assert release.wait(60)  # set once the caller is frozen
    return _big_bytes()


def _reply_bytes_unsent():
    """Reply bytes this worker's gRPC streams hold, not taken by gRPC yet."""
    return sum(outbox.backlog for outbox in rrpc.agent.current_agent().server._outboxes)


def _freeze_during_a_large_reply(rank, world_size, events, stream_ends):
    """Worker2 calls worker1 for 32 MiB and is frozen (by the test) before
    the reply goes; worker0 meanwhile calls worker1, which has one worker
    thread, and with ``stream_ends`` (a short peer_timeout) waits for worker1
    to end the frozen caller's stream. Each reports what it saw."""
    started, release, frozen, measured, resumed = events
    _big_reply_events.extend((started, release))
    options = rrpc.RpcBackendOptions(num_worker_threads=1)
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {}
    if rank == 2:
        pending = rrpc.rpc_async("worker1", _big_reply, timeout=0)
        # Only this worker waits on `resumed`, set after SIGCONT: a process
        # stopped inside an Event's lock would block its other waiters.
        assert resumed.wait(120)
        seen["reply"] = _outcome(lambda: pending.wait() == _big_bytes())
        seen["again"] = _outcome(rrpc.rpc_sync, "worker1", _whoami, timeout=30)
    elif rank == 0:
        assert frozen.wait(60)
        frozen_at = time.monotonic()
        try:
            # worker1 runs it only once the big reply's send gave its permit back.
            seen["whoami"] = _outcome(rrpc.rpc_sync, "worker1", _whoami, timeout=15)
            if "value" in seen["whoami"]:
                unsent = lambda: rrpc.rpc_sync("worker1", _reply_bytes_unsent)  # noqa: E731
                seen["unsent"] = unsent()
                if stream_ends:
                    _wait_for(lambda: unsent() == 0, 30, "worker1 ending the frozen stream")
                    seen["ended after"] = time.monotonic() - frozen_at
        finally:
            measured.set()
    rrpc.shutdown()
    return seen


def _run_frozen_during_a_large_reply(peer_timeout):
    """The test's side of ``_freeze_during_a_large_reply``: what each rank saw."""
    events = tuple(mp_context.Event() for _ in range(5))
    started, release, frozen, measured, resumed = events
    env = {"RRPC_LANE": "0", "RRPC_PEER_TIMEOUT": str(peer_timeout)}  # over gRPC
    args = (events, peer_timeout < 10)
    with WorkerGroup(_freeze_during_a_large_reply, 3, args=args, init=False, env=env) as group:
        assert started.wait(60), "worker1 never ran the large call"
        group.send_signal(2, signal.SIGSTOP)
        release.set()
        frozen.set()
        try:
            measured.wait(90)  # worker0 has seen what it looks for (or failed)
        finally:
            group.send_signal(2, signal.SIGCONT)
            resumed.set()
        return group.wait(timeout=90)


@pytest.mark.timeout(180)
def test_a_caller_frozen_while_its_large_reply_is_sent_holds_no_worker_thread():
    # Before: the thread that ran the call sent the reply itself, holding
    # worker1's one worker permit while gRPC's flow control waited for the
    # frozen caller; worker0's call timed out (torch answers it in ~1 ms).
    # peer_timeout 60 s: the frozen caller's stream outlives the freeze.
    seen = _run_frozen_during_a_large_reply(60)
    survivor, frozen = seen[0], seen[2]
    assert survivor["whoami"].get("value") == "worker1", survivor["whoami"]
    assert survivor["whoami"]["elapsed"] < 10.0, survivor["whoami"]
    assert survivor["unsent"] > 4 << 20, survivor  # the reply was held up meanwhile
    assert frozen["reply"].get("value") is True, frozen["reply"]  # all of it, once resumed
    assert frozen["again"].get("value") == "worker1", frozen["again"]


@pytest.mark.timeout(180)
def test_a_callee_ends_the_stream_of_a_caller_frozen_past_peer_timeout():
    # Before: with gRPC's keepalive defaults on the server's side, the stream,
    # with the reply held up in it, ended 20.4 s after the freeze, whatever
    # peer_timeout said.
    seen = _run_frozen_during_a_large_reply(2)
    survivor, frozen = seen[0], seen[2]
    assert survivor["whoami"].get("value") == "worker1", survivor["whoami"]
    # peer_timeout (2 s) after the freeze (1.4 s measured).
    assert survivor["ended after"] < 10.0, survivor
    # Resumed, the caller learns at once that its call failed, and calls again.
    assert frozen["reply"].get("type") == "PeerUnavailableError", frozen["reply"]
    assert "worker1" in frozen["reply"]["message"], frozen["reply"]
    assert frozen["reply"]["elapsed"] < 30.0, frozen["reply"]
    assert frozen["again"].get("value") == "worker1", frozen["again"]


# -- Shutdown around a frozen peer ------------------------------------------------


def _shutdown_beside_a_frozen_peer(rank, world_size, ready, frozen, done, release, limit):
    rrpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 1:  # frozen by the test, then let go; it leaves without a barrier
        ready.set()
        # Only this worker waits on `release`: a process stopped while it holds
        # an Event's internal lock would block every other waiter of that Event.
        assert release.wait(120)
        rrpc.shutdown(graceful=False)
        return None
    assert frozen.wait(60)
    start = time.monotonic()
    outcome = _outcome(rrpc.shutdown, timeout=limit)
    outcome["took"] = time.monotonic() - start
    done.set()
    return outcome


@pytest.mark.timeout(120)
def test_shutdown_with_a_timeout_returns_or_raises_within_it_beside_a_frozen_peer():
    # Measured before: shutdown(timeout=4) took 14 s (the barrier's 4 s, then
    # 10 s waiting for ranks to leave the store).
    ready, frozen, done, release = (mp_context.Event() for _ in range(4))
    limit = 4.0
    args = (ready, frozen, done, release, limit)
    with WorkerGroup(_shutdown_beside_a_frozen_peer, 3, args=args, init=False) as group:
        assert ready.wait(60)
        group.send_signal(1, signal.SIGSTOP)
        frozen.set()
        try:
            done.wait(60)
        finally:
            group.send_signal(1, signal.SIGCONT)
            release.set()
        results = group.wait(timeout=60)
    for rank in (0, 2):
        assert results[rank]["took"] < limit + 2.0, results[rank]
        if "type" in results[rank]:  # it may also pass, with worker1 confirmed gone
            assert results[rank]["type"] == "RpcError", results[rank]
            assert "[1]" in results[rank]["message"], results[rank]
