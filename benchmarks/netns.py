"""Two network namespaces joined by a veth pair: two "hosts" on one machine.

`bench.py` uses this for its `veth_*` workloads. The parent process (root, with
iproute2's `ip`) creates the pair once per benchmark run:

    with VethPair.create() as pair:        # removed again on exit, error or Ctrl-C
        port = pair.a.free_port()
        ...                                # children call enter(pair.a.netns) first

and each spawned child calls `enter(netns)` before it opens any socket; every
socket it opens afterwards (gRPC, TensorPipe, Gloo, the TCPStore) lives in that
namespace, where the only way to the other "host" is the veth link.
Multiprocessing queues and pipes are not sockets of a network namespace and keep
working across them.

Namespaces are named after the creating process's pid, so two benchmark runs do
not collide, and leftovers of a run that was killed with SIGKILL (the only way to
skip the clean-up) are removed by the next run once their pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000  # <sched.h>; Python 3.11 has no os.setns
NETNS_DIR = "/var/run/netns"
PREFIX = "rrpcbench"  # namespaces are PREFIX-a-<pid> / PREFIX-b-<pid>
SUBNET = "10.213.0"  # a /24 nobody routes to; the pair is .1 and .2


@dataclass(frozen=True)
class Host:
    netns: str  # name under /var/run/netns
    ifname: str  # this host's end of the veth pair
    address: str  # its IPv4 address

    def free_port(self) -> int:
        """A TCP port free on `address` inside this namespace (bound, read, released)."""
        found: list[int | BaseException] = []

        def probe() -> None:
            # setns changes the namespace of the calling thread only, so a
            # throw-away thread can look inside without moving this process.
            try:
                enter(self.netns)
                with socket.socket() as s:
                    s.bind((self.address, 0))
                    found.append(s.getsockname()[1])
            except BaseException as e:
                found.append(e)

        thread = threading.Thread(target=probe, name=f"free-port-{self.netns}")
        thread.start()
        thread.join()
        if isinstance(found[0], BaseException):
            raise found[0]
        return found[0]


def enter(netns: str) -> None:
    """Move the calling thread (and threads it starts later) into network namespace `netns`.

    Call it first thing in a child process: a socket opened before stays in the
    namespace it was opened in."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_sockets() -> int:
    """How many sockets this process has open (to check nothing predates `enter`)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root and ip netns"
    if shutil.which("ip") is None:
        return "needs root and ip netns"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], check=check, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )


@dataclass
class VethPair:
    a: Host
    b: Host
    _removed: bool = False

    @classmethod
    def create(cls) -> VethPair:
        """Namespaces A and B, one veth end in each, addresses SUBNET.1 and .2, links up.

        Raises RuntimeError (with ip's message) if it cannot; nothing is left behind then.
        """
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        remove_stale()
        pid = os.getpid()
        # Interface names have at most 15 characters; pids at most 7 digits.
        pair = cls(
            Host(f"{PREFIX}-a-{pid}", f"rrpc{pid}a", f"{SUBNET}.1"),
            Host(f"{PREFIX}-b-{pid}", f"rrpc{pid}b", f"{SUBNET}.2"),
        )
        atexit.register(pair.remove)
        try:
            for host in (pair.a, pair.b):
                _ip("netns", "add", host.netns)
            _ip(
                "-n", pair.a.netns, "link", "add", pair.a.ifname, "type", "veth",
                "peer", "name", pair.b.ifname, "netns", pair.b.netns,
            )  # fmt: skip
            for host in (pair.a, pair.b):
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "link", "set", host.ifname, "up")
        except subprocess.CalledProcessError as e:
            pair.remove()
            raise RuntimeError(f"{' '.join(e.cmd)}: {e.stderr.strip()}") from e
        except BaseException:
            pair.remove()
            raise
        return pair

    def remove(self) -> None:
        """Delete both namespaces (which deletes the veth pair with them); idempotent."""
        if self._removed:
            return
        self._removed = True
        # SIGINT during clean-up would leave half of it; finish first.
        with _signals_deferred():
            _ip("-n", self.a.netns, "link", "del", self.a.ifname, check=False)
            for host in (self.a, self.b):
                _ip("netns", "del", host.netns, check=False)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.remove)

    def link_bytes(self) -> tuple[int, int]:
        """(rx, tx) byte counters of A's veth end: what crossed the link."""
        out = _ip("-n", self.a.netns, "-s", "link", "show", self.a.ifname).stdout.split("\n")
        rx = int(out[out.index(next(s for s in out if "RX:" in s)) + 1].split()[0])
        tx = int(out[out.index(next(s for s in out if "TX:" in s)) + 1].split()[0])
        return rx, tx

    def __enter__(self) -> VethPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def remove_stale() -> None:
    """Delete namespaces of earlier runs whose process is gone (killed with SIGKILL)."""
    if not os.path.isdir(NETNS_DIR):
        return
    for name in os.listdir(NETNS_DIR):
        m = re.fullmatch(rf"{PREFIX}-[ab]-(\d+)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Within: SIGTERM raises SystemExit, so `finally` blocks and atexit handlers run."""

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)
