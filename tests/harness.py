"""Run one function on N real worker processes: the harness every multi-process test uses.

Rules
- Multi-process tests start processes only through this module.
- Children are forked from a *fork server* (a fresh interpreter that has
  imported torch and nothing else, one thread), never from the test process:
  torch and gRPC keep threads and locks there that a forked child would
  inherit in an unknown state.
- Every child started here is ended here, whatever happens to the test: success,
  failure, timeout, Ctrl-C. A child whose parent dies (pytest-timeout ends the
  whole run with os._exit) notices and exits by itself.
- Nothing waits by sleeping. The parent blocks on the children's report pipes
  and process sentinels together (multiprocessing.connection.wait), so a report,
  a crash and the deadline each wake it at once.

Theory of operation
The parent picks a free port for the rendezvous store (rank 0 hosts it) and
starts one process per rank, each with the write end of its own report pipe.
A child sets its environment (the caller's `env`, then MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), arms a watchdog on its parent, and asks faulthandler to dump
every thread's stack into a per-rank file on SIGTERM or a crash. Then it runs
    rrpc.init_rpc -> fn(rank, world_size, *args, **kwargs) -> rrpc.shutdown
(init_rpc and shutdown only when `init` is true) and sends exactly one report:
("ok", return value) or ("error", traceback). A child that fails exits right
after reporting, without shutting rrpc down: the parent stops the others.

The parent collects reports until every rank has reported or died, or the
deadline passes. Once one rank has failed, the others get ERROR_GRACE seconds
more (they are usually stuck waiting for the failed one). A rank that reported
success must then exit by itself, with code 0, within EXIT_GRACE seconds: a
worker that hangs or crashes at exit is a bug a user would meet too. On any
failure every child still running is stopped (SIGTERM, which dumps its stacks,
then SIGKILL after TERMINATE_GRACE) and one AssertionError describes every
failing rank: its traceback, exit code, or where its threads were when stopped.

Pickling
- `fn` and `backend_options` travel as cloudpickle bytes and are loaded only
  after the environment is set, so `env` is in force before the child imports
  the test module or rrpc. A module-level fn is pickled by reference; a closure
  or lambda also works.
- `args` and `kwargs` are pickled by multiprocessing when the child starts, so
  they may hold multiprocessing objects (an Event or Queue from `mp_context`)
  for a test to coordinate with a worker. They are loaded before `env` applies.
- Reports are pickled by the child into bytes with plain pickle. multiprocessing's
  own pickler would put tensors in shared memory (torch registers reducers for
  it), and such a tensor cannot be rebuilt once the child has exited.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle

# A fork server that has imported torch once forks every child: a worker
# starts in tens of milliseconds instead of the seconds a fresh interpreter
# takes to import torch (the suite runs a few hundred worlds). The server is
# a fresh interpreter itself (spawned), with no thread, lock or gRPC state to
# inherit; rrpc and the test module are imported in each child, after its
# environment is set.
mp_context = multiprocessing.get_context("forkserver")
mp_context.set_forkserver_preload(["torch"])

TERMINATE_GRACE = 3.0  # seconds between SIGTERM and SIGKILL
STOP_WAIT = 10.0  # seconds a SIGSTOP may take to stop every thread of a worker
ERROR_GRACE = 5.0  # once a rank has failed, how much longer the others may take to report
EXIT_GRACE = 10.0  # how long a rank that reported success may take to exit
# Characters of a stopped rank's stack dump kept in the error: every thread's,
# since a crash's own thread may be anywhere in faulthandler's list.
STACK_DUMP_LIMIT = 100_000

_ORPHAN_EXIT_CODE = 70  # exit code of a child whose parent died

# Every child started and not yet stopped, for kill_leftovers().
_live_processes: set[BaseProcess] = set()


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    names: Sequence[str] | None = None,
    backend_options: Any = None,
    init: bool = True,
    may_die: Collection[int] = (),
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` rrpc workers.

    Each rank is a fresh process; with `init` it joins rrpc as `names[rank]`
    (default f"worker{rank}") before fn and shuts rrpc down after it. `env`
    entries are set in every child (a value of None unsets the variable).
    `timeout` bounds the whole run, start-up included. Ranks in `may_die` may
    exit without reporting (a test that crashes one on purpose).

    Returns fn's return values ordered by rank (None for a rank in `may_die`
    that died). Raises AssertionError describing every failing rank if any
    raises, dies, or does not finish within `timeout`. Every child is ended
    before this returns or raises.

        def _add(rank, world_size):
            return rrpc.rpc_sync(f"worker{(rank + 1) % world_size}", torch.add, (rank, 1))

        def test_add_on_the_next_worker():
            assert run_workers(_add, world_size=3) == [1, 2, 3]
    """
    with WorkerGroup(fn, world_size, args, kwargs, env, names, backend_options, init) as group:
        return group.wait(timeout, may_die)


def _wait_until_stopped(pid: int, timeout: float) -> None:
    """Wait until every thread of ``pid`` is stopped (or gone), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rpartition(") ")[2][:1])
        except OSError:
            return  # it is gone
        if all(state in "Tt" for state in states):
            return
        time.sleep(0.001)  # polling /proc: no event tells a stop to a non-parent
    raise TimeoutError(f"process {pid} did not stop within {timeout} s of SIGSTOP")


class WorkerGroup:
    """Worker processes running one function; a context manager that ends them all.

    For tests that act on a worker while it runs, e.g. kill one rank mid-call:

        ready = mp_context.Event()
        with WorkerGroup(_serve, world_size=3, args=(ready,)) as group:
            assert ready.wait(30)
            group.kill(2)
            results = group.wait(timeout=30)  # None for rank 2

    `processes[rank]` is each rank's multiprocessing process; `master_port` is
    the rendezvous port. Arguments are those of run_workers.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int = 2,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str | None] | None = None,
        names: Sequence[str] | None = None,
        backend_options: Any = None,
        init: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if names is not None and len(names) != world_size:
            raise ValueError(f"got {len(names)} names for world_size {world_size}: {names}")
        self.world_size = world_size
        self.names = list(names) if names is not None else [f"worker{r}" for r in range(world_size)]
        self.master_port = free_port()
        self.processes: list[BaseProcess] = []
        self._fn_name = getattr(fn, "__qualname__", repr(fn))
        self._fn_bytes = cloudpickle.dumps(fn)
        self._options_bytes = cloudpickle.dumps(backend_options)
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._env = dict(env or {})
        self._init = init
        self._reports: list[Connection] = []
        self._killed: set[int] = set()
        self._stack_dir = ""

    def __enter__(self) -> WorkerGroup:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Start one process per rank. The context manager calls this."""
        self._stack_dir = tempfile.mkdtemp(prefix="rrpc-harness-")
        for rank in range(self.world_size):
            reader, writer = mp_context.Pipe(duplex=False)
            process = mp_context.Process(
                target=_child_main,
                name=f"rrpc-test-{self.names[rank]}",
                args=(
                    rank,
                    self.world_size,
                    self.names[rank],
                    self.master_port,
                    self._env,
                    self._init,
                    self._fn_bytes,
                    self._options_bytes,
                    self._args,
                    self._kwargs,
                    writer,
                    self._stack_file(rank),
                ),
            )
            self._reports.append(reader)
            process.start()
            _live_processes.add(process)
            self.processes.append(process)
            # Only the child may hold the write end, so that the child's death
            # reads as end-of-file here.
            writer.close()

    def send_signal(self, rank: int, sig: int) -> None:
        """Send `sig` to `rank` and return (SIGSTOP / SIGCONT: it stays a member).

        SIGSTOP returns once every thread of the process has stopped: a stop
        is not instant, and a thread still running on the other core (a
        loaded host) would answer a request sent meanwhile. The workers are
        the forkserver's children, not ours (no waitid): /proc says."""
        process = self.processes[rank]
        if process.pid is not None and process.exitcode is None:
            os.kill(process.pid, sig)
            if sig == signal.SIGSTOP:
                _wait_until_stopped(process.pid, STOP_WAIT)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to `rank` and wait for it to die; wait() then expects it dead."""
        process = self.processes[rank]
        self._killed.add(rank)
        if process.pid is not None and process.exitcode is None:
            os.kill(process.pid, sig)
        process.join(TERMINATE_GRACE)
        if process.is_alive():
            raise AssertionError(
                f"rank {rank} ({self.names[rank]}) still alive {TERMINATE_GRACE} s after "
                f"{signal.Signals(sig).name}"
            )

    def wait(self, timeout: float = 60.0, may_die: Collection[int] = ()) -> list[Any]:
        """Collect every rank's return value; see run_workers for the rules."""
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        succeeded: list[int] = []
        pending = {rank for rank in range(self.world_size) if rank not in self._killed}
        first_failure_at: float | None = None

        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            rank_of: dict[Any, int] = {}
            for rank in pending:
                rank_of[self._reports[rank]] = rank
                rank_of[self.processes[rank].sentinel] = rank
            for rank in {rank_of[handle] for handle in wait_for_any(list(rank_of), remaining)}:
                pending.discard(rank)
                status, value = self._read_report(rank)
                if status == "ok":
                    results[rank] = value
                    succeeded.append(rank)
                elif not (status == "died" and rank in may_die):
                    failures[rank] = value
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
                deadline = min(deadline, first_failure_at + ERROR_GRACE)

        failed = ", ".join(str(rank) for rank in sorted(failures))
        for rank in sorted(pending):
            if first_failure_at is None:
                failures[rank] = f"did not finish within {timeout} s"
            else:
                failures[rank] = f"did not finish within {ERROR_GRACE} s after rank {failed} failed"
        if not failures:
            failures = self._check_exits(succeeded)
        if failures:
            _stop(self.processes)
            raise AssertionError(self._describe(failures))
        return results

    def close(self) -> None:
        """Stop every child still running and release the group's resources."""
        try:
            _stop(self.processes)
        finally:
            for reader in self._reports:
                reader.close()
            if self._stack_dir:
                shutil.rmtree(self._stack_dir, ignore_errors=True)

    def _read_report(self, rank: int) -> tuple[str, Any]:
        """Read rank's report; only called once its pipe or sentinel is ready."""
        process = self.processes[rank]
        try:
            status, value = cloudpickle.loads(self._reports[rank].recv_bytes())
            return status, value
        except EOFError:
            # The pipe closed without a report: the process is gone or going.
            process.join(TERMINATE_GRACE)
            return "died", f"exited without reporting, {_describe_exit(process.exitcode)}"
        except Exception:
            return "error", f"sent a report that could not be read:\n{traceback.format_exc()}"

    def _check_exits(self, ranks: list[int]) -> dict[int, str]:
        """Ranks that reported success must exit cleanly on their own."""
        deadline = time.monotonic() + EXIT_GRACE
        failures = {}
        for rank in ranks:
            process = self.processes[rank]
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                failures[rank] = (
                    f"reported success but had not exited {EXIT_GRACE} s later "
                    "(a non-daemon thread left running?)"
                )
            elif process.exitcode != 0:
                failures[rank] = (
                    f"reported success, then {_describe_exit(process.exitcode)} on the way out"
                )
        return failures

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.stacks")

    def _describe(self, failures: dict[int, str]) -> str:
        lines = [
            f"{len(failures)} of {self.world_size} workers failed running {self._fn_name} "
            f"(MASTER_PORT={self.master_port}):"
        ]
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ({self.names[rank]}): {failures[rank]}")
            stacks = _read_tail(self._stack_file(rank), STACK_DUMP_LIMIT)
            if stacks:
                lines.append(f"stacks of rank {rank} when it was stopped or crashed:\n{stacks}")
        return "\n".join(lines)


def kill_leftovers() -> int:
    """Stop every child this module started and has not stopped yet; return how many."""
    leftovers = list(_live_processes)
    _stop(leftovers)
    return len(leftovers)


atexit.register(kill_leftovers)


def _stop(processes: Sequence[BaseProcess]) -> None:
    """SIGTERM every live one, SIGKILL those still alive after the grace, reap all."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join(TERMINATE_GRACE)
    for process in processes:
        if not process.is_alive():
            _live_processes.discard(process)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _read_tail(path: str, limit: int) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if len(text) <= limit else "...\n" + text[-limit:]


# --- the child's side ---------------------------------------------------------

_stack_out = None  # the child's faulthandler file, kept open for its lifetime


def _child_main(
    rank: int,
    world_size: int,
    name: str,
    master_port: int,
    env: dict[str, str | None],
    init: bool,
    fn_bytes: bytes,
    options_bytes: bytes,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    report: Connection,
    stack_file: str,
) -> None:
    global _stack_out
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    _exit_when_parent_dies()
    _stack_out = open(stack_file, "w")  # kept open: faulthandler writes to it until exit
    faulthandler.enable(_stack_out, all_threads=True)
    # chain=True: after the dump, SIGTERM's default action still ends the process.
    faulthandler.register(signal.SIGTERM, _stack_out, all_threads=True, chain=True)

    phase = "loading fn"
    try:
        fn = cloudpickle.loads(fn_bytes)
        backend_options = cloudpickle.loads(options_bytes)
        if init:
            phase = "rrpc.init_rpc"
            import rrpc

            rrpc.init_rpc(
                name=name, rank=rank, world_size=world_size, rpc_backend_options=backend_options
            )
        phase = getattr(fn, "__qualname__", "fn")
        value = fn(rank, world_size, *args, **kwargs)
        if init:
            phase = "rrpc.shutdown"
            rrpc.shutdown()
        phase = "pickling the return value"
        data = cloudpickle.dumps(("ok", value))
    except BaseException:
        message = f"raised in {phase}:\n{traceback.format_exc()}"
        report.send_bytes(cloudpickle.dumps(("error", message)))
        # The failure is reported; leave at once rather than risk hanging in a
        # half-initialised rrpc. The parent stops the other ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    report.send_bytes(data)
    report.close()


def _exit_when_parent_dies() -> None:
    # multiprocessing hands a spawned child the read end of a pipe whose write
    # end only the parent holds: it reads end-of-file when the parent is gone.
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        wait_for_any([sentinel])
        os._exit(_ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def run_script(script: Any, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python script *args`` as a user would; see ``run_command``."""
    return run_command([sys.executable, str(script), *args], timeout=timeout)


def run_command(
    command: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Any = None,
) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group, and kill it and every process
    it started if it runs over ``timeout`` seconds or the test is interrupted.
    Output is stdout and stderr together; a run over time fails the test with
    its last lines. Keep ``timeout`` under the test's pytest timeout, or that
    one ends the test first and nothing is killed."""
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process out of our reach holds the pipe
            output = "(its output was not read: a process it started still holds the pipe)"
        ran = " ".join(command)
        raise AssertionError(f"{ran} ran over {timeout} s:\n{output[-3000:]}") from None
    finally:
        if process.poll() is None:
            kill_tree(process)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process``, its process group and every process descended from
    it: torchrun starts each worker in a session of its own, out of the
    group's reach, and a live worker holds the output pipes open."""
    doomed = _descendants(process.pid)
    for kill, pid in [(os.killpg, process.pid)] + [(os.kill, pid) for pid in doomed]:
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()


def _descendants(pid: int) -> list[int]:
    """The pids of every live process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def outcome(call, *args, **kwargs):
    """What a call did, as plain data a worker can report: its value or its
    error (type, message, remote traceback, notes), and how long it took."""
    start = time.monotonic()
    try:
        value = call(*args, **kwargs)
        return {"value": value, "elapsed": time.monotonic() - start, "finished at": time.time()}
    except BaseException as exc:
        return {
            "type": type(exc).__name__,
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "remote_traceback": getattr(exc, "remote_traceback", None),
            "notes": list(getattr(exc, "__notes__", [])),
            "attributes": {
                key: getattr(exc, key)
                for key in ("type_name", "remote_message")
                if hasattr(exc, key)
            },
            "elapsed": time.monotonic() - start,
            "finished at": time.time(),
        }


# -- A world kept up across tests -----------------------------------------------
def _serve_scenarios(rank, world_size, commands, results, finished):
    """Rank 0 runs each (fn, args) it is sent and sends back what it returned;
    the other ranks serve RPCs until rank 0 is done. (`finished` is a semaphore:
    setting an Event a dead process waited on can hang.)"""
    if rank != 0:
        finished.acquire()
        return None
    while (message := cloudpickle.loads(commands.recv_bytes())) is not None:
        fn, args = message
        try:
            outcome = ("ok", fn(*args))
        except BaseException:
            outcome = ("error", traceback.format_exc())
        results.send_bytes(cloudpickle.dumps(outcome))
    for _ in range(world_size - 1):
        finished.release()
    return None


class Cluster:
    """``world_size`` rrpc workers kept up across tests; ``run(fn, *args)`` runs
    ``fn`` on worker0 and returns its result (or fails the test with worker0's
    traceback). Starting workers costs seconds; most scenarios take milliseconds.

    Its processes are left out of the per-test cleanup (they outlive tests) and
    are ended by ``close()``, or by their own parent-death watchdog if pytest
    dies. A worker that dies or hangs marks the cluster broken for later tests.
    """

    def __init__(self, world_size: int = 3, backend_options: Any = None, env: Any = None):
        self._results, results_writer = mp_context.Pipe(duplex=False)
        commands_reader, self._commands = mp_context.Pipe(duplex=False)
        self.group = WorkerGroup(
            _serve_scenarios,
            world_size,
            args=(commands_reader, results_writer, mp_context.Semaphore(0)),
            env=env,
            backend_options=backend_options,
        )
        self.group.start()
        _live_processes.difference_update(self.group.processes)
        results_writer.close()
        commands_reader.close()
        self.broken = ""

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        if self.broken:
            raise AssertionError(f"the cluster broke in an earlier test:\n{self.broken}")
        self._commands.send_bytes(cloudpickle.dumps((fn, args)))
        sentinels = [process.sentinel for process in self.group.processes]
        if self._results not in wait_for_any([self._results, *sentinels], timeout):
            try:
                self.group.wait(timeout=0.1)  # describes every rank and stops them
                self.broken = f"a worker died during {fn.__name__}"
            except AssertionError as failure:
                self.broken = f"{fn.__name__} did not finish within {timeout} s:\n{failure}"
            raise AssertionError(self.broken)
        status, value = cloudpickle.loads(self._results.recv_bytes())
        if status != "ok":
            raise AssertionError(f"{fn.__name__} failed on worker0:\n{value}")
        return value

    def close(self) -> None:
        try:
            if not self.broken:
                self._commands.send_bytes(cloudpickle.dumps(None))
                self.group.wait(timeout=30)
        finally:
            self.group.close()


def pushed(outbox: Any) -> tuple[list[bytes], list]:
    """From now on ``outbox`` (an ``outbox.Outbox``) sends into lists: the
    packets it sends, and its end (``finish``'s argument: None when clean)."""
    packets: list[bytes] = []
    ends: list = []
    outbox.push(packets.append, ends.append)
    return packets, ends


ECHO_METHOD = "/test.Echo/Exchange"  # conftest's ``echo_channel`` serves it


def read_stream(call: Any) -> tuple[queue.SimpleQueue, threading.Thread]:
    """Read a ``grpc_call.Call``'s packets on a thread of their own, into a
    queue: each packet, then "ended" or the ``StreamEnded`` it raised."""
    from rrpc import grpc_call

    packets: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            for packet in call.packets():
                packets.put(packet)
            packets.put("ended")
        except grpc_call.StreamEnded as exc:
            packets.put(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return packets, thread
