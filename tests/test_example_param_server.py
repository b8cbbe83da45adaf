"""examples/param_server: two trainers and a parameter server learn the digits data set.

Runs the example as a user would (`python examples/param_server/main.py --smoke`)
and reads the outcome from its metrics file. Smoke size: 2 trainers, 4 epochs,
which reach 0.95..0.98 test accuracy on 450 held-out digits here; the test asks
0.93. The slow test runs the default size against the issue's target.
"""

import json
import subprocess
import time
from pathlib import Path

import pytest

from harness import run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "param_server" / "main.py"
# Seconds. A smoke run takes ~10 s on an idle 2-core machine; starting three
# processes that import torch takes far longer on a busy one.
TIMEOUT = 240
MIN_ACCURACY = 0.93


def run_example(*args: str) -> subprocess.CompletedProcess:
    return run_script(EXAMPLE, *args, timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("framework", ["rrpc", pytest.param("torch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["sync", "batched"])
def test_smoke_run_reaches_test_accuracy_on_held_out_digits(mode, framework, tmp_path):
    run = run_example("--smoke", "--mode", mode, "--framework", framework, "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["framework"], metrics["mode"], metrics["trainers"]) == (framework, mode, 2)
    history = metrics["history"]
    assert [h["epoch"] for h in history] == list(range(1, metrics["epochs"] + 1))
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert metrics["final_test_accuracy"] >= MIN_ACCURACY, run.stdout[-3000:]
    assert all(h["samples_per_s"] > 0 for h in history)
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert str(tmp_path / "metrics.json") in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("mode", ["sync", "batched"])
def test_default_run_meets_the_issue_target_095_accuracy_within_2_minutes(mode, tmp_path):
    started = time.monotonic()
    run = run_example("--mode", mode, "--out", str(tmp_path))
    seconds = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:]

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["trainers"] == 2
    assert metrics["final_test_accuracy"] >= 0.95, run.stdout[-3000:]
    assert seconds < 120
