"""A script written for torchrun runs unchanged: init_rpc(name) takes everything from its env."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import free_port, run_command

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT = SCRIPTS / "torchrun_ring.py"
REPO = Path(__file__).resolve().parent.parent


def _torchrun(
    *launcher_args: str, timeout: float = 90.0, script: Path = SCRIPT, **extra_env: str
) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(script)]
    return run_command(command, timeout=timeout, env=env, cwd=REPO)


def _ring_lines(output: str) -> list[str]:
    return sorted(line for line in output.splitlines() if line.startswith("RING "))


# calls: the callee's own counter, in its own copy of the script's globals.
EXPECTED = [
    "RING rank=0 world=3 next=worker1 sum=0 self=100 calls=[1, 2]",
    "RING rank=1 world=3 next=worker2 sum=45 self=101 calls=[1, 2]",
    "RING rank=2 world=3 next=worker0 sum=90 self=102 calls=[1, 2]",
]


def test_script_under_torchrun_with_three_processes_calls_around_the_ring():
    result = _torchrun("--nproc-per-node", "3", "--master-addr", "127.0.0.1",
                       "--master-port", str(free_port()))  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert _ring_lines(result.stdout) == EXPECTED, result.stdout[-4000:]


@pytest.mark.slow
def test_script_under_torchrun_standalone_c10d_rendezvous_calls_around_the_ring():
    result = _torchrun("--standalone", "--nproc-per-node", "3")
    assert result.returncode == 0, result.stdout[-4000:]
    assert _ring_lines(result.stdout) == EXPECTED, result.stdout[-4000:]


def _result_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


@pytest.mark.slow
def test_pytorch_batch_parameter_server_tutorial_gives_torchs_weights_under_torchrun():
    results = {}
    for framework in ("torch", "rrpc"):
        result = _torchrun(
            "--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), script=SCRIPTS / "batch_param_server.py", FRAMEWORK=framework,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:]
        results[framework] = _result_line(result.stdout)
    assert results["rrpc"] == results["torch"]
