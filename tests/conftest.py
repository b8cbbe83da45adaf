"""Shared test set-up: `import rrpc` and `import harness` work, and no worker outlives its test."""

import sys
from pathlib import Path

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
