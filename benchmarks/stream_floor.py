"""The floor under a byte stream: a bare socket echo, measured in the benchmark's own run.

No framework, no framing beyond a size agreed once, no pickling, no tensors, no
thread hand-off: the calling thread writes its message and reads the echo into a
buffer allocated once (`recv_into`); the server reads on one thread and echoes
from that same thread. That is the cheapest round trip a stream socket allows
from Python, so it is the floor under any RPC framework carried by that stream.

`bench.py` runs it as two floors, in the same interleaved repeats as the
frameworks:

- "uds": over a Unix socket on this host, beside `noop_sync` and `echo_4k`: the
  floor under rrpc's same-host lane (`rrpc/lane.py`), where the calling thread
  also does its own I/O on a Unix socket.
- "tcp": over TCP between the two network namespaces of the `veth_*` rows
  (`netns.py`), for 16 MiB and 128 MiB: the floor under any transport of bytes
  between two hosts, at the link's and the kernel's speed.

An address is a `str` for a Unix socket (a leading NUL: Linux's abstract
namespace, so nothing is left on disk) or a `(host, port)` tuple for TCP.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

_SIZE = struct.Struct("!Q")  # the message size, sent once when the client connects


def _socket(address: str | tuple[str, int]) -> socket.socket:
    if isinstance(address, str):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As every RPC transport does: a small message leaves at once.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from `sock`; False if the peer closed the stream first."""
    got = 0
    while got < len(view):
        read = sock.recv_into(view[got:])
        if read == 0:
            return False
        got += read
    return True


def _echo(conn: socket.socket) -> None:
    with conn:
        header = bytearray(_SIZE.size)
        if not _read_exactly(conn, memoryview(header)):
            return
        (nbytes,) = _SIZE.unpack(header)
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        while _read_exactly(conn, view):
            conn.sendall(view)


def serve(address: str | tuple[str, int], ready: Any, stop: Any) -> None:
    """Echo on `address` until `stop` is set; set `ready` once listening.

    Each connection gets its own thread, which reads a message and echoes it.
    """
    listener = _socket(address)
    if not isinstance(address, str):
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen()

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    ready.set()
    stop.wait()
    listener.close()


def round_trips(address: str | tuple[str, int], n: int, nbytes: int, warmup: int) -> list[float]:
    """Seconds taken by each of `n` sequential echoes of `nbytes`, after `warmup` untimed."""
    message = b"x" * nbytes
    reply = memoryview(bytearray(nbytes))
    with _socket(address) as sock:
        sock.connect(address)
        sock.sendall(_SIZE.pack(nbytes))

        def call() -> None:
            sock.sendall(message)
            if not _read_exactly(sock, reply):
                raise RuntimeError(f"the echo server closed the stream ({nbytes} bytes sent)")

        for _ in range(warmup):
            call()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        if reply[-1:] != message[-1:]:
            raise RuntimeError(f"echo of {nbytes} bytes came back different")
        return times
