"""The conformance runner's verdict and report, on made-up results (no processes),
and the zygote's work-around for a deadlock of torch's own (one process of its own).

``make conformance`` must fail when rrpc fails a test it may not (one that is
no known difference and that torch passes here), and print the table the
README shows.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from conformance import runner
from conformance.known_differences import KNOWN_DIFFERENCES

KNOWN = next(iter(KNOWN_DIFFERENCES))


def _result(outcome: str) -> dict:
    return {"outcome": outcome, "short": f"it did {outcome}", "duration": 1.0}


def _entry(test: str, suite: str = "rpc", **results: str) -> dict:
    entry = {"test": test, "suite": suite}
    entry.update({framework: _result(outcome) for framework, outcome in results.items()})
    runner.classify(entry)
    return entry


def _document(entries: list[dict], frameworks=("torch", "rrpc")) -> dict:
    return {
        "meta": {"elapsed_s": 1.0},
        "totals": runner.totals(entries, frameworks),
        "results": entries,
    }


@pytest.fixture
def run_returns(monkeypatch, tmp_path):
    """Make main() see these entries instead of running anything."""

    def set_entries(entries, frameworks=("torch", "rrpc")):
        document = _document(entries, frameworks)
        monkeypatch.setattr(runner, "run", lambda **_: document)

    yield set_entries


def test_a_failure_on_rrpc_that_is_no_known_difference_makes_the_run_fail(run_returns, capsys):
    run_returns(
        [
            _entry("RpcTest.test_add", torch="pass", rrpc="pass"),
            _entry("RpcTest.test_broken_here", torch="pass", rrpc="fail"),
        ]
    )
    assert runner.main(["--suite", "rpc"]) == 1
    out = capsys.readouterr().out
    assert "1 test(s) failed that are no known difference:" in out
    assert "RpcTest.test_broken_here (rrpc: fail: it did fail)" in out


@pytest.mark.parametrize("outcome", ["timeout", "error"])
def test_a_timeout_or_an_error_on_rrpc_makes_the_run_fail_too(run_returns, outcome):
    run_returns([_entry("RpcTest.test_slow", torch="pass", rrpc=outcome)])
    assert runner.main([]) == 1


def test_known_differences_and_environment_broken_tests_do_not_fail_the_run(run_returns):
    run_returns(
        [
            _entry("RpcTest.test_add", torch="pass", rrpc="pass"),
            _entry(KNOWN, torch="pass", rrpc="fail"),
            _entry("DdpComparisonTest.test_ddp_comparison", "ddp", torch="timeout", rrpc="fail"),
            _entry("RpcTest.test_skipped", torch="skipped", rrpc="skipped"),
        ]
    )
    assert runner.main([]) == 0


def test_rrpc_alone_fails_on_any_failure_not_a_known_difference(run_returns):
    run_returns([_entry("RpcTest.test_x", rrpc="fail")], frameworks=("rrpc",))
    assert runner.main(["--framework", "rrpc"]) == 1
    run_returns([_entry(KNOWN, rrpc="fail")], frameworks=("rrpc",))
    assert runner.main(["--framework", "rrpc"]) == 0


def test_torch_alone_fails_on_any_failure_of_torch(run_returns):
    run_returns([_entry("RpcTest.test_x", torch="timeout")], frameworks=("torch",))
    assert runner.main(["--framework", "torch"]) == 1


def test_the_report_is_the_readme_table_per_suite_then_all_suites(run_returns, capsys):
    entries = [
        _entry("RpcTest.test_add", torch="pass", rrpc="pass"),
        _entry(KNOWN, torch="pass", rrpc="fail"),
        _entry("DistAutogradTest.test_backward_simple", "dist_autograd", torch="pass", rrpc="pass"),
    ]
    entries.append({"test": "RpcTest.test_jit", "suite": "rpc", "na": "TorchScript: ..."})
    run_returns(entries)
    runner.main([])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table == [
        "| suite | framework | pass | fail | timeout | error | known difference | skipped "
        "| not applicable | environment-broken |",
        "|---|---|---|---|---|---|---|---|---|---|",
        "| rpc | torch (control) | 2 |  |  |  |  |  | 1 |  |",
        "| rpc | rrpc | 1 |  |  |  | 1 |  | 1 |  |",
        "| dist_autograd | torch (control) | 1 |  |  |  |  |  |  |  |",
        "| dist_autograd | rrpc | 1 |  |  |  |  |  |  |  |",
        "| all suites | torch (control) | 3 |  |  |  |  |  | 1 |  |",
        "| all suites | rrpc | 2 |  |  |  | 1 |  | 1 |  |",
    ]


def test_every_part_a_not_applicable_reason_names_is_a_test_of_parts_py():
    # Read, not imported: conformance.parts imports torch's suites, which the
    # zygote imports after the shim.
    import ast
    import re
    from pathlib import Path

    from conformance.not_applicable import NOT_APPLICABLE

    source = (Path(runner.__file__).parent / "parts.py").read_text()
    tests = {
        (node.name, item.name)
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name.startswith("test_")
    }
    named = {
        (cls, name)
        for reason in NOT_APPLICABLE.values()
        for cls, name in re.findall(r"(\w+Parts)\.(test_\w+)", reason)
    }
    assert named, "no reason names a part"
    assert named <= tests, sorted(named - tests)


# torch's own teardown deadlock, without RPC: a Reducer that frees the last
# reference to its ProcessGroupGloo (with the GIL held) while a gloo worker
# needs the GIL to drop the Python object of an all_reduce's tensor.
_TEARDOWN = """
import torch
import torch.distributed as dist
from conformance import zygote

zygote._keep_destroyed_groups()
for _ in range(50):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    reducer = dist.Reducer([torch.nn.Parameter(torch.zeros(3))], [[0]], [1 << 20], group)
    tensor = torch.ones(1)
    dist.all_reduce(tensor, async_op=True)  # its work dropped at once, as DDP does
    del tensor
    dist.destroy_process_group()  # as the DdpComparison tests, before their module goes
    del group, reducer
    zygote._destroyed_groups.clear()  # as _run_rank, once the test returned
print("done")
"""


@pytest.mark.timeout(120)
def test_the_zygote_keeps_a_reducer_from_freeing_its_process_group_with_the_gil_held():
    # Without _keep_destroyed_groups this hangs in its first iteration here.
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _TEARDOWN], cwd=root, capture_output=True, text=True, timeout=90
    )
    assert done.stdout.strip() == "done", done.stderr[-2000:]
