"""Under pytest-xdist, a test that ended its process is not run again.

`make test` runs the suite in pytest-xdist processes, a module's tests in one
(--dist loadscope). A test past its timeout ends its process (timeout_method
"thread", pyproject.toml); xdist reports the test failed, then hands the
module's unfinished tests, that one included, to a new process, where it would
time out again, up to xdist's restart limit, and the module's other tests
would never run. Each test leaves a mark while it runs: one that finds its own
mark left by an earlier process is skipped. Hooks, registered by conftest.py;
tests/test_harness.py runs a suite that hangs under them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

_marks: list[Path] = []  # under xdist: the directory of this run's marks


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:
        # xdist gives each process <the run's basetemp>/popen-gwN: the run's is
        # shared by its processes only, and pytest removes it in a later run.
        run = Path(config.option.basetemp).parent / "rrpc-running"
        run.mkdir(exist_ok=True)
        _marks.append(run)


def _mark(nodeid: str) -> Path | None:
    return _marks[0] / hashlib.sha1(nodeid.encode()).hexdigest() if _marks else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = _mark(item.nodeid)
    if mark is None:
        return
    if mark.exists():
        pytest.skip("it ended an earlier test process of this run (reported as failed there)")
    mark.touch()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    mark = _mark(nodeid)
    if mark is not None:
        mark.unlink(missing_ok=True)
