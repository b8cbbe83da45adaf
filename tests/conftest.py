"""Shared test set-up: `import rrpc` and `import harness` work, and no worker outlives its test."""

import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

# `make venv` installs rrpc in editable mode; this is the fallback for a bare
# checkout. Spawned workers inherit sys.path, so it reaches them too.
_TESTS = Path(__file__).resolve().parent
for _path in (str(_TESTS.parent), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from crash_marks import (  # noqa: E402, F401 -- hooks, registered from here
    pytest_configure,
    pytest_runtest_logfinish,
    pytest_runtest_setup,
)

import harness  # noqa: E402 -- needs the path above


@pytest.fixture(autouse=True)
def _stop_leftover_workers():
    """A WorkerGroup left open (not used with `with`) is stopped when its test ends."""
    yield
    harness.kill_leftovers()


@pytest.fixture(autouse=True)
def _unmark_the_test_thread():
    """A test that drives a stream's reader on its own thread marks that thread
    a transport thread (``messages.mark_transport_thread``); the next test's
    callbacks must not see the mark."""
    yield
    from rrpc import messages

    messages.thread_state.transport = False


@pytest.fixture(scope="module")
def cluster():
    """Three rrpc workers kept up for a module's tests; ``cluster.run(fn, *args)``
    runs fn on worker0 (see harness.Cluster)."""
    world = harness.Cluster(world_size=3)
    try:
        yield world
    finally:
        world.close()


class _Echo(grpc.GenericRpcHandler):
    """Echoes every packet; a packet b"fail" ends the stream with INTERNAL."""

    def service(self, details: grpc.HandlerCallDetails):
        return grpc.stream_stream_rpc_method_handler(self._echo)

    @staticmethod
    def _echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for request in requests:
            if request == b"fail":
                context.abort(grpc.StatusCode.INTERNAL, "asked to fail")
            yield request


@pytest.fixture
def echo_channel():
    """A channel to a bare grpcio server in this process that echoes each
    packet of a stream of ``harness.ECHO_METHOD``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((_Echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(grace=None)
