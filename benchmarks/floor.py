"""The grpcio floor: what a bare grpcio bidi stream allows, measured in the benchmark's own run.

No framework, no pickling, no tensors: a server whose one stream-stream method
echoes every message it reads, and a client shaped like the cheapest RPC
framework one could build on grpcio. The caller's thread puts a message on a
queue and blocks on a lock; grpcio's request-iterator thread takes it off the
queue and sends it; the server's handler thread echoes it; a reader thread on
the client takes the echo off the stream and releases the caller's lock. That is
three thread hand-offs per round trip, the fewest grpcio's Python API allows for
a call whose caller blocks (a blocking unary-unary call is slower here: each one
is a new HTTP/2 stream).

`bench.py` runs it beside `noop_sync` and `echo_4k` in the same interleaved
repeats, so "rrpc ÷ floor" says how much of a round trip is rrpc's own work
over gRPC, and "torch ÷ floor" where TensorPipe stands. `stream_floor.py` is
the floor under a bare socket (rrpc's same-host lane, the veth link).
An address is a `(host, port)` tuple, as in `stream_floor.py`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

METHOD = "/floor.Floor/Echo"
NOOP_BYTES = 64  # about the size of rrpc's frame for a call with no arguments
_END = object()


class _Echo(grpc.GenericRpcHandler):
    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method != METHOD:
            return None
        return grpc.stream_stream_rpc_method_handler(self._echo)

    @staticmethod
    def _echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests


def serve(address: tuple[str, int], ready: Any, stop: Any) -> None:
    """Echo on `address` until `stop` is set; set `ready` once listening."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_Echo(),))
    server.add_insecure_port("{}:{}".format(*address))
    server.start()
    ready.set()
    stop.wait()
    server.stop(grace=None)


class _Client:
    """One stream; `call(message)` sends it and blocks until its echo is back."""

    def __init__(self, address: tuple[str, int]):
        self._channel = grpc.insecure_channel("{}:{}".format(*address))
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: queue.SimpleQueue[list] = queue.SimpleQueue()  # replies come in order
        echo = self._channel.stream_stream(METHOD)
        self._replies = echo(iter(self._outgoing.get, _END))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for reply in self._replies:
            slot = self._waiting.get()
            slot.append(reply)
            slot[0].release()

    def call(self, message: bytes) -> bytes:
        arrived = threading.Lock()
        arrived.acquire()
        slot: list = [arrived]
        self._waiting.put(slot)
        self._outgoing.put(message)
        arrived.acquire()
        return slot[1]

    def close(self) -> None:
        self._outgoing.put(_END)
        self._reader.join(timeout=5)
        self._channel.close()


def round_trips(address: tuple[str, int], n: int, nbytes: int, warmup: int) -> list[float]:
    """Seconds taken by each of `n` sequential echoes of `nbytes`, after `warmup` untimed."""
    client = _Client(address)
    message = b"x" * nbytes
    try:
        for _ in range(warmup):
            client.call(message)
        times = []
        for _ in range(n):
            start = time.perf_counter()
            reply = client.call(message)
            times.append(time.perf_counter() - start)
            if len(reply) != nbytes:
                raise RuntimeError(f"echo of {nbytes} bytes came back as {len(reply)}")
        return times
    finally:
        client.close()
