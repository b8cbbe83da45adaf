"""The multi-process harness itself, without rrpc (init=False)."""

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import harness
from harness import WorkerGroup, free_port, mp_context, run_workers


def _identify(rank, world_size, tag, suffix=""):
    return (rank, world_size, tag + suffix, os.getpid())


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return rank


def _exit_3_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _block_forever(rank, world_size, ready=None):
    if ready is not None:
        ready.release()
    threading.Event().wait()


def _ignore_sigterm_and_block(rank, world_size, ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.release()
    threading.Event().wait()


def _read_env(rank, world_size, keys):
    return {key: os.environ.get(key) for key in keys}


def _arange_times_rank(rank, world_size):
    import torch

    return torch.arange(4) * rank


def _block_after_ready_on_rank_one(rank, world_size, ready):
    if rank == 1:
        ready.set()
        threading.Event().wait()
    return "done"


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_results_are_returned_ordered_by_rank():
    results = run_workers(_identify, world_size=3, args=("a",), kwargs={"suffix": "b"}, init=False)
    assert [r[:3] for r in results] == [(0, 3, "ab"), (1, 3, "ab"), (2, 3, "ab")]
    pids = {r[3] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids


def test_exception_in_one_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError) as failure:
        run_workers(_raise_on_rank_one, world_size=3, init=False)
    message = str(failure.value)
    assert "1 of 3 workers failed" in message
    assert "rank 1 (worker1): raised in _raise_on_rank_one" in message
    assert "ValueError: boom on rank 1" in message
    assert "in _raise_on_rank_one" in message  # the traceback's frame line
    assert "rank 0 (" not in message and "rank 2 (" not in message


def test_child_that_exits_without_reporting_is_reported_promptly_with_its_exit_code():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 .*exited without reporting, exit code 3"):
        run_workers(_exit_3_on_rank_one, world_size=2, timeout=60, init=False)
    assert time.monotonic() - started < 20


def test_hung_child_is_stopped_at_the_timeout_with_its_stacks_and_nothing_survives():
    ready = mp_context.Semaphore(0)
    with pytest.raises(AssertionError) as failure:
        with WorkerGroup(_block_forever, world_size=2, args=(ready,), init=False) as group:
            assert ready.acquire(timeout=30) and ready.acquire(timeout=30)
            started = time.monotonic()
            group.wait(timeout=0.5)
    assert time.monotonic() - started < 0.5 + harness.TERMINATE_GRACE
    message = str(failure.value)
    assert "rank 0 (worker0): did not finish within 0.5 s" in message
    assert "rank 1 (worker1): did not finish within 0.5 s" in message
    assert "in _block_forever" in message  # from the stacks faulthandler dumps on SIGTERM
    assert [p.is_alive() for p in group.processes] == [False, False]
    assert [p.exitcode for p in group.processes] == [-signal.SIGTERM] * 2
    assert not harness._live_processes


def test_child_that_ignores_sigterm_is_killed():
    ready = mp_context.Semaphore(0)
    with pytest.raises(AssertionError, match="did not finish"):
        with WorkerGroup(_ignore_sigterm_and_block, 1, args=(ready,), init=False) as group:
            assert ready.acquire(timeout=30)
            group.wait(timeout=0.5)
    assert group.processes[0].exitcode == -signal.SIGKILL


def test_env_vars_reach_the_child(monkeypatch):
    monkeypatch.setenv("RRPC_TEST_UNSET_ME", "parent")
    keys = [
        "RRPC_TEST_FLAG",
        "RRPC_TEST_UNSET_ME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
    ]
    env = {"RRPC_TEST_FLAG": "on", "RRPC_TEST_UNSET_ME": None}
    with WorkerGroup(_read_env, world_size=2, args=(keys,), env=env, init=False) as group:
        results = group.wait(timeout=60)
    for rank, seen in enumerate(results):
        assert seen == {
            "RRPC_TEST_FLAG": "on",
            "RRPC_TEST_UNSET_ME": None,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(group.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
        }


def test_tensor_results_survive_the_child_exiting():
    import torch

    results = run_workers(_arange_times_rank, world_size=2, init=False)
    assert torch.equal(results[0], torch.tensor([0, 0, 0, 0]))
    assert torch.equal(results[1], torch.tensor([0, 1, 2, 3]))


def test_killed_rank_is_expected_dead_and_returns_none():
    ready = mp_context.Event()
    with WorkerGroup(
        _block_after_ready_on_rank_one, world_size=2, args=(ready,), init=False
    ) as group:
        assert ready.wait(30)
        group.kill(1)
        assert group.wait(timeout=30) == ["done", None]
    assert group.processes[1].exitcode == -signal.SIGKILL


def test_rank_allowed_to_die_returns_none():
    assert run_workers(_exit_3_on_rank_one, world_size=2, may_die={1}, init=False) == [0, None]


def test_workers_exit_when_the_parent_dies():
    # A parent that starts a worker and then dies abruptly, as pytest does when
    # pytest-timeout ends a run: the worker must notice and exit by itself.
    tests_dir = Path(__file__).resolve().parent
    script = (
        "import os, harness, test_harness\n"
        "group = harness.WorkerGroup(test_harness._block_forever, world_size=1, init=False)\n"
        "group.start()\n"
        "print(group.processes[0].pid, flush=True)\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests_dir), str(tests_dir.parent)]))
    parent = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert parent.returncode == 0, parent.stderr
    worker_pid = int(parent.stdout.split()[0])
    try:
        pidfd = os.pidfd_open(worker_pid)
    except ProcessLookupError:
        return  # already gone
    try:
        readable, _, _ = select.select([pidfd], [], [], 30)  # readable once it has exited
        assert readable, f"worker {worker_pid} outlived its parent by 30 s"
    finally:
        os.close(pidfd)


_HANGING_SUITE = """
import time
import pytest

@pytest.mark.timeout(2)
def test_hangs():
    time.sleep(60)

def test_after_it():
    pass

def test_and_another():
    pass
"""


def test_a_test_that_ends_its_xdist_process_is_not_run_again(tmp_path):
    # Under --dist loadscope xdist hands the module, the timed-out test
    # included, to each new process; crash_marks skips it the second time, so
    # the module's other tests run and the suite ends (not after 8 more timeouts).
    (tmp_path / "test_hangs.py").write_text(_HANGING_SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout_method = thread\n")
    tests = str(Path(__file__).resolve().parent)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "crash_marks", "-n", "2"]
        + ["--dist", "loadscope", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": tests},
        capture_output=True,
        text=True,
        timeout=90,
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert "1 failed, 2 passed, 1 skipped" in summary, result.stdout[-3000:]
    assert "ended an earlier test process" in result.stdout
