"""What every example shares: a one-command launcher, metrics, a plot, a summary box.

An example puts this folder (``examples/``) on ``sys.path`` and imports it::

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from common import launch, progress, rpc_framework, summary, write_metrics

``launch(main, world_size, args)`` runs ``main(rank, world_size, args)`` once per
rank. Under ``torchrun`` (which sets RANK and WORLD_SIZE) it runs this process's
rank only; started with plain ``python``, it spawns the whole world on this
machine, so one command runs an example end to end.

``rpc_framework("rrpc" | "torch")`` returns ``(rpc, dist_autograd,
DistributedOptimizer)`` from either rrpc or ``torch.distributed``: the examples
are written once against that API and run on both, which is the point of rrpc.
An example that needs the framework at import time (a class decorated with
``rpc.functions.async_execution``) reads ``--framework`` with
``framework_from_argv()`` before argparse runs.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# Seconds the other ranks get to exit by themselves once one has failed, and
# after SIGTERM before SIGKILL.
_TERMINATE_GRACE = 3.0


# -- Choosing the framework ----------------------------------------------------


def rpc_framework(name: str) -> tuple[Any, Any, Any]:
    """``(rpc, dist_autograd, DistributedOptimizer)`` of rrpc or of torch.distributed."""
    if name == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer

        return rpc, dist_autograd, DistributedOptimizer
    if name == "rrpc":
        import rrpc
        import rrpc.optim

        return rrpc, rrpc.autograd, rrpc.optim.DistributedOptimizer
    raise ValueError(f"unknown RPC framework {name!r}: choose 'rrpc' or 'torch'")


def framework_from_argv(default: str = "rrpc") -> str:
    """The value of ``--framework`` on the command line, read before argparse runs.

    An example picks its framework at import time (its classes use
    ``rpc.functions.async_execution``); spawned ranks see the same command line.
    """
    argv = sys.argv[1:]
    for index, arg in enumerate(argv):
        if arg == "--framework" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--framework="):
            return arg.split("=", 1)[1]
    return default


# -- Launching the workers -----------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(main: Callable[[int, int, Any], None], world_size: int, args: Any) -> None:
    """Run ``main(rank, world_size, args)`` on every rank.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank: call
    ``main`` here. Otherwise spawn ``world_size`` local processes with
    MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK and WORLD_SIZE set, and wait
    for all of them. If one fails, the others are stopped and this process exits
    non-zero with the failing rank's traceback; Ctrl-C stops them all.

    ``main`` must be a module-level function and ``args`` picklable (the
    processes are started with the spawn method, which imports the script anew
    under the ``if __name__ == "__main__":`` guard).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return

    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes, reports = [], []
    for rank in range(world_size):
        receive, send = context.Pipe(duplex=False)
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        process = context.Process(
            target=_run_rank,
            args=(main, rank, world_size, args, env, send, os.getpid()),
            name=f"rank{rank}",
        )
        process.start()
        send.close()
        processes.append(process)
        reports.append(receive)

    try:
        failure = _wait_for_ranks(processes, reports)
    except KeyboardInterrupt:
        _stop(processes)
        print("\ninterrupted: stopped every rank", file=sys.stderr)
        sys.exit(130)
    if failure is not None:
        _stop(processes)
        print(failure, file=sys.stderr)
        sys.exit(1)


def _run_rank(
    main: Callable[[int, int, Any], None],
    rank: int,
    world_size: int,
    args: Any,
    env: dict[str, str],
    report: multiprocessing.connection.Connection,
    parent_pid: int,
) -> None:
    os.environ.update(env)
    _exit_when_orphaned(parent_pid)
    # Ctrl-C reaches the whole terminal's process group; the launcher alone
    # handles it and stops the ranks, so they do not print a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        main(rank, world_size, args)
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            report.send(f"SystemExit({exit_.code!r})\n")
        raise
    except BaseException:
        report.send(traceback.format_exc())
        report.close()
        # Leave without shutting anything down: the launcher stops the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _exit_when_orphaned(parent_pid: int) -> None:
    """End this rank if the launcher dies (killed, or its terminal closed)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def _wait_for_ranks(processes: list, reports: list) -> str | None:
    """Block until every rank exits; a description of the first failure, or None."""
    running = {process.sentinel: (rank, process) for rank, process in enumerate(processes)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            rank, process = running.pop(sentinel)
            process.join()
            if process.exitcode == 0:
                continue
            try:
                trace = reports[rank].recv() if reports[rank].poll() else None
            except EOFError:  # the rank died before it could report
                trace = None
            if trace is None:
                code = process.exitcode
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                trace = f"(no traceback: the process ended with {how})\n"
            return f"\nrank {rank} failed:\n{trace}"
    return None


def _stop(processes: list) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after a grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join()


# -- Reporting -----------------------------------------------------------------


def progress(iterable: Iterable, desc: str, total: int | None = None) -> Iterable:
    """A tqdm bar over ``iterable`` on a terminal; elsewhere the iterable itself."""
    if not sys.stdout.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)


def write_metrics(path: str, metrics: dict) -> str:
    """Write ``metrics`` as JSON to ``path`` (creating its folder); return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(metrics, indent=2) + "\n")
    return str(target)


def plot(
    path: str, series: dict[str, list[float]], xlabel: str, ylabel: str, title: str
) -> str | None:
    """One line per series (x = 1, 2, ...) in a PNG at ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for label, values in series.items():
        axes.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return str(target)


def summary(title: str, rows: dict[str, object]) -> str:
    """A box with ``title`` and one ``key  value`` line per row, ready to print."""
    key_width = max((len(key) for key in rows), default=0)
    lines = [f"{key.ljust(key_width)}  {_format(value)}" for key, value in rows.items()]
    width = max([len(title) + 2, *(len(line) for line in lines)])
    horizontal, vertical, corners = _box_characters()
    top = corners[0] + horizontal + f" {title} ".ljust(width + 1, horizontal) + corners[1]
    body = [f"{vertical} {line.ljust(width)} {vertical}" for line in lines]
    bottom = corners[2] + horizontal * (width + 2) + corners[3]
    return "\n".join([top, *body, bottom])


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _box_characters() -> tuple[str, str, str]:
    """Box-drawing characters where stdout can print them, ASCII elsewhere."""
    try:
        "─│┌┐└┘".encode(sys.stdout.encoding or "ascii")
        return "─", "│", "┌┐└┘"
    except (UnicodeEncodeError, LookupError):
        return "-", "|", "++++"
