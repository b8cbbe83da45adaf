"""A representative subset of torch's own RPC test suites, run on rrpc (see conformance/).

Each test id is one of torch's tests ("Class.test_name") from ``conformance.subset``;
it runs through the same zygote and verdict as ``make conformance``, on rrpc
only. The whole subset takes about two minutes here. ``make conformance`` runs
every suite on torch and rrpc.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.runner import Frameworks, short_reason
from conformance.subset import SUBSET
from conformance.timeouts import timeout_for

ZYGOTE_START = 120.0  # the first test also waits for the zygote's imports


@pytest.fixture(scope="module")
def rrpc_zygote():
    log_root = Path(__file__).resolve().parent.parent / "conformance" / "out" / "subset-logs"
    group = Frameworks(("rrpc",), log_root)
    try:
        yield group
    finally:
        group.close()


@pytest.mark.parametrize("test", SUBSET)
def test_torch_suite_on_rrpc(rrpc_zygote, test, request):
    # The test's own limit, as `make conformance` gives it: most take a few
    # seconds, the examples and DDP up to a minute on a loaded machine.
    limit = timeout_for(test)
    request.node.add_marker(pytest.mark.timeout(limit + ZYGOTE_START))
    result = rrpc_zygote.run("rrpc", test, limit)
    if result["outcome"] != "pass":
        detail = result.get("reason", "")[-3000:]
        pytest.fail(
            f"{test} on rrpc: {result['outcome']}: {short_reason(result)}\n{detail}\n"
            f"logs: {result.get('logs')}",
            pytrace=False,
        )
