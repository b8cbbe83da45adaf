"""examples/rl_agents: the agent's REINFORCE policy, fed by two observers over RPC, learns CartPole.

Runs the example as a user would (`python examples/rl_agents/main.py --smoke`)
and reads the outcome from its metrics file.
"""

import json
import subprocess
from pathlib import Path

import pytest

from harness import run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl_agents" / "main.py"
SMOKE_THRESHOLD = 100.0  # the example's --smoke target running reward
TIMEOUT = 100  # seconds; the run takes ~20 s on an idle 2-core machine


def run_example(*args: str) -> subprocess.CompletedProcess:
    return run_script(EXAMPLE, *args, timeout=TIMEOUT)


@pytest.mark.parametrize("framework", ["rrpc", pytest.param("torch", marks=pytest.mark.slow)])
def test_smoke_run_reaches_running_reward_threshold_with_two_observers(framework, tmp_path):
    run = run_example("--smoke", "--framework", framework, "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["framework"] == framework
    assert metrics["observers"] == 2
    assert metrics["threshold"] == SMOKE_THRESHOLD
    assert metrics["solved"] is True
    assert metrics["running reward"][-1] >= SMOKE_THRESHOLD
    assert metrics["running reward"][-1] == metrics["final_running_reward"]
    assert len(metrics["episode reward"]) == metrics["episodes"]
    assert (tmp_path / "reward.png").stat().st_size > 0
    assert "solved" in run.stdout and str(tmp_path / "metrics.json") in run.stdout
