"""The zygote: one process per framework that imports everything once and forks each test's world.

Started by the runner as ``python -m conformance.zygote FRAMEWORK CMD_FD RES_FD``.
It sets the environment, imports torch (and, for rrpc, rrpc and the shim), then
torch's test modules, and builds each test class the way
``rpc_utils.generate_tests`` does (suite + agent fixture + torch's
``MultiProcessTestCase``). It then answers commands, one JSON line each, read
from CMD_FD; answers go to RES_FD (stdout and stderr stay free for whatever
the imports print):

    {"op": "list"}  ->  {"tests": {"Class.test_name": "suite", ...}}
    {"op": "run", "test": "Class.test_name", "timeout": 60, "log_dir": "..."}
                    ->  {"outcome": ..., "ranks": [...], ...}

For a run it makes a fresh file for ``self.file_name`` (the fixtures' default
``init_method`` is ``file://`` that file, as in torch's own runs; gloo process
groups use it too), picks a free loopback port for the tests that use
``env://`` (MASTER_ADDR/MASTER_PORT), and forks
``world_size`` ranks. Each rank does what torch's ``MultiProcessTestCase._run``
does (construct the test case, set rank and file name, ``run_test``), then
exits the way an interpreter does (non-daemon threads joined, threading's and
atexit's exit hooks run), so a hang at exit is a timeout here as it would be
for a user. The zygote never runs a test itself and never opens a gRPC channel
or server, and it has no threads, so forking it is safe; gRPC's fork handlers
are off (``GRPC_ENABLE_FORK_SUPPORT=0``).

The verdict follows torch's ``MultiProcessTestCase._join_processes``: a rank
that raised (exit code 10) fails the test and the others are killed at once;
any rank still running at the deadline is a timeout (each rank dumps its
threads' stacks into its log shortly before); rank 0's exit code decides
between pass, skip and fail. Each world runs in its own process group, which is
killed with SIGKILL when the test ends, whatever happened; the zygote is a
child subreaper, so grandchildren a test started are reaped too, and every
rank dies with the zygote (PR_SET_PDEATHSIG), which dies with the runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from typing import Any

GENERATED_MODULE = "conformance._generated"  # where the built test classes live
TEST_ERROR_EXIT_CODE = 10  # MultiProcessTestCase.TEST_ERROR_EXIT_CODE
STACK_DUMP_MARGIN = 3.0  # seconds before the deadline at which a rank dumps its stacks
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    _libc.prctl(option, value, 0, 0, 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prepare_environment() -> None:
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
    os.environ.pop("RPC_INIT_WITH_TCP", None)  # torch's default: file:// init (self.file_name)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")


def _build_classes(framework: str) -> dict[str, tuple[type, str]]:
    """Class name -> (test class with the fixture mixed in, suite name)."""
    import importlib

    tolerant: Any = contextlib.nullcontext()
    if framework == "rrpc":
        from conformance import shim

        shim.install()
        tolerant = shim.tolerant_jit_script()
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    from conformance.fixtures import fixture_for
    from conformance.suites import SUITES

    classes: dict[str, tuple[type, str]] = {}
    with tolerant:
        modules = {
            module_name: importlib.import_module(module_name)
            for suite in SUITES.values()
            for module_name, _ in suite.classes
        }
    # As generate_tests, the built classes live in a module of their own, where
    # pickle finds them by name (a test may send its own instance's class).
    generated = types.ModuleType(GENERATED_MODULE)
    sys.modules[GENERATED_MODULE] = generated
    for suite in SUITES.values():
        fixture = fixture_for(framework, suite.faulty)
        for module_name, class_name in suite.classes:
            base = getattr(modules[module_name], class_name)
            cls = type(class_name, (base, fixture, MultiProcessTestCase), {})
            cls.__module__ = GENERATED_MODULE
            setattr(generated, class_name, cls)
            classes[class_name] = (cls, suite.name)
    if framework == "torch":
        _keep_backend_types()  # now that the faulty fixture is imported
    return classes


# torch's BackendType before and after the faulty suite's import registered
# FAULTY_TENSORPIPE (see _backend_types_for).
_backend_types: tuple[Any, Any] | None = None


def _keep_backend_types() -> None:
    global _backend_types
    import torch.distributed.rpc as rpc

    _backend_types = (rpc.BackendType, rpc.backend_registry.BackendType)


def _backend_types_for(suite: str) -> None:
    """Give torch's test the BackendType of a process of torch's own runs.

    torch runs each suite file in a process of its own; here every suite
    shares one. The faulty suite's import registers FAULTY_TENSORPIPE, which
    rebuilds ``backend_registry.BackendType`` (what ``init_rpc`` checks a
    backend against) but not ``torch.distributed.rpc.BackendType`` (what it
    infers one from): ``init_rpc`` without a backend then fails. So a faulty
    test sees both names at the enum with FAULTY_TENSORPIPE, as in torch's
    faulty test file, and every other test both at the one without it."""
    if _backend_types is None:
        return
    import torch.distributed.rpc as rpc

    from conformance.suites import SUITES

    enum = _backend_types[1] if SUITES[suite].faulty else _backend_types[0]
    rpc.BackendType = enum  # type: ignore[attr-defined]
    rpc.backend_registry.BackendType = enum


def _test_names(cls: type) -> list[str]:
    import unittest

    return list(unittest.TestLoader().getTestCaseNames(cls))


# -- A rank --------------------------------------------------------------------
def _exit_like_interpreter(code: int) -> None:
    """Join non-daemon threads, run threading's and atexit's hooks, flush, exit."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
        code = code or 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


# Process groups a test destroyed, kept until its locals are gone (see below).
_destroyed_groups: list[Any] = []


def _keep_destroyed_groups() -> None:
    """Work around a deadlock of torch's own, on either framework: keep each
    process group ``destroy_process_group`` destroys referenced from Python
    until the test has returned (``_run_rank`` drops them).

    A test that frees its DDP module after ``destroy_process_group`` (the
    DdpComparison tests) leaves the module's ``Reducer`` the last owner of the
    ``ProcessGroupGloo``; pybind frees a Reducer with the GIL held, so
    ``~ProcessGroupGloo`` joins gloo's work threads with it, while a work
    thread that just finished an ``all_reduce`` on a tensor made in Python
    needs the GIL to drop that tensor's Python object. Torch alone does it
    (``dist.Reducer`` on a one-rank gloo group: hangs within 300 iterations
    here, never with the groups kept). Dropped from this list, the Python
    ``ProcessGroup`` releases the GIL in its destructor."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    destroy = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        _destroyed_groups.extend(list(c10d._world.pg_map) if group is None else [group])
        destroy(group)

    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group


def _run_rank(
    cls: type,
    test_name: str,
    rank: int,
    file_name: str,
    conn: Any,
    log_path: str,
    missing_path: str,
    timeout: float,
) -> None:
    code = 0
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ["CONFORMANCE_MISSING_LOG"] = missing_path
        import faulthandler

        log = open(log_path, "a")  # noqa: SIM115 -- lives as long as the process
        faulthandler.enable(file=log, all_threads=True)
        faulthandler.dump_traceback_later(max(1.0, timeout - STACK_DUMP_MARGIN), file=log)
        _keep_destroyed_groups()
        case = cls(test_name)  # MultiProcessTestCase._run
        case.rank = rank
        case.file_name = file_name
        case.run_test(test_name, conn)
        _destroyed_groups.clear()  # the test's locals are gone: no Reducer frees them now
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        try:
            conn.send(traceback.format_exc())
        except Exception:
            pass
        code = TEST_ERROR_EXIT_CODE
    _exit_like_interpreter(code)


# -- A world -------------------------------------------------------------------
def _pidfd(pid: int) -> int:
    return os.pidfd_open(pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_orphans() -> None:
    """Reap grandchildren a killed world left to us (we are their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def run_test(
    classes: dict[str, tuple[type, str]], test_id: str, timeout: float, log_dir: str
) -> dict[str, Any]:
    import multiprocessing

    class_name, test_name = test_id.split(".", 1)
    cls, suite = classes[class_name]
    _backend_types_for(suite)  # set here, inherited by the world's ranks
    world_size = int(cls(test_name).world_size)
    os.makedirs(log_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(_free_port())
    handle, file_name = tempfile.mkstemp(prefix="conformance_")
    os.close(handle)
    log_paths = [os.path.join(log_dir, f"{test_id}.rank{rank}.log") for rank in range(world_size)]
    missing_path = os.path.join(log_dir, f"{test_id}.missing")
    if os.path.exists(missing_path):
        os.unlink(missing_path)
    conns = []
    pids: list[int] = []
    pgid = 0
    start = time.monotonic()
    deadline = start + timeout
    exit_codes: dict[int, int] = {}
    errors: dict[int, str] = {}
    timed_out = False
    try:
        for rank in range(world_size):
            parent_conn, child_conn = multiprocessing.Pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                parent_conn.close()
                try:
                    os.setpgid(0, pgid)
                except OSError:
                    pass
                _run_rank(
                    cls,
                    test_name,
                    rank,
                    file_name,
                    child_conn,
                    log_paths[rank],
                    missing_path,
                    timeout,
                )
                os._exit(99)  # not reached
            try:
                os.setpgid(pid, pgid or pid)
            except OSError:
                pass
            pgid = pgid or pid
            child_conn.close()
            conns.append(parent_conn)
            pids.append(pid)

        fds = {_pidfd(pid): rank for rank, pid in enumerate(pids)}
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        try:
            while len(exit_codes) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for fd, _ in poller.poll(left * 1000):
                    rank = fds[fd]
                    poller.unregister(fd)
                    _, status = os.waitpid(pids[rank], 0)
                    exit_codes[rank] = _exit_code(status)
                if any(code == TEST_ERROR_EXIT_CODE for code in exit_codes.values()):
                    break  # as torch: one rank raised, the others are stopped
        finally:
            for fd in fds:
                os.close(fd)
        for rank, conn in enumerate(conns):
            try:
                if conn.poll():
                    errors[rank] = str(conn.recv())
            except (EOFError, OSError):
                pass
    finally:
        if pgid:
            _kill_group(pgid)
        for rank, pid in enumerate(pids):
            if rank not in exit_codes:
                try:
                    _, status = os.waitpid(pid, 0)
                    exit_codes.setdefault(rank, _exit_code(status))
                except ChildProcessError:
                    pass
        _reap_orphans()
        for conn in conns:
            conn.close()
        for path in (file_name, f"{file_name}_pg"):
            if os.path.exists(path):
                os.unlink(path)
    duration = time.monotonic() - start
    missing: list[str] = []
    if os.path.exists(missing_path):
        with open(missing_path) as f:
            missing = sorted({line.strip() for line in f if line.strip()})
        os.unlink(missing_path)
    return _verdict(world_size, exit_codes, errors, timed_out, duration, missing, log_paths)


def _verdict(
    world_size: int,
    exit_codes: dict[int, int],
    errors: dict[int, str],
    timed_out: bool,
    duration: float,
    missing: list[str],
    log_paths: list[str],
) -> dict[str, Any]:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    # In exit order: the first rank to raise usually has the cause, the others
    # fail because it left.
    raised = [rank for rank, code in exit_codes.items() if code == TEST_ERROR_EXIT_CODE]
    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
    reason = ""
    if raised:
        outcome = "fail"
        rank = raised[0]
        reason = errors.get(rank, f"rank {rank} exited with code 10")
        if len(raised) > 1:
            reason = f"(rank {rank} raised first; ranks {raised} raised)\n{reason}"
    elif timed_out:
        outcome = "timeout"
        running = [rank for rank in range(world_size) if exit_codes.get(rank, 0) == -9]
        reason = f"ranks {running} still running at the deadline (stacks in their logs)"
    elif exit_codes.get(0) in skip_codes:
        outcome = "skipped"
        reason = skip_codes[exit_codes[0]]
    elif exit_codes.get(0) != 0:
        outcome = "fail"
        reason = f"rank 0 exited with code {exit_codes.get(0)}"
    else:
        outcome = "pass"
    return {
        "outcome": outcome,
        "reason": reason,
        "duration": round(duration, 2),
        "exit_codes": [exit_codes.get(rank) for rank in range(world_size)],
        "errors": {str(rank): text for rank, text in errors.items()},
        "missing_apis": missing,
        "logs": log_paths,
    }


# -- Main ----------------------------------------------------------------------
def main(argv: list[str]) -> None:
    framework, cmd_fd, res_fd = argv[0], int(argv[1]), int(argv[2])
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prepare_environment()
    commands = os.fdopen(cmd_fd, "r")
    results = os.fdopen(res_fd, "w")

    def answer(message: dict[str, Any]) -> None:
        results.write(json.dumps(message) + "\n")
        results.flush()

    try:
        classes = _build_classes(framework)
    except BaseException:
        answer({"op": "ready", "error": traceback.format_exc()})
        raise
    import threading

    answer({"op": "ready", "threads": threading.active_count()})
    for line in commands:
        command = json.loads(line)
        op = command["op"]
        if op == "list":
            tests = {
                f"{name}.{test}": suite
                for name, (cls, suite) in classes.items()
                for test in _test_names(cls)
            }
            answer({"op": "list", "tests": tests})
        elif op == "run":
            try:
                result = run_test(
                    classes, command["test"], float(command["timeout"]), command["log_dir"]
                )
            except Exception:
                result = {"outcome": "error", "reason": traceback.format_exc()}
            answer({"op": "run", "test": command["test"], **result})
        elif op == "exit":
            break


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
